"""Loading a model for inference stays on torch's eager core: building the empty model on the meta device must not
reach torch's Python reference kernels, whose first use imports Dynamo and sympy (measured: 1.9 s of a 5.4 s
`minigpt generate` of a 135M model before this was fixed)."""
import subprocess
import sys

import pytest
from conftest import random_model

from minigpt.checkpoint.native import load_model, save_pretrained
from minigpt.checkpoint.quantized import save_quantized
from minigpt.model.quant import quantize_model

SHAPE = {"vocab_size": 96, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "hidden_dim": 96,
         "max_seq_len": 32, "pos_encoding": "rope"}

CHILD = """
import sys, torch
from minigpt.infer.fastpath import load_for_inference
before = {m for m in ("torch._dynamo", "sympy") if m in sys.modules}
fast = load_for_inference(sys.argv[1], quantize=sys.argv[2] if sys.argv[2] != "none" else None)
assert fast.decode_step is not None
print(sorted({m for m in ("torch._dynamo", "sympy") if m in sys.modules} - before))
"""


@pytest.mark.parametrize("kind", ["float", "int8 on load", "int4 saved"])
def test_loading_for_inference_imports_neither_dynamo_nor_sympy(tmp_path, kind):
    model = random_model(SHAPE)
    if kind == "int4 saved":
        path = save_quantized(quantize_model(model, "int4_weight_only"), tmp_path / "m")
    else:
        path = save_pretrained(model, tmp_path / "m")
    quantize = "int8" if kind == "int8 on load" else "none"
    loaded = subprocess.run([sys.executable, "-c", CHILD, str(path), quantize], capture_output=True, text=True,
                            timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.strip() == "[]"


def test_a_model_loaded_through_the_meta_device_has_its_weights_and_rope_tables(tmp_path):
    model = random_model(SHAPE)
    loaded = load_model(save_pretrained(model, tmp_path / "m"))
    for name, t in model.state_dict().items():
        assert loaded.state_dict()[name].equal(t), name
    assert loaded.rope_cos.device.type == "cpu" and loaded.rope_cos.equal(model.rope_cos)
    assert loaded.rope_sin.equal(model.rope_sin)
