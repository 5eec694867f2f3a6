"""int8 weight-only quantization: the rounding bound per weight, int8 matmul == dequantized matmul, save/load of the
quantized format, the fast path over int8 weights, and the perplexity change on a small real slice."""
import json
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model

from minigpt.checkpoint.native import load_model, save_pretrained
from minigpt.checkpoint.quantized import save_quantized
from minigpt.errors import MiniGPTError
from minigpt.infer.fastpath import FastPath, prepare
from minigpt.model.quant import (
    Int8Linear,
    dequantize_weight,
    int8_linear,
    is_quantized,
    quantize_model,
    quantize_weight,
)
from minigpt.model.transformer import lm_loss

torch.set_num_threads(1)


def test_quantize_weight_rounding_bound_and_range():
    torch.manual_seed(0)
    w = torch.randn(48, 80) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different magnitude
    w[5] = 0.0
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (48,) and scale.dtype == torch.float32
    assert q.abs().max() <= 127 and (q.abs().amax(1)[torch.arange(48) != 5] == 127).all()  # each row uses the range
    err = (dequantize_weight(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-12).all()  # round-to-nearest: at most half a step per weight
    assert torch.equal(q[5], torch.zeros(80, dtype=torch.int8))


def test_int8_matmul_equals_dequantized_matmul():
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 40, bias=True)
    x = torch.randn(3, 7, 96)
    q, scale = quantize_weight(lin.weight)
    y = int8_linear(x, q, scale, lin.bias)
    torch.testing.assert_close(y, F.linear(x, dequantize_weight(q, scale), lin.bias), atol=1e-5, rtol=1e-5)
    # Against the float layer: |x (W - Wq)^T| <= sum_i |x_i| * scale_o / 2 per output.
    bound = x.abs().sum(-1, keepdim=True) * scale / 2
    assert ((y - lin(x)).abs() <= bound + 1e-5).all()
    layer = Int8Linear.from_linear(lin)
    torch.testing.assert_close(layer(x), y, atol=0, rtol=0)


SHAPE = dict(vocab_size=61, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48, multiple_of=16)
_model = partial(random_model, SHAPE)


@pytest.mark.parametrize("tied", [True, False])
def test_quantized_checkpoint_round_trip(tmp_path, tied, float32_prefill):
    model = _model(tie_embeddings=tied, attention_bias=True)
    quantize_model(model)
    assert is_quantized(model) and isinstance(model.output, Int8Linear)
    tokens = torch.randint(0, 61, (2, 20))
    with torch.inference_mode():
        ref = model(tokens)
    path = save_quantized(model, tmp_path / "q")
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"] == {"method": "int8_weight_only", "granularity": "per_output_channel"}
    loaded = load_model(path)
    assert is_quantized(loaded)
    sd, ref_sd = loaded.state_dict(), model.state_dict()
    assert sd.keys() == ref_sd.keys() and all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    assert sd["layers.0.attention.wq.weight"].dtype == torch.int8
    with torch.inference_mode():
        torch.testing.assert_close(loaded(tokens), ref, atol=0, rtol=0)
        # The fast path over int8 weights (fused int8 rows and scales; float activations on the generated loops)
        # computes the same logits.
        torch.testing.assert_close(FastPath(loaded, woq_kernel="words")(tokens), ref, atol=1e-5, rtol=0)
        # By default int8 products round their activations to 8 bits per row (test_fastpath_w8a8's 2 % bound).
        fast = FastPath(loaded)(tokens)
        assert ((fast - ref).norm() / ref.norm()).item() < 0.02
    # A fused model saves too (its tensors are views of shared storage, which safetensors refuses unless copied).
    save_quantized(loaded, tmp_path / "q2")
    assert torch.equal(load_model(tmp_path / "q2")(tokens), ref)


def test_quantized_checkpoint_errors(tmp_path):
    model = quantize_model(_model())
    path = save_quantized(model, tmp_path / "q")
    config = json.loads((path / "config.json").read_text())
    config["quantization"]["method"] = "int4_awq"
    (path / "config.json").write_text(json.dumps(config))
    (path / "manifest.json").unlink()  # edited on purpose: the manifest would flag it as corrupt
    with pytest.raises(MiniGPTError, match="int4_awq"):
        load_model(path)
    with pytest.raises(ValueError, match="quantized model"):
        save_quantized(_model(), tmp_path / "f")


def test_export_refuses_a_quantized_model(tmp_path):
    from minigpt.checkpoint.convert import export_hf

    path = save_quantized(quantize_model(_model()), tmp_path / "q")
    with pytest.raises(MiniGPTError, match="int8"):
        export_hf(path, tmp_path / "hf")


@pytest.mark.slow
def test_int8_perplexity_change_on_real_text_is_small(tiny_data):
    """Train a small model briefly on the Shakespeare slice, then compare validation perplexity of float and int8
    weights (the full-size measurement on the `small` preset is in docs/benchmarks.md)."""
    from minigpt.data.loader import load_split
    from minigpt.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_data)
    train = torch.from_numpy(load_split(tiny_data, "train").astype("int64"))
    val = torch.from_numpy(load_split(tiny_data, "val").astype("int64"))
    model = _model(vocab_size=tok.vocab_size, dim=64, max_seq_len=64).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(120):
        idx = torch.randint(0, len(train) - 65, (16,), generator=g)
        batch = torch.stack([train[i:i + 65] for i in idx])
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    n = (len(val) - 1) // 64
    windows = val[: n * 64 + 1]
    x, y = windows[:-1].view(n, 64), windows[1:].view(n, 64)
    with torch.inference_mode():
        ppl = math.exp(lm_loss(model(x), y).item())
        quantize_model(model)
        ppl_q = math.exp(lm_loss(model(x), y).item())
    assert ppl < 0.5 * tok.vocab_size  # it learned something: uniform guessing is ppl = vocab size
    assert abs(ppl_q - ppl) / ppl < 0.01, (ppl, ppl_q)


def test_prepare_quantizes_and_fuses():
    model = _model()
    tokens = torch.randint(0, 61, (1, 16))
    with torch.inference_mode():
        ref = model(tokens)
        fast = prepare(model, quantize="int8")
        assert is_quantized(model) and fast.fused
        out = fast(tokens)
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    with pytest.raises(ValueError, match="unknown quantization 'int3'; choose int8, int4 or none"):
        prepare(_model(), quantize="int3")


def test_quant_report_on_a_checkpoint(tiny_data, tmp_path):
    """`minigpt bench quant`'s report: perplexity of both, relative change, decode speeds (values not asserted)."""
    from minigpt.analysis.bench.reports import quant_report
    from minigpt.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_data)
    ckpt = save_pretrained(_model(vocab_size=tok.vocab_size), tmp_path / "m", tokenizer=tok)
    r = quant_report(str(ckpt), str(tiny_data), seq_len=32, max_windows=8, repeats=1, new_tokens=4)
    assert r["val_tokens_scored"] == 8 * 32
    assert abs(r["ppl_int8"] / r["ppl_float32"] - 1 - r["ppl_relative_change"]) < 1e-12
    assert set(r["decode_b1_tokens_per_s"]) == {"float32", "int8"}
    assert r["weight_bytes"]["int8"] < 0.5 * r["weight_bytes"]["float32"]
