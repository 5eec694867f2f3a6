"""MiniGPT's weight-only int8 kernel (``minigpt/infer/woq8_kernel.cpp``, the op ``minigpt::woq8_mm``), which multiplies
the int8 screen of a float LM head by float32 hidden states in greedy decode steps.

The kernel picks its path once per process, so each path is checked in a child process capped by
``MINIGPT_WOQ8_ISA``: every product lies within the float32 rounding bound the screen relies on (its sum's order
is the kernel's own), for tails of every length, one to five rows (two per pass) and output rows not a multiple
of the four a pass reads. In this process: its errors for bad arguments, that the screen takes it, and that the
screened greedy token is the same through it and through the step's loops."""
import os
import shutil

import pytest
import torch
from conftest import float_kernel_paths, some_slow

from minigpt.infer.fastpath.kernels import int8_words
from minigpt.infer.fastpath.screen import HeadScreen, screened_argmax, woq8_kernel

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                reason="no C++ compiler for the runner library")

PRODUCT = """
import torch
from minigpt.infer.fastpath.kernels import int8_words
from minigpt.infer.fastpath.screen import woq8_kernel
from minigpt.model.quant import quantize_weight
print(woq8_kernel())
gen = torch.Generator().manual_seed(0)
for out, n_in in [(1, 4), (3, 20), (33, 96), (130, 580), (64, 1536)]:
    q, s = quantize_weight(torch.randn(out, n_in, generator=gen))
    q.view(-1)[::5] = -128  # outside the quantizer's range: a foreign file may hold it
    for rows in range(1, 6):
        x = torch.randn(rows, n_in, generator=gen) * 10
        x[:, -1] *= 100  # an outlier in the last input, which a tail reads
        got = torch.ops.minigpt.woq8_mm(x, int8_words(q), s).double()
        exact = (x.double() @ q.double().T) * s.double()
        # float32 rounding of the sum (Higham: n 2^-24 |x| . |w|) and of the scaling, as screen.py's bound
        bound = n_in * 2.0 ** -24 * (x.double().abs() @ q.double().abs().T) * s.double() * 1.001 + 1e-6 * got.abs()
        err = (got - exact).abs()
        print(out, n_in, rows, bool((err <= bound).all()), bool((err > 0).any() or n_in < 20))
"""


@pytest.mark.parametrize("isa", some_slow(["native", "avx2", "scalar"], ("avx2", "scalar")))
def test_every_path_is_within_the_screens_rounding_bound(isa):
    """Each path (this CPU's best, AVX2, plain C++) within float32 rounding of the float64 product, and not the
    float64 product itself (a kernel that computed something else exactly would fail the first, one in float64
    the second)."""
    best, (got_isa, *lines) = float_kernel_paths(PRODUCT, "MINIGPT_WOQ8_ISA", isa)
    assert got_isa == (best if isa == "native" else isa)
    assert len(lines) == 25 and all(line.endswith("True True") for line in lines), lines


def test_bad_arguments_are_refused_with_the_expected_shapes():
    if woq8_kernel() is None:
        pytest.skip("the runner library does not build here")
    q = torch.zeros(8, 16, dtype=torch.int8)
    words, scale = int8_words(q), torch.ones(8)
    with pytest.raises(RuntimeError, match=r"words must be float32 \[out, 5\]"):
        torch.ops.minigpt.woq8_mm(torch.zeros(1, 20), words, scale)
    with pytest.raises(RuntimeError, match=r"scale must be float32 \[8\]"):
        torch.ops.minigpt.woq8_mm(torch.zeros(1, 16), words, torch.ones(7))
    with pytest.raises(RuntimeError, match="x must be float32"):
        torch.ops.minigpt.woq8_mm(torch.zeros(1, 16, dtype=torch.float64), words, scale)
    assert torch.ops.minigpt.woq8_mm(torch.zeros(0, 16), words, scale).shape == (0, 8)


def test_the_screen_takes_the_kernel_and_certifies_the_same_tokens():
    """Where the kernel runs vectorised the screen goes through it; its certified tokens are the float argmax and
    the same as through the step's loops (the -1s may differ only where the two sums straddle a bound, not seen
    here)."""
    isa = woq8_kernel()
    if isa in (None, "scalar"):
        pytest.skip(f"the kernel is not vectorised here ({isa})")
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(4000, 64, generator=gen)
    h = torch.randn(3, 5, 64, generator=gen)
    sc = HeadScreen(w)
    assert sc.native
    native = screened_argmax(w, sc.proj, sc.bound, h, native=True)
    loops = screened_argmax(w, sc.proj, sc.bound, h, native=False)
    want = (h @ w.T).argmax(-1)
    assert torch.equal(native, loops) and ((native == want) | (native == -1)).all()
    assert (native == want).float().mean() > 0.5
    assert not HeadScreen(w, native=False).native
