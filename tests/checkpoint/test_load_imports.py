"""Loading a model for inference stays on torch's eager core: building the empty model on the meta device must not
reach torch's Python reference kernels, whose first use imports Dynamo and sympy (measured: 1.9 s of a 5.4 s
`minigpt generate` of a 135M model before this was fixed)."""
import subprocess
import sys

import pytest
import torch
from conftest import random_model, some_slow

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


@pytest.mark.parametrize("kind", some_slow(["float", "int8 on load", "int4 saved"], ("int8 on load", "int4 saved")))
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


def _mapped_ranges(name: str) -> list[tuple[int, int]]:
    with open("/proc/self/maps") as f:
        return [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f if line.rstrip().endswith(name)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_float_weights_are_the_files_own_pages_not_a_copy_and_the_head_stays_tied(tmp_path):
    model = random_model({**SHAPE, "tie_embeddings": True})
    path = save_pretrained(model, tmp_path / "m")
    loaded = load_model(path)
    ranges = _mapped_ranges("model.safetensors")
    assert ranges, "the weights file is not memory-mapped"
    for name, p in loaded.named_parameters():
        assert any(lo <= p.data_ptr() < hi for lo, hi in ranges), name  # a copy would live elsewhere
        assert p.equal(model.state_dict()[name]), name
    assert loaded.output.weight is loaded.tok_embeddings.weight


def test_weights_stored_in_another_dtype_are_converted_on_load(tmp_path):
    model = random_model(SHAPE)
    path = save_pretrained(model.to(torch.bfloat16), tmp_path / "m")
    loaded = load_model(path)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert load_model(path, dtype=torch.bfloat16).layers[0].attention.wq.weight.equal(
        model.layers[0].attention.wq.weight)


def test_changing_a_loaded_models_weights_in_place_never_reaches_the_file(tmp_path):
    """The mapping is private (copy on write): training or merging an adapter into a loaded model in place must
    leave its checkpoint as it was."""
    model = random_model(SHAPE)
    path = save_pretrained(model, tmp_path / "m")
    before = (path / "model.safetensors").read_bytes()
    loaded = load_model(path)
    with torch.no_grad():
        for p in loaded.parameters():
            p.add_(1.0)
    assert (path / "model.safetensors").read_bytes() == before
    assert all(a.equal(b) for a, b in zip(load_model(path).parameters(), model.parameters()))
