"""The fast path's projections: :class:`Proj` (one possibly fused linear map, fp32, bf16, int8 or int4 weight-only),
the fusion of a model's projections into row views of one matrix (:func:`fuse_projections`), and the matrix-vector
products of the compiled decode step (:func:`decode_linear`, with int8 and packed int4 weights read as float32
words, :func:`int8_words`, or handed to ATen's weight-only kernels, :func:`aten_woq_linear`, or, int8, to FBGEMM's
int8 x int8 product, :func:`w8a8_linear`, or, int4, to MiniGPT's int4 x int8 kernel, :func:`q4_linear`).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from minigpt.infer.fastpath.float_mv import float_mm_linear, float_mm_takes, float_mm_wanted
from minigpt.infer.fastpath.library import aten_woq_linear, q4_linear, w8a8_linear
from minigpt.model.quant import Int4Linear, Int8Linear, dequantize_weight_int4, int8_linear
from minigpt.runtime import cpu_vendor, native_bf16

# Activations, the residual stream and the KV cache of the fast path are float32 whatever the weight dtype: bf16
# (or int8) is a storage format for the weights, converted on the fly. Half-precision arithmetic has no hardware
# support on most CPUs, and the weights, not the activations, are what a decode step reads.
ACT_DTYPE = torch.float32

# Up to this many rows the compiled step writes its matrix-vector products as per-row reductions (see
# decode_linear); larger batches use the BLAS GEMM.
DECODE_ROWS_MAX = 8

# int4 weights in MiniGPT's int4 x int8 layout (library.q4_layout) or ATen's (aten_woq_layout), eager path: up to
# this many rows (a short prompt) go through that kernel as a decode step does, more through the dequantized GEMM.
# Measured on a 2-core Xeon (family 6 model 207, AVX512-BF16/AMX), SmolLM-135M's shape, whole prefill, ATen's
# kernel against the dequantized bf16 GEMM: 9 rows 47 / 166 ms, 13 rows 57 / 168, 32 rows 94 / 180, 64 rows 170 /
# 196, 128 rows 320 / 235; the kernel's last logits were also nearer those of a token-by-token prefill (max |diff|
# 0.017 against 0.030 at 13 and 32 rows). MiniGPT's kernel, same host later (session 38): 9 rows 31-44 ms, 32 rows
# 79-101, 64 rows 171-183, against the GEMM's 185-189, 202-216 and 229-500 (noisy), ATen's 55-58, 121-137, 219-242.
# Where the CPU has no native bf16 the dequantized GEMM is a float32 one, and MiniGPT's kernel takes every row count
# (Proj.__call__): on a 2-core AVX2-only Zen 3 EPYC, SmolLM-135M's 512-token prefill ran at 618 against 494 tokens/s
# (medians of 5 alternating, docs/benchmarks.md, session 67), with the decode step's numerics.
INT4_ATEN_ROWS_MAX = 64

# Many-row products convert a weight stored in another dtype than the GEMM's (bf16 into float32 on CPUs without
# native bf16; int8 and int4 always) this many bytes of converted rows at a time. Why: a whole converted matrix
# (92 MB for TinyLlama-1.1B's fused gate/up in float32) is a fresh allocation whose every page is faulted in
# again on every call (22.5 thousand minor faults, 23 ms, for that matrix's int8 -> float32, against 2.3 ms and
# none in 8 MiB slices, which the allocator hands back for reuse). Measured on a 2-core Xeon (family 6
# model 167), TinyLlama-1.1B's four matrices of a layer, 128 rows, capped to AVX2, medians of 7: bf16 103 -> 64 ms,
# int8 103 -> 63 ms, int4 131 -> 81 ms at 8 MiB (0.5 / 1 / 2 / 4 MiB: 84 / 73 / 69 / 65 ms for bf16), an fp32
# GEMM alone 62 ms; natively (bf16 GEMM) int8 33 -> 22 ms, int4 106 -> 47 ms. At SmolLM-135M's size a matrix is
# at most 7 MB and the slices change nothing measurable (docs/benchmarks.md).
PREFILL_SLICE_BYTES = 8 << 20

FP32_GEMM_ENV = "MINIGPT_FP32_GEMM"


def fp32_gemm_library() -> str:
    """Which library computes the fast path's float32 products outside the compiled step (prefill, eager decode
    steps): ``"onednn"`` on AMD CPUs, ``"mkl"`` (ATen's default for float32, oneMKL's sgemm) elsewhere, unless
    ``$MINIGPT_FP32_GEMM`` is ``onednn`` or ``mkl``. Raises ``ValueError`` for another value.

    Why: the oneMKL of torch 2.13's CPU wheel (2024.0) runs its AVX2 code on AMD CPUs. On a 2-core Zen 5 EPYC
    (family 26 model 2, AVX-512), SmolLM-135M's four layer matrices, 2 threads: 175 GFLOP/s through oneMKL against
    418 through oneDNN at 512 rows, 1.9-2.6x from 4 to 2048 rows, 1.16x at one row; with both capped to AVX2 still
    1.1-1.5x (docs/benchmarks.md, session 58). On Intel CPUs oneMKL runs its AVX-512 code: ATen's default stays."""
    choice = os.environ.get(FP32_GEMM_ENV, "").strip().lower()
    if choice not in ("", "onednn", "mkl"):
        raise ValueError(f"${FP32_GEMM_ENV}={choice!r}: choose onednn or mkl")
    if not _onednn_linear_available():
        return "mkl"
    return choice or ("onednn" if cpu_vendor() == "AuthenticAMD" else "mkl")


