"""Which library computes the fast path's float32 products of many rows (kernels.fp32_gemm_library): oneDNN on AMD
CPUs (oneMKL runs its AVX2 code there), oneMKL through F.linear elsewhere, ``$MINIGPT_FP32_GEMM`` choosing; both
give the same products but for summation order, a prefill through either gives the model's logits, and a product
that needs a gradient never goes through oneDNN's op (it has no autograd formula). Speed: docs/benchmarks.md."""
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model

from minigpt.infer.fastpath import kernels, prepare
from minigpt.infer.fastpath.float_mv import FLOAT_MV_ENV

torch.set_num_threads(1)

needs_onednn = pytest.mark.skipif(not kernels._onednn_linear_available(), reason="this torch has no oneDNN linear")
SHAPE = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, multiple_of=16)
make = partial(random_model, SHAPE, noise=0.02, norm_noise=0.1)


@needs_onednn
@pytest.mark.parametrize("vendor, setting, want", [
    ("AuthenticAMD", "", "onednn"), ("GenuineIntel", "", "mkl"), ("", "", "mkl"),
    ("AuthenticAMD", "mkl", "mkl"), ("GenuineIntel", "onednn", "onednn"), ("GenuineIntel", " OneDNN ", "onednn")])
def test_the_library_follows_the_cpu_vendor_unless_the_variable_chooses(monkeypatch, vendor, setting, want):
    monkeypatch.setattr(kernels, "cpu_vendor", lambda: vendor)
    monkeypatch.setenv(kernels.FP32_GEMM_ENV, setting)
    assert kernels.fp32_gemm_library() == want


def test_an_unknown_library_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(kernels.FP32_GEMM_ENV, "openblas")
    with pytest.raises(ValueError, match="MINIGPT_FP32_GEMM.*onednn or mkl"):
        kernels.fp32_gemm_library()


def _spy_onednn(monkeypatch) -> list:
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(kernels, "_onednn_linear", spy)
    return calls


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_gives_f_linears_product_for_many_rows_and_any_leading_shape(monkeypatch, bias):
    monkeypatch.setenv(kernels.FP32_GEMM_ENV, "onednn")
    calls = _spy_onednn(monkeypatch)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 37, 48, generator=g), torch.randn(80, 48, generator=g)
    b = torch.randn(80, generator=g) if bias else None
    got = kernels.gemm(x, w, b)
    assert calls == [x.shape]
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


@needs_onednn
def test_a_product_that_needs_a_gradient_goes_through_f_linear(monkeypatch):
    monkeypatch.setenv(kernels.FP32_GEMM_ENV, "onednn")
    calls = _spy_onednn(monkeypatch)
    x, w = torch.randn(16, 8), torch.randn(4, 8, requires_grad=True)
    kernels.gemm(x, w).sum().backward()
    assert calls == []
    torch.testing.assert_close(w.grad, x.sum(0).expand(4, 8))
    with torch.no_grad():
        kernels.gemm(x, w)
    assert calls == [x.shape]


@needs_onednn
@pytest.mark.parametrize("library", ["onednn", "mkl"])
def test_a_prefill_through_either_library_gives_the_models_logits(monkeypatch, library):
    monkeypatch.setenv(kernels.FP32_GEMM_ENV, library)
    monkeypatch.setenv(FLOAT_MV_ENV, "0")  # the GEMM's path, not minigpt::float_mm's (tests/infer/test_float_mv.py)
    calls = _spy_onednn(monkeypatch)
    model = make()
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(tokens)
        fp = prepare(make())
        got = fp(tokens, 0, fp.new_kv_cache(2, 24))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Every layer's four projections of the 48 rows, through oneDNN when it is chosen (the LM head too).
    assert len(calls) == (4 * SHAPE["n_layers"] + 1 if library == "onednn" else 0)
