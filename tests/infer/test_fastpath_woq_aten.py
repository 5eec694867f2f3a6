"""ATen's weight-only kernels in decode steps, compiled or eager (``woq_kernel="aten"``, the default on AVX-512 CPUs;
:func:`minigpt.infer.fastpath.library.aten_woq_layout`): int8 (``_weight_int8pack_mm``) and int4
(``_weight_int4pack_mm_for_cpu`` on Q4_0's levels repacked) equal the dequantized product up to bf16 rounding of the
activations, the shapes those kernels get wrong or refuse stay on the generated loops, a compiled model through
them keeps the eager quantized model's logits (random weights) and greedy tokens (stories260K), and an unknown
kernel name is refused."""
import copy
from functools import partial

import pytest
import torch
from conftest import random_model

from minigpt.infer.fastpath import DECODE_ROWS_MAX, FastPath, Proj, decode_linear, kernels, prepare
from minigpt.infer.fastpath.library import aten_woq_layout, aten_woq_wanted
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.model.quant import dequantize_weight, dequantize_weight_int4, quantize_weight, quantize_weight_int4

torch.set_num_threads(1)

SHAPE = dict(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96, multiple_of=16)
make = partial(random_model, SHAPE, noise=0.05)

# One product: x and the result are each rounded to bf16 (8 significant bits, relative error <= 2^-9 per value)
# around a float32 accumulation, so its relative error (Frobenius) is at most ~2^-8; a wrong layout, scale or nibble
# order gives ~1.
ONE_PRODUCT = 2 ** -7


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_aten_kernels_equal_the_dequantized_product(kind):
    torch.manual_seed(0)
    w, bias = torch.randn(48, 96), torch.randn(48)
    if kind == "int8":
        q, s = quantize_weight(w)
        dense = dequantize_weight(q, s)
    else:
        q, s = quantize_weight_int4(w, 32)
        dense = dequantize_weight_int4(q, s, 32)
    p = Proj(q, s, bias)
    assert aten_woq_layout(p) and p.word_scale.dtype == torch.bfloat16
    assert (p.words is None) == (kind == "int8")  # int4: the levels repacked for ATen, a copy
    step = torch.compile(lambda p, x: decode_linear(p, x, 32), dynamic=False, fullgraph=True)
    for rows in (1, DECODE_ROWS_MAX + 1):  # both through the kernel: it takes any number of rows
        x = torch.randn(rows, 1, 96)
        want = x @ dense.T + bias
        assert rel(decode_linear(p, x, 32), want) < ONE_PRODUCT
        assert rel(step(p, x), want) < ONE_PRODUCT


def test_the_shapes_the_kernels_get_wrong_or_refuse_keep_the_generated_loops():
    """int8 rows of 100 inputs (torch 2.13's kernel reads past each activation row unless the length is a multiple
    of 16), int4 with 40 output rows (not a multiple of 16) or groups of 16 (ATen takes 32-256), float weights."""
    torch.manual_seed(0)
    cases = [quantize_weight(torch.randn(32, 100)), quantize_weight_int4(torch.randn(40, 64), 32),
             quantize_weight_int4(torch.randn(32, 64), 16), (torch.randn(32, 64), None)]
    for q, s in cases:
        p = Proj(q, s)
        assert not aten_woq_layout(p)
        assert p.words is None and p.word_scale is None


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_compiled_step_through_aten_equals_the_eager_quantized_model(quantize):
    """Batch 2, 8 decode steps of a 2-layer model: every projection and the head through ATen (the FFN's 176
    inputs do not divide into int4 groups of 32, so ``w2`` is int8 there, also through ATen). Bound: twice one
    product's, for 9 products in sequence (2 layers x 4 and the head) whose errors the norms rescale rather than
    compound; measured 0.0059 (int8) and 0.0058 (int4) against 0.0156."""
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        outs = []
        for kernel in ("words", "aten"):  # the reference: the eager path on the dequantized weights
            fast = prepare(make(), quantize=quantize, compile=kernel == "aten", woq_kernel=kernel)
            cache = fast.new_kv_cache(2, 16)
            fast(tokens[:, :8], 0, cache)
            outs.append(torch.stack([fast.decode_step(tokens[:, i:i + 1], i, cache) for i in range(8, 16)], 1))
    lw = fast.layers[0]
    assert all(p.word_scale.dtype == torch.bfloat16 for p in (fast.head, lw.wqkv, lw.wo, lw.w13, lw.w2))
    assert fast.geometry.group_size == (32 if quantize == "int4" else 0)
    assert rel(outs[1], outs[0]) < 2 * ONE_PRODUCT


