"""Prefill (more than DECODE_ROWS_MAX rows) of bf16, int8 and int4 weights on a CPU with native bf16 (AVX512-BF16
/ AMX): the weight as stored or dequantized to bf16 and oneDNN's bf16 GEMM (``Proj._gemm``), within bf16 rounding
of the float32 product; on other CPUs, the float32 product. Either way a converted weight is converted a slice of
rows at a time (``PREFILL_SLICE_BYTES``), and the product is the whole matrix's."""
from functools import partial

import pytest
import torch
from conftest import random_model

from minigpt.infer.fastpath import DECODE_ROWS_MAX, Proj, kernels, prepare
from minigpt.infer.fastpath.float_mv import FLOAT_MV_ENV
from minigpt.infer.fastpath.library import aten_woq_wanted
from minigpt.model.quant import dequantize_weight, dequantize_weight_int4, quantize_weight, quantize_weight_int4
from minigpt.runtime import native_bf16

torch.set_num_threads(1)

SHAPE = dict(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96, multiple_of=16)
make = partial(random_model, SHAPE, noise=0.05)
needs_bf16 = pytest.mark.skipif(not native_bf16("cpu"), reason="this CPU has no native bf16 (AVX512-BF16 / AMX)")

# x rounded to bf16 (relative error <= 2^-9 per value), int4 weights' (q - 8) * scale too (int8 levels are exact
# in bf16), float32 accumulation: the product's relative error (Frobenius) stays near 2^-9; a wrong scale, group
# or nibble order gives ~1.
BF16_PRODUCT = 2 ** -7


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _proj(kind: str):
    torch.manual_seed(0)
    w, bias = torch.randn(48, 96), torch.randn(48)
    if kind == "bf16":
        w = w.bfloat16()
        return Proj(w, None, bias), w.float(), bias
    if kind == "int8":
        q, s = quantize_weight(w)
        return Proj(q, s, bias), dequantize_weight(q, s), bias
    q, s = quantize_weight_int4(w, 32)
    return Proj(q, s, bias), dequantize_weight_int4(q, s, 32), bias


@needs_bf16
@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_many_rows_go_through_the_bf16_gemm_within_bf16_rounding(kind):
    p, dense, bias = _proj(kind)
    x = torch.randn(DECODE_ROWS_MAX + 8, 96)
    got = p(x)
    assert got.dtype == torch.float32 and got.shape == (DECODE_ROWS_MAX + 8, 48)
    err = rel(got, x @ dense.T + bias)
    assert 0 < err < BF16_PRODUCT  # 0: it would still be the float32 product


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_without_native_bf16_prefill_keeps_the_float32_product(kind, monkeypatch):
    monkeypatch.setattr(kernels, "native_bf16", lambda device_type="cpu": False)
    p, dense, bias = _proj(kind)
    x = torch.randn(DECODE_ROWS_MAX + 8, 96)
    assert torch.allclose(p(x), x @ dense.T + bias, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_a_converted_weight_is_converted_a_slice_of_rows_at_a_time(kind, native, monkeypatch):
    """With the slice budget at 16 rows' worth, the 48-row weight is converted in three slices of 16 rows, in
    order, and the product is the one-slice product (float32: to rounding; bf16: each column's sums are the same
    GEMM's)."""
    if native and not native_bf16("cpu"):
        pytest.skip("this CPU has no native bf16 (AVX512-BF16 / AMX)")
    monkeypatch.setattr(kernels, "native_bf16", lambda device_type="cpu": native)
    monkeypatch.setenv(FLOAT_MV_ENV, "0")  # the GEMM's path, not minigpt::float_mm's (tests/infer/test_float_mv.py)
    p, dense, bias = _proj(kind)
    x = torch.randn(DECODE_ROWS_MAX + 8, 96)
    whole = p(x)
    row_bytes = 96 * (2 if native else 4)
    monkeypatch.setattr(kernels, "PREFILL_SLICE_BYTES", 16 * row_bytes + row_bytes // 2)
    slices, original = [], Proj.converted
    monkeypatch.setattr(Proj, "converted", lambda self, dtype, start=0, stop=None:
                        slices.append((start, stop, dtype)) or original(self, dtype, start, stop))
    got = p(x)
    dtype = torch.bfloat16 if native else torch.float32
    if kind == "bf16" and native:
        assert slices == []  # bf16 weights go to the bf16 GEMM as they are
    else:
        assert slices == [(0, 16, dtype), (16, 32, dtype), (32, 48, dtype)]
    assert torch.allclose(got, whole, rtol=1e-5, atol=1e-5 if not native else 2e-2)
    assert rel(got, x @ dense.T + bias) < (BF16_PRODUCT if native else 1e-6)


@needs_bf16
@pytest.mark.parametrize("quantize", ["bf16", "int8", "int4"])
def test_a_quantized_models_prefill_logits_stay_within_bf16_rounding(quantize, monkeypatch):
    """Two layers and the head, 24 prompt tokens (int4: more than INT4_ATEN_ROWS_MAX): the logits against the
    float32 prefill on the same weights. Bound: twice
    one product's, the norms rescaling rather than compounding the errors. (int8 on ATen's kernels: by default its
    rows of any number go through FBGEMM, test_fastpath_w8a8.)"""
    n = 24 if quantize == "int8" else kernels.INT4_ATEN_ROWS_MAX + 8  # int4: past the rows ATen's kernel takes
    tokens = torch.randint(0, 61, (1, n), generator=torch.Generator().manual_seed(4))
    if quantize == "bf16":  # bf16 weights: the bf16 GEMM on them as stored
        fast = prepare(make(), dtype=torch.bfloat16)
    else:
        fast = prepare(make(), quantize=quantize, woq_kernel="aten")
    with torch.inference_mode():
        bf16 = fast(tokens, 0, fast.new_kv_cache(1, n))
        monkeypatch.setattr(kernels, "native_bf16", lambda device_type="cpu": False)
        fp32 = fast(tokens, 0, fast.new_kv_cache(1, n))
    assert 0 < rel(bf16, fp32) < 2 * BF16_PRODUCT


@pytest.mark.skipif(not aten_woq_wanted("auto"), reason="ATen's int4 kernel serves AVX-512 CPUs only here")
def test_a_short_int4_prompt_goes_through_atens_kernel_like_the_decode_steps(monkeypatch):
    """Up to INT4_ATEN_ROWS_MAX prompt rows: ATen's int4 kernel (faster than dequantizing every matrix for a short
    prompt), and the last position's logits those of a token-by-token prefill through the same kernel."""
    n = kernels.INT4_ATEN_ROWS_MAX
    tokens = torch.randint(0, 61, (1, n), generator=torch.Generator().manual_seed(5))
    fast = prepare(make(), quantize="int4", woq_kernel="aten")
    rows, original = [], kernels.aten_woq_linear
    monkeypatch.setattr(kernels, "aten_woq_linear", lambda p, x, g: rows.append(x.numel() // x.shape[-1])
                        or original(p, x, g))
    with torch.inference_mode():
        whole = fast(tokens, 0, fast.new_kv_cache(1, n), last_only=True)[0, -1]
        assert set(rows) == {n, 1}  # every layer's projections, and the head on the last position
        cache = fast.new_kv_cache(1, n)
        for i in range(n):
            one = fast(tokens[:, i:i + 1], i, cache, last_only=True)[0, -1]
    assert rel(whole, one) < BF16_PRODUCT
