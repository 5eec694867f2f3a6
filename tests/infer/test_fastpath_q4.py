"""int4 projections through MiniGPT's int4 x int8 kernel (``minigpt::q4_mm``, minigpt/infer/q4_kernel.cpp): the C++
kernel equals the PyTorch reference, its three instruction-set paths agree bit for bit, the product stays within
the activations' 8-bit rounding of the float-activation product, rows never depend on each other, a NaN reaches
the outputs, bad tensors are refused, and the fast path takes the kernel for int4 weights by default (eager and
compiled alike), not under ``woq_kernel="aten"``. ``minigpt::q4_dequant`` (int4 weights as float32 or bfloat16 for
prefill's GEMM) gives ``dequantize_weight_int4``'s numbers bit for bit on every path, and many-row products use it."""
import os
import subprocess
import sys
from functools import partial

import pytest
import torch
from conftest import random_model

from minigpt.infer.fastpath import Proj, library, prepare
from minigpt.infer.fastpath.kernels import INT4_ATEN_ROWS_MAX
from minigpt.model.quant import dequantize_weight_int4, quantize_weight_int4
from minigpt.runtime import native_bf16

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(library.q4_kernel() is None,
                                reason="the runner library (the kernel's home) cannot be built here")

SHAPE = dict(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96, multiple_of=16)
make = partial(random_model, SHAPE, noise=0.05)

# Rounding x to 8 bits per group of 32: step d = max|x| / 127, error uniform in +-d/2, RMS d / sqrt(12); for Gaussian
# groups max|x| is ~2-2.5 standard deviations, so ~0.5-0.7 % of x, and of a product summing those errors against
# independent weights. Bound 2 %; a wrong nibble, scale or offset gives ~10 % or more.
Q8_BOUND = 0.02


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _proj(out=48, n_in=96, group=32, bias=False, seed=0):
    torch.manual_seed(seed)
    packed, scale = quantize_weight_int4(torch.randn(out, n_in), group)
    p = Proj(packed, scale, torch.randn(out) if bias else None)
    assert library.q4_layout(p) and p.q4 and p.group_size == group
    return p, dequantize_weight_int4(packed, scale, group)


def test_layout_keeps_every_level_and_scale():
    p, _ = _proj(out=32, n_in=64, group=16)
    packed = p.weight.view(32, 4, 8)
    levels = torch.stack([packed & 15, packed >> 4], dim=2).view(32, 64).to(torch.int16)
    assert p.words.shape == (2, 8, 64) and p.words.dtype == torch.uint8
    assert torch.equal(library.q4_levels(p.words), levels)
    assert p.word_scale.shape == (2, 4, 16) and torch.equal(p.word_scale.transpose(1, 2).reshape(32, 4), p.scale)


@pytest.mark.parametrize("rows", [1, 3, 5, 9])
@pytest.mark.parametrize("out,n_in,group", [(48, 96, 32), (32, 64, 8), (16, 128, 64)])
def test_kernel_equals_the_reference(rows, out, n_in, group):
    """The integers are exact in both; only the order of the float32 group sums differs."""
    p, _ = _proj(out, n_in, group)
    x = torch.randn(rows, n_in)
    got = torch.ops.minigpt.q4_mm(x, p.words, p.word_scale)
    want = library._q4_mm(x, p.words, p.word_scale)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


_DIGEST = """
import hashlib, torch
from minigpt.infer.fastpath import Proj, library
from minigpt.model.quant import quantize_weight_int4
print(library.q4_kernel())
torch.manual_seed(0)
packed, scale = quantize_weight_int4(torch.randn(80, 192), 32)
p = Proj(packed, scale, None)
library.q4_layout(p)
y = torch.ops.minigpt.q4_mm(torch.randn(6, 192), p.words, p.word_scale)
w = [torch.ops.minigpt.q4_dequant(packed, scale, bf16).view(torch.int16) for bf16 in (False, True)]
# The largest integer sums: every level 15 or 0 against activations rounded to +-127, groups of 128 inputs (16
# chunks, more than the AVX2 path adds in 16 bits at once), one to five rows (both of its block shapes).
big = Proj(torch.full((32, 128), 0xFF, dtype=torch.uint8), torch.ones(32, 2, dtype=torch.float16), None)
big.weight[16:] = 0
library.q4_layout(big)
x = torch.cat([torch.ones(2, 256), torch.where(torch.arange(256) % 3 == 0, -1.0, 1.0).repeat(3, 1)])
x[1] = -1
sums = [torch.ops.minigpt.q4_mm(x[:r], big.words, big.word_scale) for r in range(1, 6)]
assert all(torch.equal(s, sums[-1][:len(s)]) for s in sums)
assert torch.equal(sums[-1], library._q4_mm(x, big.words, big.word_scale))
print(hashlib.sha256(y.numpy().tobytes() + w[0].numpy().tobytes() + w[1].numpy().tobytes()
                     + b"".join(s.numpy().tobytes() for s in sums)).hexdigest())
"""


