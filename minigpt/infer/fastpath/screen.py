"""Exact greedy decoding that reads a float LM head at int8 cost: an int8 copy of the head screens the vocabulary,
and the few rows that could hold the maximum are recomputed from the float weights.

Why: at batch 1 a decode step reads every weight once, and a float32 model's tied head (SmolLM-135M: 49,152 x
576, 113 MB of its 540 MB) is a fifth of those bytes; the step runs at the rate the host streams memory
(docs/benchmarks.md). Greedy decoding needs only the argmax of the logits, not their values, and the argmax can
be certified from a cheaper product plus an error bound -- the same idea as exact maximum-inner-product search
with quantized screening (e.g. Guo et al., "Accelerating Large-Scale Inference with Anisotropic Vector
Quantization", ICML 2020, re-ranking the candidates of a quantized score by exact ones).

The bound, per vocabulary row ``i`` with float weights ``w_i`` and ``h`` the final hidden state ``[dim]``:

* the screen's row is ``w_i ~= s_i q_i`` (per-row symmetric int8, :func:`~minigpt.model.quant.quantize_weight`),
  multiplied by the float32 activations, ``a_i = s_i (h . q_i)`` in float32, by MiniGPT's weight-only int8 kernel
  (``minigpt::woq8_mm``, ``minigpt/infer/woq8_kernel.cpp``, :func:`woq8_kernel`) or, where it does not build,
  the compiled step's int8 loops (:func:`~minigpt.infer.fastpath.kernels.int8_words`): the bound below holds for
  either order of the sum;
* ``|h . w_i - a_i| <= ||h||_2 ||w_i - s_i q_i||_2`` (Cauchy-Schwarz) plus float32 rounding: of the screen's
  sum, ``<= dim 2^-24 ||h||_2 ||s_i q_i||_2``, and of the float dot product the logits step computes,
  ``<= dim 2^-24 ||h||_2 ||w_i||_2`` (Higham, "Accuracy and Stability of Numerical Algorithms", eq. 3.5), of the
  scaling (``1e-6 |a_i|``), and 0.1 % on the whole bound for the rounding of the bound itself.

(An int8 x int8 screen through :func:`~minigpt.infer.fastpath.library.w8a8_linear`, activations rounded to 8 bits
too, measured no faster in the 135M step -- 1.04x, 8 alternating pairs, 0.92-1.16x -- and needed a FBGEMM
packing of ~0.3 s per process and a looser bound; docs/benchmarks.md.)

Every row ``i`` therefore satisfies ``logit_i <= u_i = a_i + e_i``. The step takes the :data:`SCREEN_K` + 1
rows of largest ``u``, recomputes the first :data:`SCREEN_K` exactly (a gather of ``SCREEN_K`` float rows), and
the best of them is the argmax of all logits when it is larger than the next upper bound ``u_(K+1)``: no row
outside can then reach it. Otherwise (not seen in the measurements below) the step answers -1 and
:meth:`~minigpt.infer.fastpath.FastPath.decode_next` computes the full logits from the hidden state it returns.

Measured (rows whose upper bound reaches the maximum, the ones that must be recomputed): Karpathy's trained
stories260K over 512 TinyStories positions, 1 at the median, 6 at the 99th percentile, 11 at most; the
random-weight SmolLM-135M shape of the llama.cpp benchmark over 1,024 positions, 5 / 26 / 42. ``SCREEN_K = 64``
certified every position of both.
"""
from __future__ import annotations

from typing import Optional

import torch

from minigpt.infer.fastpath.kernels import Proj, decode_linear, int8_words
from minigpt.infer.fastpath.library import runner_kernel
from minigpt.infer.launcher import install_woq8_kernel
from minigpt.model.quant import quantize_weight

SCREEN_K = 64  # rows recomputed exactly per token (64 x dim floats: 147 KB at dim 576, against a 113 MB head)
_BUILD_ROWS = 2048  # rows per block while building a screen (4.7 MB of float32 at dim 576)


# `minigpt::woq8_mm(x, words, scale)`: float32 rows x [rows, in] times an int8 matrix given as its bytes in float32
# words [out, in / 4] (kernels.int8_words), per-row scales [out] -> [rows, out] float32. The reference kernel
# below (CompositeExplicitAutograd: it always runs) and the C++ one (woq8_kernel.cpp, registered for CPU by
# woq8_kernel()) differ only in the order of the float32 sum.
_LIB = torch.library.Library("minigpt", "FRAGMENT")
_LIB.define("woq8_mm(Tensor x, Tensor words, Tensor scale) -> Tensor")
_WOQ8: list[str] = []  # once woq8_kernel has looked: the C++ kernel's instruction set, or "" (none here)


def _woq8_mm(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q = words.contiguous().view(torch.int8)  # [out, in]: the words' bytes, little-endian as int8_words wrote them
    return (x.float() @ q.float().T) * scale


_LIB.impl("woq8_mm", _woq8_mm, "CompositeExplicitAutograd")


@torch.library.register_fake("minigpt::woq8_mm")
def _woq8_mm_fake(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], words.shape[0])


