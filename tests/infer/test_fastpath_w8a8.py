"""The int8 LM head through oneDNN's int8 x int8 product (:func:`minigpt.infer.fastpath.kernels.w8a8_linear`):
activations rounded to 8 bits per row, close to the float-activation product, each row of a batch independent of
the others, used by decode steps (eager and compiled) of int8 and int4 models on ATen's kernels and by nothing
else, and stories260K's greedy text unchanged."""
import copy
from functools import partial

import pytest
import torch
from conftest import random_model

from minigpt.infer.fastpath import Proj, prepare
from minigpt.infer.fastpath.kernels import aten_woq_layout, w8a8_layout, w8a8_linear
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.model.quant import dequantize_weight, quantize_weight

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")

SHAPE = dict(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96, multiple_of=16)
make = partial(random_model, SHAPE, noise=0.05)

# Rounding x to 8 bits per row: step s = max|x| / 127, error uniform in +-s/2, RMS s / sqrt(12). For Gaussian rows
# of 96 values max|x| is ~2.5-3.3 standard deviations, so the relative error of x (and of the product, which sums
# those errors with independent weights) is ~0.6-0.8 %; bound 2 %. A wrong zero point or scale gives ~1 or more.
W8A8_BOUND = 0.02


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _head(out=48, n_in=96, bias=True):
    torch.manual_seed(0)
    q, s = quantize_weight(torch.randn(out, n_in))
    p = Proj(q, s, torch.randn(out) if bias else None)
    assert aten_woq_layout(p) and w8a8_layout(p)
    return p, dequantize_weight(q, s)


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_w8a8_product_is_close_to_the_float_activation_product(rows):
    p, dense = _head()
    x = torch.randn(rows, 1, 96)
    want = x @ dense.T + p.bias
    got = w8a8_linear(p, x)
    assert got.shape == (rows, 1, 48) and got.dtype == x.dtype
    err = rel(got, want)
    assert 0 < err < W8A8_BOUND  # 0: it would not be rounding the activations at all


def test_each_row_is_quantized_on_its_own():
    """A row's result is the same alone and beside a row 1000x larger: one shared activation scale would round the
    small row to a few levels (its error ~100 %)."""
    p, dense = _head(bias=False)
    x = torch.randn(4, 96)
    x[2] *= 1000.0
    batch = w8a8_linear(p, x)
    for i in range(4):
        assert torch.equal(batch[i], w8a8_linear(p, x[i:i + 1])[0])
    assert rel(batch[0], x[0] @ dense.T) < W8A8_BOUND


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_the_int8_head_of_quantized_models_takes_it_and_nothing_else(quantize):
    fast = prepare(make(), quantize=quantize, woq_kernel="aten")
    assert fast.head.w8a8 is not None
    assert all(p.w8a8 is None for lw in fast.layers for p in (lw.wqkv, lw.wo, lw.w13, lw.w2))
    assert prepare(make(), quantize=quantize, woq_kernel="words").head.w8a8 is None
    assert prepare(make(), woq_kernel="aten").head.w8a8 is None  # float weights


def test_compiled_steps_apply_the_head_outside_the_graph_and_equal_eager():
    """The compiled step returns the final-norm states and the wrapper applies the head (oneDNN's packed weight is
    opaque to Inductor): same head, same rows, so the logits equal eager decode's up to the layers' own
    difference (measured ~6e-3 for the ATen path, test_fastpath_woq_aten)."""
    tokens = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(3))
    outs = []
    with torch.inference_mode():
        for compile in (False, True):
            fast = prepare(make(), quantize="int8", compile=compile, woq_kernel="aten")
            assert fast.head.w8a8 is not None and fast.compiled == compile
            cache = fast.new_kv_cache(2, 12)
            fast(tokens[:, :6], 0, cache)
            outs.append(torch.stack([fast.decode_step(tokens[:, i:i + 1], i, cache) for i in range(6, 12)], 1))
    assert outs[1].shape == (2, 6, 61)
    assert rel(outs[1], outs[0]) < 2 ** -6


GREEDY_32 = SamplingParams(max_tokens=32, temperature=0)


def test_stories260k_greedy_text_is_unchanged_by_the_w8a8_head(shared_data):
    folder = shared_data / "models" / "stories260K" / "hf"
    if not (folder / "config.json").is_file():
        pytest.skip(f"stories260K is not in {folder}")
    from minigpt.checkpoint.native import load_model

    model = load_model(folder)
    for quantize in ("int8", "int4"):
        fast = prepare(copy.deepcopy(model), quantize=quantize, woq_kernel="aten")
        assert fast.head.w8a8 is not None
        with_it = list(generate_tokens(fast, [1], GREEDY_32))
        fast.head.w8a8 = None  # the same model on ATen's weight-only head
        assert list(generate_tokens(fast, [1], GREEDY_32)) == with_it