@pytest.mark.slow
def test_instruction_sets_agree_bit_for_bit(capsys):
    """AVX512-VNNI, AVX2 and plain C++ compute the same integers and the same float operations in the same order:
    the same bits. This process runs the best path the CPU has; child processes the others ($MINIGPT_Q4_ISA caps
    the path; a process reads it once)."""
    exec(_DIGEST, {})
    runs = dict([capsys.readouterr().out.split()])
    for cap in ("avx2", "scalar"):
        done = subprocess.run([sys.executable, "-c", _DIGEST], capture_output=True, text=True,
                              env=dict(os.environ, MINIGPT_Q4_ISA=cap), check=True)
        isa, digest = done.stdout.split()
        runs[isa] = digest
    assert "scalar" in runs
    assert len(set(runs.values())) == 1, runs


def test_product_is_close_to_the_float_activation_product():
    p, dense = _proj(bias=True)
    x = torch.randn(4, 1, 96)
    got = library.q4_linear(p, x)
    want = x @ dense.T + p.bias
    assert got.shape == (4, 1, 48)
    assert 0 < rel(got, want) < Q8_BOUND


def test_rows_do_not_depend_on_each_other():
    p, _ = _proj()
    x = torch.randn(7, 96)
    together = torch.ops.minigpt.q4_mm(x, p.words, p.word_scale)
    for r in range(7):
        assert torch.equal(torch.ops.minigpt.q4_mm(x[r:r + 1], p.words, p.word_scale)[0], together[r])


def test_a_nan_reaches_every_output_and_zeros_stay_finite():
    p, _ = _proj()
    x = torch.randn(2, 96)
    x[0, 40] = float("nan")
    x[1, :32] = 0.0  # a group of zeros: scale 0, no division by it
    y = torch.ops.minigpt.q4_mm(x, p.words, p.word_scale)
    assert y[0].isnan().all() and y[1].isfinite().all()


def test_bad_tensors_are_refused():
    p, _ = _proj()
    x = torch.randn(1, 96)
    with pytest.raises(RuntimeError, match="x must be float32"):
        torch.ops.minigpt.q4_mm(x.double(), p.words, p.word_scale)
    with pytest.raises(RuntimeError, match="x has 64 inputs"):
        torch.ops.minigpt.q4_mm(torch.randn(1, 64), p.words, p.word_scale)
    with pytest.raises(RuntimeError, match="weight must be uint8"):
        torch.ops.minigpt.q4_mm(x, p.words.view(3, 12, 8, 8), p.word_scale)
    with pytest.raises(RuntimeError, match="as many blocks"):
        torch.ops.minigpt.q4_mm(x, p.words, p.word_scale[:2])


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("out,n_in,group", [(48, 96, 32), (40, 64, 8), (7, 128, 64), (5, 24, 8)])
def test_dequantized_weights_equal_the_reference_bit_for_bit(out, n_in, group, bf16):
    """Group halves of 8 bytes or more take the vector path, smaller ones the scalar loop; both round products of
    float16 scales and levels the way PyTorch does (float32, then to bfloat16 nearest-even)."""
    torch.manual_seed(out)
    packed, scale = quantize_weight_int4(torch.randn(out, n_in) * 3, group)
    dtype = torch.bfloat16 if bf16 else torch.float32
    got = torch.ops.minigpt.q4_dequant(packed, scale, bf16)
    want = dequantize_weight_int4(packed, scale, group, dtype)
    assert got.dtype == dtype and got.shape == (out, n_in)
    assert torch.equal(got.view(torch.int16) if bf16 else got.view(torch.int32),
                       want.view(torch.int16) if bf16 else want.view(torch.int32))
    assert torch.equal(torch.ops.minigpt.q4_dequant(packed.t().contiguous().t(), scale, bf16), got)  # strided