GREEDY_32 = SamplingParams(max_tokens=32, temperature=0)


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_compiled_step_through_aten_keeps_the_eager_greedy_tokens_on_stories260k(shared_data, quantize):
    """stories260K's FFN has 172 inputs: its ``w2`` stays on the generated loop (int8 words), which an earlier
    version did not do -- the ATen product of layer 1 came out NaN and the text changed at token 1."""
    folder = shared_data / "models" / "stories260K" / "hf"
    if not (folder / "config.json").is_file():
        pytest.skip(f"stories260K is not in {folder}")
    from minigpt.checkpoint.native import load_model

    model = load_model(folder)
    eager = list(generate_tokens(prepare(copy.deepcopy(model), quantize=quantize, woq_kernel="words"), [1],
                                 GREEDY_32))
    fast = prepare(copy.deepcopy(model), quantize=quantize, compile=True, woq_kernel="aten")
    assert fast.head.word_scale.dtype == torch.bfloat16 and fast.layers[0].wqkv.word_scale.dtype == torch.bfloat16
    assert fast.layers[0].w2.words is not None and fast.layers[0].w2.word_scale is None
    assert list(generate_tokens(fast, [1], GREEDY_32)) == eager


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_eager_decode_steps_use_aten_kernels_and_prefill_keeps_the_dequantized_product(quantize):
    """Without compiling, decode steps (at most DECODE_ROWS_MAX rows) go through the same ATen kernels (measured
    on a 135M model: the eager CLI's int8 decode 17 -> 58 and int4 11 -> 77 tokens/s), within the compiled
    test's bound of the dequantized path; a prefill of more rows (int4: more than INT4_ATEN_ROWS_MAX, which go
    through ATen's kernel too) keeps the dequantized GEMM (in bf16 where the CPU has native bf16,
    test_fastpath_prefill_bf16), bit for bit the same whichever decode kernel is chosen."""
    n = 8 if quantize == "int8" else kernels.INT4_ATEN_ROWS_MAX // 2 + 4  # prompt columns; 2 rows each
    tokens = torch.randint(0, 61, (2, n + 8), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        prefill, decode = [], []
        for kernel in ("words", "aten"):
            fast = prepare(make(), quantize=quantize, woq_kernel=kernel)
            assert not fast.compiled
            cache = fast.new_kv_cache(2, n + 8)
            prefill.append(fast(tokens[:, :n], 0, cache))
            decode.append(torch.stack([fast.decode_step(tokens[:, i:i + 1], i, cache) for i in range(n, n + 8)], 1))
    assert fast.layers[0].wqkv.word_scale.dtype == torch.bfloat16 and fast.head.word_scale.dtype == torch.bfloat16
    assert torch.equal(prefill[1], prefill[0])
    assert 0 < rel(decode[1], decode[0]) < 2 * ONE_PRODUCT


def test_eager_aten_kernels_keep_the_dequantized_greedy_tokens_on_stories260k(shared_data):
    folder = shared_data / "models" / "stories260K" / "hf"
    if not (folder / "config.json").is_file():
        pytest.skip(f"stories260K is not in {folder}")
    from minigpt.checkpoint.native import load_model

    model = load_model(folder)
    for quantize in ("int8", "int4"):
        ref = list(generate_tokens(prepare(copy.deepcopy(model), quantize=quantize, woq_kernel="words"), [1],
                                   GREEDY_32))
        fast = prepare(copy.deepcopy(model), quantize=quantize, woq_kernel="aten")
        assert fast.head.word_scale.dtype == torch.bfloat16
        assert list(generate_tokens(fast, [1], GREEDY_32)) == ref


def test_an_unknown_kernel_name_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown int8/int4 kernel 'fast'; choose auto, w8a8, aten, words"):
        prepare(make(), quantize="int8", compile=True, woq_kernel="fast")
    monkeypatch.setenv("MINIGPT_WOQ_KERNEL", "fast")
    with pytest.raises(ValueError, match="unknown int8/int4 kernel 'fast'"):
        FastPath(make())
    assert aten_woq_wanted("aten") and not aten_woq_wanted("words")