def woq8_kernel() -> Optional[str]:
    """Register the C++ CPU kernel of ``minigpt::woq8_mm`` for this process (once) and return the instruction set
    it runs (``"avx512"``, ``"avx2"`` or ``"scalar"``; ``$MINIGPT_WOQ8_ISA`` caps it), or None where it cannot be
    had: the compile cache is off (the runner library is built there), no C++ compiler, the build failed."""
    return runner_kernel(_WOQ8, install_woq8_kernel, "woq8_isa")


class HeadScreen:
    """The int8 screen of a float LM head ``head`` ``[vocab, dim]``.

    ``proj``: the int8 copy (:class:`~minigpt.infer.fastpath.kernels.Proj`, per-row scales, its bytes also as
    float32 words, which the step reads); ``bound`` ``[vocab]`` float32: ``||w_i - s_i q_i||_2 + dim 2^-24
    (||w_i||_2 + ||s_i q_i||_2)``, the error of row ``i`` per unit ``||h||_2`` (module docstring); ``native``:
    whether the step multiplies it through ``minigpt::woq8_mm``'s C++ kernel (vectorised here, :func:`woq8_kernel`)
    rather than its own loops (``native`` None: wherever that kernel runs vectorised). Why the kernel: in the
    compiled fp32 step of SmolLM-135M on a 2-core Xeon (256-bit loops) the loops read the 28 MB screen at ~9 GB/s,
    the kernel at ~17 GB/s: fp32 decode 1.12x, bf16 1.10x (docs/benchmarks.md)."""

    def __init__(self, head: torch.Tensor, native: Optional[bool] = None) -> None:
        vocab, dim = head.shape
        q = torch.empty(vocab, dim, dtype=torch.int8)
        scale, self.bound = torch.empty(vocab), torch.empty(vocab)
        # In blocks of rows that stay in the cache: over the whole head (113 MB at 135M, fp32) each pass below
        # would stream it from memory again (0.25 s against 0.07 s measured).
        for start in range(0, vocab, _BUILD_ROWS):
            rows = slice(start, min(start + _BUILD_ROWS, vocab))
            w = head[rows].detach().float()
            q[rows], scale[rows] = quantize_weight(w)
            approx = q[rows].float() * scale[rows, None]
            self.bound[rows] = (w - approx).norm(dim=1) + dim * 2.0 ** -24 * (w.norm(dim=1) + approx.norm(dim=1))
        self.proj = Proj(q, scale, words=int8_words(q))
        self.native = (woq8_kernel() not in (None, "scalar")) if native is None else native


def build_screen(head: Proj) -> Optional[HeadScreen]:
    """A :class:`HeadScreen` of the float head ``head`` (fp32/bf16/fp16, on the CPU, no bias); None for other
    heads (a quantized head is already read at int8 cost or less; a small one has no fewer rows to read)."""
    w = head.weight
    if w is None or head.scale is not None or head.bias is not None or not w.is_floating_point() \
            or w.device.type != "cpu" or w.shape[0] <= SCREEN_K:
        return None
    return HeadScreen(w)


def screened_argmax(head_weight: torch.Tensor, screen: Proj, bound: torch.Tensor, h: torch.Tensor,
                    native: bool = False) -> torch.Tensor:
    """Greedy next tokens ``[batch, seq]`` (int64) of the final hidden states ``h`` ``[batch, seq, dim]`` under the
    float head ``head_weight`` ``[vocab, dim]``, -1 where the screen cannot certify the argmax (module docstring;
    traced into the compiled greedy step). A certified token equals the argmax of the float32 logits but for ties
    within float32 rounding, where the two sums' order decides. ``native``: the screen's product through
    ``minigpt::woq8_mm`` (:attr:`HeadScreen.native`), else through the step's loops (:func:`decode_linear`)."""
    h32 = h.float()
    if native:
        flat = h32.reshape(-1, h32.shape[-1]).contiguous()
        a = torch.ops.minigpt.woq8_mm(flat, screen.words, screen.scale).view(*h32.shape[:-1], -1)
    else:
        a = decode_linear(screen, h32)  # [batch, seq, vocab]
    e = h32.norm(dim=-1, keepdim=True) * bound * 1.001 + 1e-6 * a.abs()
    upper, idx = torch.topk(a + e, SCREEN_K + 1, dim=-1)  # [batch, seq, K + 1]
    cand = idx[..., :SCREEN_K]
    rows = head_weight[cand].float()  # [batch, seq, K, dim]
    exact = (rows * h32[..., None, :]).sum(-1)  # [batch, seq, K]
    best, j = exact.max(-1)
    token = cand.gather(-1, j[..., None]).squeeze(-1)
    return torch.where(best > upper[..., SCREEN_K], token, torch.full_like(token, -1))


def resolve(tokens: torch.Tensor, h: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """``tokens`` ``[batch, seq]`` from :func:`screened_argmax` with each -1 replaced by the argmax of the full
    float32 logits of its hidden state in ``h`` ``[batch, seq, dim]``."""
    missing = tokens < 0
    if bool(missing.any()):
        logits = h[missing].float() @ head_weight.float().T
        tokens = tokens.clone()
        tokens[missing] = logits.argmax(-1)
    return tokens