def test_dequantize_refuses_bad_tensors():
    packed, scale = quantize_weight_int4(torch.randn(16, 64), 32)
    with pytest.raises(RuntimeError, match="packed must be uint8"):
        torch.ops.minigpt.q4_dequant(packed.to(torch.int8), scale, False)
    with pytest.raises(RuntimeError, match="scale must be float16"):
        torch.ops.minigpt.q4_dequant(packed, scale.float(), False)
    with pytest.raises(RuntimeError, match="as many rows"):
        torch.ops.minigpt.q4_dequant(packed, scale[:8], False)
    with pytest.raises(RuntimeError, match="do not divide 64 inputs"):
        torch.ops.minigpt.q4_dequant(packed, torch.ones(16, 3, dtype=torch.float16), False)


def test_many_rows_take_the_kernel_or_the_bf16_gemm_on_the_dequantized_weight():
    """Past INT4_ATEN_ROWS_MAX rows (a prefill): on a CPU with native bf16 the GEMM on the weight dequantized by
    minigpt::q4_dequant (its numbers checked in test_fastpath_prefill_bf16); elsewhere, where that GEMM would be a
    float32 one, minigpt::q4_mm as for a few rows, each row's result the one it has alone (a decode step's)."""
    p, _ = _proj(bias=True)
    x = torch.randn(1, INT4_ATEN_ROWS_MAX + 1, 96)
    with torch.profiler.profile() as prof:
        got = p(x)
    names = {e.name for e in prof.events()}
    if native_bf16("cpu"):
        assert "minigpt::q4_dequant" in names and "minigpt::q4_mm" not in names
    else:
        assert "minigpt::q4_mm" in names and "minigpt::q4_dequant" not in names
        alone = torch.cat([p(x[:, i:i + 1]) for i in range(x.shape[1])], dim=1)
        assert torch.equal(got, alone)


def test_shapes_the_kernel_does_not_take_stay_off_its_layout():
    packed, scale = quantize_weight_int4(torch.randn(40, 64), 32)  # 40 rows: not whole blocks of 16
    assert not library.q4_layout(Proj(packed, scale, None))
    assert not library.q4_layout(Proj(torch.randn(32, 64), None, None))  # float weights


def test_the_fast_path_takes_the_kernel_for_int4_by_default_and_not_under_aten():
    tokens = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(2))
    fast = prepare(make(), quantize="int4", compile=False)
    layers = [q for lw in fast.layers for q in (lw.wqkv, lw.wo, lw.w13, lw.w2) if q.group_size]
    assert layers and all(q.q4 for q in layers)
    aten = prepare(make(), quantize="int4", compile=False, woq_kernel="aten")
    assert not any(q.q4 for lw in aten.layers for q in (lw.wqkv, lw.wo, lw.w13, lw.w2))
    dense = prepare(make(), quantize="int4", compile=False, woq_kernel="words")  # float activations, eager
    with torch.inference_mode():
        a = fast(tokens, 0, fast.new_kv_cache(1, 12))
        b = dense(tokens, 0, dense.new_kv_cache(1, 12))
    assert 0 < rel(a, b) < 2 * Q8_BOUND  # two layers and the head; the norms rescale rather than compound


@pytest.mark.slow
def test_compiled_q4_decode_equals_eager_q4():
    """The compiled step calls the op (traced through its shape function) and gives the eager steps' numbers."""
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    outs = []
    with torch.inference_mode():
        for compiled in (False, True):
            fast = prepare(make(), quantize="int4", compile=compiled)
            assert fast.layers[0].wqkv.q4
            cache = fast.new_kv_cache(2, 16)
            fast(tokens[:, :8], 0, cache)
            outs.append(torch.stack([fast.decode_step(tokens[:, i:i + 1], i, cache) for i in range(8, 16)], 1))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=0)