@lru_cache(maxsize=1)
def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` (``x`` ``[..., in]``, ``w`` ``[out, in]`` -> ``[..., out]``): float32 on the CPU
    through oneDNN's GEMM where :func:`fp32_gemm_library` chooses it and no gradient is wanted (oneDNN's linear op
    has no autograd formula), else ``F.linear``. The two differ in summation order only."""
    if (x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
            and fp32_gemm_library() == "onednn"):
        return _onednn_linear(x, w, bias, "none", [], "")
    return F.linear(x, w, bias)


def _onednn_linear(*args):
    """oneDNN's linear op (Inductor's for CPU products), looked up at the call: ``(x, w, bias, "none", [], "")``."""
    return torch.ops.mkldnn._linear_pointwise(*args)


class Proj:
    """One (possibly fused) linear projection ``y = x W^T (* scale) + b``.

    ``weight`` ``[out, in]`` float (fp32/bf16) or int8, or int4 packed two a byte ``[out, in / 2]`` (uint8);
    ``scale``: int8 ``[out]`` per-output-channel, int4 ``[out, in / group_size]`` per group (float16),
    :mod:`minigpt.model.quant`; ``bias`` ``[out]`` or None. An int4 projection is told apart by its 2-D scale.
    """

    __slots__ = ("weight", "scale", "bias", "words", "word_scale", "w8a8")

    def __init__(self, weight: Optional[torch.Tensor], scale: Optional[torch.Tensor] = None,
                 bias: Optional[torch.Tensor] = None, words: Optional[torch.Tensor] = None,
                 word_scale: Optional[torch.Tensor] = None) -> None:
        self.weight, self.scale, self.bias = weight, scale, bias
        # int8 / int4 only: the weight's bytes as float32 words (int8_words), read by the compiled step; or, with
        # ATen's kernels, int4 levels in their layout (aten_woq_layout)
        self.words = words
        # compiled step: int4 words, each word's group scale [out, in / 8] float16 (int4_word_scales); ATen's
        # kernels, their bf16 scales (aten_woq_layout)
        self.word_scale = word_scale
        # int8 only: FBGEMM's prepacked weight and scales (w8a8_layout), for products of any number of rows
        self.w8a8: Any = None

    @property
    def aten_layout(self) -> bool:
        """Whether :func:`aten_woq_layout` prepared this int8/int4 projection (its bf16 ``word_scale`` tells)."""
        return self.word_scale is not None and self.word_scale.dtype == torch.bfloat16

    @property
    def q4(self) -> bool:
        """Whether :func:`~minigpt.infer.fastpath.library.q4_layout` prepared this int4 projection (its 3-D
        ``words`` tell)."""
        return self.words is not None and self.words.dim() == 3

    @property
    def group_size(self) -> int:
        """The int4 group size (0 for other weights), from the shapes: ``in / scale.shape[1]``."""
        if self.scale is None or self.scale.dim() != 2:
            return 0
        if self.weight is not None or (self.words.dtype == torch.uint8 and not self.q4):  # packed (ATen's too)
            n_in = 2 * (self.weight if self.weight is not None else self.words).shape[1]
        else:  # float32 words or q4_layout's blocks: 8 inputs per word or per block column
            n_in = 8 * self.words.shape[1]
        return n_in // self.scale.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` in the activation dtype (float32) -> ``[..., out]`` in the same dtype.

        bf16/fp16 weights: one row goes through ATen's half-precision matrix-vector product (``torch.mv``; measured
        on an AVX512-BF16 CPU, a 135M model's eager bf16 decode ran 46 tokens/s, against 35 through ``F.linear``'s
        oneDNN call) and a few rows (batched decode) through ``F.linear``, on activations rounded to the weight
        dtype; many rows (prefill) through :meth:`_gemm`: oneDNN's bf16 GEMM where the CPU has native bf16, else
        an fp32 GEMM on the weights upcast a slice at a time (half-precision GEMMs run ~100x slower there), or,
        with fp32 weights too, ``minigpt::float_mm`` once its kernel is loaded (float_mv.float_mm_wanted).
        int8 weights packed for FBGEMM (:func:`w8a8_layout`): any number of rows through :func:`w8a8_linear`, so
        that a row's result never depends on how many rows share the call (a prompt prefilled beside others, a
        chunked prefill, a decode step: the same numbers); held by MiniGPT's kernel alone
        (:data:`~minigpt.infer.fastpath.library.OWN_INT8`, AVX2 without VNNI): any number of rows too (a 512-row
        prompt through TinyLlama-1.1B's int8 matrices: ~1.5x the float32 GEMM on weights upcast a slice at a time,
        2-core Zen 3 EPYC, docs/benchmarks.md). int4 weights in MiniGPT's int4 x int8 layout
        (:func:`~minigpt.infer.fastpath.library.q4_layout`): up to :data:`INT4_ATEN_ROWS_MAX` rows through
        :func:`~minigpt.infer.fastpath.library.q4_linear`, as in the compiled step, and any number of rows on a CPU
        without native bf16 (where the dequantized GEMM below would be a float32 one, slower than the kernel).
        int8/int4 weights given ATen's layout (:func:`aten_woq_layout`): a few rows (int4: up to
        :data:`INT4_ATEN_ROWS_MAX`) through ATen's weight-only kernels on bf16 activations (the compiled step's
        numerics); more rows through the dequantized GEMM, in bf16 on CPUs with native bf16, else in float32,
        converting a slice of rows at a time (:meth:`_gemm`)."""
        w, rows = self.weight, x.numel() // x.shape[-1]
        if (rows > DECODE_ROWS_MAX and float_mm_takes(self) and not (torch.is_grad_enabled() and x.requires_grad)
                and float_mm_wanted([self], load=False)):  # as in a prefill package
            return float_mm_linear(self, x)
        if self.w8a8 is not None:  # as in the compiled step: FBGEMM, or MiniGPT's kernel alone (AVX2 without VNNI)
            return w8a8_linear(self, x)
        if self.q4 and (rows <= INT4_ATEN_ROWS_MAX or not native_bf16("cpu")):  # int4 x int8, as in the compiled
            return q4_linear(self, x)  # step; more rows too where the dequantized GEMM would run in float32
        group_size = self.group_size
        if self.aten_layout and rows <= (INT4_ATEN_ROWS_MAX if group_size else DECODE_ROWS_MAX):
            # ATen's kernels, as in the compiled step
            return aten_woq_linear(self, x, group_size)
        if group_size or (self.scale is not None and rows > DECODE_ROWS_MAX):
            return self._gemm(x)
        if self.scale is not None:
            return int8_linear(x, w, self.scale, self.bias)
        if w.dtype == x.dtype:
            return gemm(x, w, self.bias)
        if rows == 1 and self.bias is None:
            return torch.mv(w, x.reshape(-1).to(w.dtype)).to(x.dtype).view(*x.shape[:-1], -1)
        if rows <= DECODE_ROWS_MAX:
            bias = None if self.bias is None else self.bias.to(w.dtype)
            return F.linear(x.to(w.dtype), w, bias).to(x.dtype)
        return self._gemm(x)

    def converted(self, dtype: torch.dtype, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """Rows ``start:stop`` of the weight as a ``dtype`` matrix ``[stop - start, in]``: int8 levels and bf16/fp16
        values converted as they are (an int8 weight's per-row scale is applied to the product, :meth:`_gemm`); int4
        dequantized, ``(q - 8) * scale`` as :func:`~minigpt.model.quant.dequantize_weight_int4`, through
        ``minigpt::q4_dequant`` (float32 or bfloat16, float16 scales on the CPU; its C++ kernel, where the runner
        library is loaded, writes the matrix in one pass: 0.43 against 1.47 ms for a SmolLM-135M layer's matrices
        in float32, 2 cores, docs/benchmarks.md)."""
        weight = self.weight[start:stop]
        if not self.group_size:
            return weight.to(dtype)
        scale = self.scale[start:stop]
        if dtype in (torch.float32, torch.bfloat16) and scale.dtype == torch.float16 and weight.device.type == "cpu":
            return torch.ops.minigpt.q4_dequant(weight, scale, dtype == torch.bfloat16)
        return dequantize_weight_int4(weight, scale, self.group_size, dtype)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        """``p(x)`` as one GEMM per slice of :data:`PREFILL_SLICE_BYTES` of converted weight rows (:meth:`converted`),
        for a weight stored in another dtype than the product's: ``x`` ``[..., in]`` -> ``[..., out]``, ``x``'s dtype.

        More than :data:`DECODE_ROWS_MAX` rows of bf16, int8 or int4 weights on a CPU with native bf16 (AVX512-BF16 /
        AMX, :func:`~minigpt.runtime.native_bf16`): ``x`` rounded to bf16 and oneDNN's bf16 GEMM accumulating in
        float32, on bf16 weights as stored (SmolLM-135M, a layer's matrices at 512 rows: 15.7 -> 2.9 ms against the
        float32 GEMM on weights upcast per call), int8 levels converted exactly, int4's ``(q - 8) * scale`` rounded
        to 8 significant bits (~0.2 % against int4's own ~8 % rounding); llama.cpp likewise rounds activations to
        bf16 for its BF16 weights. Elsewhere the product stays in ``x``'s dtype (float32)."""
        w, scale, n_in = self.weight, self.scale, x.shape[-1]
        rows = x.numel() // n_in
        bf16 = (rows > DECODE_ROWS_MAX and x.device.type == "cpu" and x.dtype == torch.float32
                and (scale is not None or w.dtype == torch.bfloat16) and native_bf16("cpu"))
        dtype = torch.bfloat16 if bf16 else x.dtype
        x2 = x.reshape(rows, n_in).to(dtype)
        if w.dtype == dtype:
            y = gemm(x2, w)
        else:
            # Traced (the prefill package), a converted weight goes through F.linear: Inductor lowers oneDNN's
            # linear op only on a weight that is one of the graph's constants (torch 2.13), not one computed in it.
            product = F.linear if torch.compiler.is_compiling() else gemm
            out = w.shape[0]
            step = max(16, PREFILL_SLICE_BYTES // (n_in * x2.element_size()) // 16 * 16)
            if step >= out:
                y = product(x2, self.converted(dtype))
            else:
                y = x2.new_empty(rows, out)
                for start in range(0, out, step):
                    y[:, start:start + step] = product(x2, self.converted(dtype, start, start + step))
        y = y.to(x.dtype)
        if scale is not None and scale.dim() == 1:
            y = y * scale.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], -1)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight, scale and bias that a decode step reads (int4 compiled: the per-word scales)."""
        n = self.weight.numel() * self.weight.element_size()
        for t in (self.scale if self.word_scale is None else self.word_scale, self.bias):
            if t is not None:
                n += t.numel() * t.element_size()
        return n


@dataclass
class LayerWeights:
    """The tensors of one block, fused where the architecture allows. ``w13`` is the fused gate/up projection of a
    gated FFN (``gate`` then ``up`` rows); plain MLPs keep ``w1`` alone (``w13`` is then just ``w1``)."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    wqkv: Proj
    wo: Proj
    w13: Proj
    w2: Proj
    attn_norm_eps: float
    ffn_norm_eps: float


def module_proj(linear: nn.Module) -> Proj:
    """The :class:`Proj` of one ``nn.Linear``, ``Int8Linear`` or ``Int4Linear``: its own tensors, not copied, but
    for a float weight that does not start on a 64-byte boundary, which moves to memory that does first
    (:func:`align_parameter`)."""
    if isinstance(linear, (Int8Linear, Int4Linear)):
        return Proj(linear.weight, linear.weight_scale, linear.bias)
    align_parameter(linear.weight)
    return Proj(linear.weight.detach(), None, None if linear.bias is None else linear.bias.detach())


# Bytes: a cache line, and the alignment of PyTorch's CPU allocator.
ALIGN = 64


def align_parameter(p: nn.Parameter) -> None:
    """Give parameter ``p`` a copy of its data in memory aligned to :data:`ALIGN` bytes when its data start
    elsewhere; the parameter object stays (a weight tied to another module stays tied), the old storage is dropped.

    Why: weights loaded from a safetensors file are views of the memory-mapped file, and start wherever the file's
    header and the tensors before them end (8 bytes past a cache line in SmolLM-135M's bf16 file), so every
    vector load of a row straddles two cache lines. Measured on a 2-core Xeon (family 6 model 167): the compiled
    bf16 decode step of SmolLM-135M's shape, loaded from its bf16 safetensors, 85.09 tokens/s as mapped against
    88.41 with the unfused matrices (attention output, FFN down, tied head/embedding) moved to aligned memory (5
    interleaved rounds of 128 tokens in one process, medians); fp32 moved less than the noise (55.88, 56.35)."""
    if p.data_ptr() % ALIGN:
        with torch.no_grad():
            p.data = p.data.clone()


def fuse_projections(linears: list[nn.Module]) -> Proj | list[Proj]:
    """Concatenate ``linears`` (all float ``nn.Linear``, all ``Int8Linear`` or all ``Int4Linear`` of one group
    size) along the output dimension and make each module's tensors row views of the fused ones: no copy survives,
    the modules keep working unchanged. Layers of mixed kinds are not fused: their :class:`Proj` list comes back."""
    kinds = {(type(m), getattr(m, "group_size", 0)) for m in linears}
    if len(kinds) > 1:
        return [module_proj(m) for m in linears]

    def concat_and_repoint(get, set_) -> Optional[torch.Tensor]:
        parts = [get(m) for m in linears]
        if parts[0] is None:
            return None
        fused = torch.cat([p.detach() for p in parts])
        start = 0
        for m, p in zip(linears, parts):
            set_(m, fused[start:start + p.shape[0]])
            start += p.shape[0]
        return fused

    if isinstance(linears[0], (Int8Linear, Int4Linear)):
        w = concat_and_repoint(lambda m: m.weight, lambda m, v: setattr(m, "weight", v))
        s = concat_and_repoint(lambda m: m.weight_scale, lambda m, v: setattr(m, "weight_scale", v))
        b = concat_and_repoint(lambda m: m.bias, lambda m, v: setattr(m, "bias", v))
        return Proj(w, s, b)

    def set_param(name):
        def set_(m, v):
            setattr(m, name, nn.Parameter(v, requires_grad=False))
        return set_

    w = concat_and_repoint(lambda m: m.weight, set_param("weight"))
    b = concat_and_repoint(lambda m: m.bias, set_param("bias"))
    return Proj(w, None, b)


def int8_words(q: torch.Tensor) -> Optional[torch.Tensor]:
    """The compiled step's view of an int8 matrix ``q`` ``[out, in]`` (or of packed int4, uint8 ``[out, in / 2]``):
    the same bytes as float32 words ``[out, in / 4]``, byte ``j`` of word ``m`` of a row being ``q[row, 4 m + j]``
    (little-endian). Shares ``q``'s memory. None for a non-contiguous ``q``, a row not a multiple of 4 bytes, a
    float ``q`` or a big-endian host.

    Why: Inductor's vectorised loops load int8 through a scalar copy per element, but float32 with plain vector
    loads; from a float32-typed word a bit cast and two shifts per byte give the signed values. Measured in the
    whole decode step (in-process A/B against converting int8 in the loop from a k-major copy): 1.6x (`small`) and
    2.1x (`medium`) faster at batch 1. (bf16 read the same way, two halves per word, was 3-8 % slower than
    Inductor's own vectorised bf16 conversion, so bf16 weights are read as they are.)
    """
    if q.dtype not in (torch.int8, torch.uint8) or q.dim() != 2 or q.shape[1] % 4 or q.storage_offset() % 4:
        return None
    if sys.byteorder != "little" or not q.is_contiguous():
        return None
    # Not q.view(torch.float32): the compiled step would trace that view back to its int8 base and read int8 again.
    # A tensor set on the same storage shares the bytes without being a view.
    words = torch.empty(0, dtype=torch.float32, device=q.device)
    return words.set_(q.untyped_storage(), q.storage_offset() // 4, (q.shape[0], q.shape[1] // 4))


def _int8_words_linear(x32: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """``x32`` ``[batch, in]`` float32 times the int8 matrix whose words are ``words`` ``[out, in / 4]``
    (:func:`int8_words`): ``[batch, out]`` float32, the products of ``x q^T`` (unscaled) summed byte lane by lane."""
    batch, n_words = x32.shape[0], words.shape[1]
    bits = words.view(torch.int32)
    lanes = [((bits << (24 - 8 * j)) >> 24).float() for j in range(4)]  # byte j, sign-extended: [out, in / 4]
    if batch > DECODE_ROWS_MAX:  # many rows: one GEMM on the unpacked matrix [out, in]
        return x32 @ torch.stack(lanes, dim=-1).view(words.shape[0], -1).T
    xs = x32.view(batch, n_words, 4)
    # Each lane's slice of x, materialised (see decode_linear) so that the loop reads it contiguously.
    parts = [torch.as_strided(xs[:, :, j].contiguous(), (batch, n_words), (n_words, 1)) for j in range(4)]
    rows = [(parts[0][b][None, :] * lanes[0] + parts[1][b][None, :] * lanes[1] + parts[2][b][None, :] * lanes[2]
             + parts[3][b][None, :] * lanes[3]).sum(-1) for b in range(batch)]
    return rows[0][None] if batch == 1 else torch.stack(rows)


def int4_word_scales(p: Proj) -> Optional[torch.Tensor]:
    """The group scale of every packed word of the int4 projection ``p`` (``words`` set): ``[out, in / 8]`` float16,
    a copy of 2 bits a weight (the packed weight has 4, its group scales 0.5).

    Why a copy: read per group, the scale is a strided gather inside the matrix-vector loop (Inductor loads it
    element by element), which cost ~30 % of a cached 4096 x 4096 int4 product here; read per word it is one more
    contiguous vector load (measured 4.4 -> 6.1 G weights/s on one core). None for other projections."""
    if p.words is None or p.scale is None or p.scale.dim() != 2:
        return None
    out, n_groups = p.scale.shape
    per_group = p.words.shape[1] // n_groups
    return p.scale[:, :, None].expand(out, n_groups, per_group).reshape(out, -1).contiguous()


def _int4_words_linear(x32: torch.Tensor, words: torch.Tensor, scale: torch.Tensor,
                       word_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x32`` ``[batch, in]`` float32 times the int4 matrix whose packed bytes are ``words`` ``[out, in / 8]``
    (:func:`int8_words` of the uint8 ``[out, in / 2]``) with group scales ``scale`` ``[out, n_groups]``:
    ``[batch, out]`` float32, scales applied.

    A word holds 8 nibbles: in a group of ``g`` inputs, word ``w`` (of ``g / 8``) has in byte ``b`` the levels of
    inputs ``4 w + b`` (low nibble) and ``g / 2 + 4 w + b`` (high nibble), the ``Q4_0`` layout. Each of the 8 lanes is
    a shift and a mask of the word, multiplied by its slice of ``x`` (de-interleaved once, here, into contiguous
    rows); the offset 8 of the stored levels is taken out once per word, ``sum (q - 8) x = sum q x - 8 sum x``, and
    the group's scale once per word of the reduction (``word_scale``, :func:`int4_word_scales`, when given; else
    gathered from ``scale``). Inductor fuses all of it into one loop over the bytes."""
    batch, n_words = x32.shape[0], words.shape[1]
    out, n_groups = scale.shape
    per_group = n_words // n_groups  # words per group, g / 8
    bits = words.view(torch.int32)
    if batch > DECODE_ROWS_MAX:  # many rows: one GEMM on the dequantized matrix [out, in]
        w = dequantize_weight_int4(bits.view(torch.uint8), scale, 8 * per_group)
        return x32 @ w.T
    xv = x32.view(batch, n_groups, 2, per_group, 4)  # [batch, group, half, word, byte]
    lanes, parts, x_sum = [], [], 0
    for half in range(2):
        for b in range(4):
            shift = 8 * b + 4 * half
            part = xv[:, :, half, :, b].contiguous().view(batch, n_words)
            x_sum = x_sum + part
            if shift == 28:  # the top nibble: masked in place it would be the int32 sign bit
                lanes.append(((bits >> 28) & 15).float())
            else:
                # Masked in place, the nibble converts to q * 2^shift exactly (at most 2^28: within float32's
                # 24-bit mantissa, as q has 4 bits); the 2^-shift goes onto x (exact: a power of two). One shift
                # fewer per weight than shifting each nibble down, the loop's bottleneck when the matrix is cached.
                lanes.append((bits & (15 << shift)).float())
                part = part * 2.0 ** -shift
            parts.append(torch.as_strided(part, (batch, n_words), (n_words, 1)))  # materialised, see decode_linear
    offset = 8.0 * x_sum  # [batch, in / 8]: 8 times the x each word's levels multiply
    offset = torch.as_strided(offset, offset.shape, offset.stride())  # materialised once, not per output row
    if word_scale is not None:
        s = word_scale.float()
    else:  # each word's group scale as an index expression of the reduction (a gather, see int4_word_scales)
        s = scale.float()[:, :, None].expand(out, n_groups, per_group).reshape(out, n_words)
    rows = []
    for r in range(batch):
        acc = lanes[0] * parts[0][r][None, :]
        for lane, part in zip(lanes[1:], parts[1:]):
            acc = acc + lane * part[r][None, :]
        rows.append(((acc - offset[r][None, :]) * s).sum(-1))
    return rows[0][None] if batch == 1 else torch.stack(rows)


def _row_blocks(out: int, rows: int) -> int:
    """Into how many equal blocks :func:`decode_linear` splits a float matrix of ``out`` rows for ``rows`` rows of
    activations: about 8 weight streams in all, each block a multiple of 16 rows (whole vectors of outputs)."""
    for split in (8, 4, 2):
        if split * rows <= 8 and out % (16 * split) == 0:
            return split
    return 1


def decode_linear(p, x: torch.Tensor, group_size: int = 0, w8a8: bool = False, float_mv: bool = False,
                  float_mm: bool = False) -> torch.Tensor:
    """``p(x)`` for the traced decode step, ``x`` ``[batch, seq, in]`` -> ``[batch, seq, out]`` (``seq`` new tokens
    per row: 1 when decoding, k + 1 when verifying speculative proposals).

    Written as ``sum(x * W, -1)`` per row instead of a matmul, so that Inductor generates the matrix-vector
    product itself: one fused, vectorised C++ loop that reads each weight once (converting bf16 or int8 on the fly)
    and needs no BLAS call. A BLAS ``gemv`` through ``mm`` reads fp32 at ~9 GB/s on one core here, the generated
    loop at ~17 GB/s, and bf16 weights halve the bytes. Up to :data:`DECODE_ROWS_MAX` rows (``batch * seq``) the
    per-row reductions share one loop over the weights (Inductor fuses reductions of the same shape), so a batch
    of 8 still reads each weight once. The accumulation is float32 whatever the weight dtype.

    ``group_size``: the int4 group size, needed (as a constant) when ``p`` has ATen's layout
    (:func:`aten_woq_layout`), whose kernels then compute the product for any number of rows. ``w8a8``: an int8
    ``p`` was prepared by :func:`w8a8_layout` and goes through :func:`w8a8_linear`, any number of rows (a flag, not
    ``p.w8a8``: the step rebuilds its projections from their tensors, and Dynamo must not touch FBGEMM's object).
    ``float_mv``: float32 and bfloat16 weights go through MiniGPT's C++ kernel, the op ``minigpt::float_mv``, up to
    :data:`DECODE_ROWS_MAX` rows as the loops (:mod:`~minigpt.infer.fastpath.float_mv`, for AOTInductor packages).
    ``float_mm``: more rows of float32 weights, and of bfloat16 ones where the CPU has no native bf16, through
    ``minigpt::float_mm`` (:mod:`~minigpt.infer.fastpath.float_mv`).
    """
    if isinstance(p, list):
        return torch.cat([decode_linear(q, x, group_size, w8a8, float_mv, float_mm) for q in p], dim=-1)
    if w8a8 and p.scale is not None and p.scale.dim() == 1:
        return w8a8_linear(p, x)
    batch, seq = x.shape[0], x.shape[1]
    rows = batch * seq  # every (row, position) is one vector of the product
    if p.q4:  # int4 x int8 (library.q4_layout), any number of rows
        return q4_linear(p, x)
    if p.aten_layout:  # any number of rows
        return aten_woq_linear(p, x, group_size)
    int4 = p.scale is not None and p.scale.dim() == 2
    if (rows > DECODE_ROWS_MAX or int4) and p.words is None:
        # A prompt's rows, known only when a prefill package runs: the C++ op picks register tiles or a GEMM
        return float_mm_linear(p, x) if float_mm and float_mm_takes(p) else p(x)
    x32 = x.reshape(rows, -1).float()
    # An identity as_strided makes Inductor materialise x first (its lowering realizes the input); otherwise it
    # inlines x's producer into the reduction and recomputes it for every output row (e.g. SiLU * up before w2).
    x32 = torch.as_strided(x32, x32.shape, x32.stride())
    if int4:
        y = _int4_words_linear(x32, p.words, p.scale, p.word_scale)
    elif p.words is not None:
        y = _int8_words_linear(x32, p.words)
    elif float_mv and p.scale is None and p.weight.dtype in (torch.float32, torch.bfloat16):
        y = torch.ops.minigpt.float_mv(x32, p.weight)
    else:
        w = p.weight.float() if p.weight.dtype != torch.float32 else p.weight
        # The rows of W in `split` blocks, each its own reduction of the same shape: Inductor fuses them into one
        # loop that reads `split` weight streams at once (the reductions of a batch's rows fuse the same way, so
        # fewer blocks for more rows). Measured over SmolLM-135M's layer matrices on a 2-core Sapphire Rapids, one
        # row: bf16 16.2 -> 22.4 GB/s, fp32 23.6 -> 26.5 GB/s with 8 blocks (docs/benchmarks.md).
        split = _row_blocks(w.shape[0], rows)
        blocks = w.chunk(split)
        ys = [torch.cat([(x32[r][None, :] * b).sum(-1) for b in blocks]) for r in range(rows)]
        y = ys[0][None] if rows == 1 else torch.stack(ys)
    if p.scale is not None and not int4:
        y = y * p.scale
    if p.bias is not None:
        y = y + p.bias.float()
    return y.to(x.dtype).view(batch, seq, -1)
