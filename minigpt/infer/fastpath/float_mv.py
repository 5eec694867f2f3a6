"""The float matrix-vector product of decode steps, ``minigpt::float_mv(x, weight)``: float32 rows ``x``
``[rows, in]`` times a float32 or bfloat16 matrix ``weight`` ``[out, in]`` -> ``[rows, out]`` float32, every weight
converted to float32 exactly and the products summed in float32.

Two kernels compute it: the reference below (PyTorch, CompositeExplicitAutograd: it always runs) and MiniGPT's C++
one (``minigpt/infer/float_kernel.cpp``, in the native runner library, registered for CPU by
:func:`float_mv_kernel`); they differ in the order of the float32 sum only. A bf16 model's AOTInductor step package
calls the op once per projection (:func:`~minigpt.infer.fastpath.kernels.decode_linear`) where the C++ kernel runs
(:func:`float_mv_wanted`).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from minigpt.infer.fastpath.library import runner_kernel
from minigpt.infer.launcher import install_float_kernel
from minigpt.runtime import cpu_vendor, native_bf16

FLOAT_MV_ENV = "MINIGPT_FLOAT_MV"

_LIB = torch.library.Library("minigpt", "FRAGMENT")
_LIB.define("float_mv(Tensor x, Tensor weight) -> Tensor")
_FOUND: list[str] = []  # once float_mv_kernel has looked: the C++ kernel's instruction set, or "" (none here)


def _float_mv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.float() @ weight.float().T


_LIB.impl("float_mv", _float_mv, "CompositeExplicitAutograd")
# The same product for a prompt's rows (a prefill package's or an eager prefill's, any number: float_mm_wanted):
# the C++ kernel multiplies up to 16 rows in register tiles, bf16 converted in registers, and more through its own
# packed GEMM (each weight converted once per block of rows into a float32 panel).
_LIB.define("float_mm(Tensor x, Tensor weight) -> Tensor")
_LIB.impl("float_mm", _float_mv, "CompositeExplicitAutograd")


def _product_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


for _op in ("minigpt::float_mv", "minigpt::float_mm"):
    torch.library.register_fake(_op)(_product_fake)


def float_mv_kernel() -> Optional[str]:
    """Register the C++ CPU kernel of ``minigpt::float_mv`` for this process (once) and return the instruction set
    it runs (``"avx512"``, ``"avx2"`` or ``"scalar"``; ``$MINIGPT_FLOAT_MV_ISA`` caps it), or None where it cannot
    be had: the compile cache is off (the runner library is built there), no C++ compiler, the build failed."""
    return runner_kernel(_FOUND, install_float_kernel, "float_mv_isa")


def _setting_allows() -> bool:
    """``$MINIGPT_FLOAT_MV``: ``1`` lets the C++ kernel take the products on any CPU, ``0`` on none; unset, on AMD's
    (:func:`~minigpt.runtime.cpu_vendor`)."""
    choice = os.environ.get(FLOAT_MV_ENV, "").strip()
    return choice == "1" or (choice != "0" and cpu_vendor() == "AuthenticAMD")


def float_mv_wanted(projections) -> bool:
    """Whether an AOTInductor step sends its float projections through ``minigpt::float_mv``: some of
    ``projections`` (Proj objects) have bfloat16 weights, the C++ kernel is vectorised here (:func:`float_mv_kernel`;
    building it the first time takes ~25 s), and the CPU is AMD's (:func:`~minigpt.runtime.cpu_vendor`) or
    ``$MINIGPT_FLOAT_MV`` is ``1`` (``$MINIGPT_FLOAT_MV=0``: never).
    Else the step writes its float products as per-row reductions that Inductor turns into loops
    (:func:`~minigpt.infer.fastpath.kernels.decode_linear`).

    Why bfloat16 on AMD: its package's C++ source then holds no matrix-vector loops and compiles in about half the
    time (SmolLM-135M's shape on a 2-core Zen 5 EPYC, family 26 model 2, a fresh compile cache, the first greedy
    step package: 117.8 -> 62.2 s), and decode is unchanged within that host's noise: paired medians of 9
    alternating 128-token runs in one process against the loops 0.99-1.13x over 6 runs (median 1.06), `minigpt
    generate --compile` 1.24 against 1.25 s (medians of 5 alternating calls), the same tokens. Not on Intel: on a
    2-core Sapphire Rapids (family 6 model 207) the same package decoded 0.74x of the loops (46.4 against 64.2
    tokens/s, paired medians of 9; 0.59x with the kernel capped to AVX2), the loops reading 8 blocks of rows at once
    where the kernel reads one row after another (4-16 blocks at once in the kernel: 0.93-0.94x there, and 0.68-0.75x
    of one stream on the Zen 5, so not kept). On a 2-core AVX2-only Zen 3 EPYC (family 25 model 1) the loops
    decoded 1.09-1.13x the kernel at SmolLM-135M's shape (paired medians of 9 and 11 alternating 128-token runs in
    one process, the same tokens; sessions 68-69), so AMD CPUs without AVX-512 took the loops for a session; since
    the kernel asks for its bf16 rows 1 KB ahead (session 69) the loops decode 0.98x and 1.03x the kernel there at
    135M and 0.74x at 1.1B (the kernel 16.3 against 12.1 tokens/s, paired median of 5). Not float32: on the Zen
    5 its package compiled in 58.4 s instead of 99.6, but decoded at 0.86-1.11x in process (median 0.98 over 7
    runs; 0.98 again in session 61) and the CLI call took 2.44 against 2.22 s; the proxy executor through which
    AOTInductor calls the op is not the cause (0.45 us a call more than a C shim on the Sapphire Rapids, about 55
    us of a 12 ms token). Not ``torch.compile``'s steps: their Python wrapper makes each call a round trip, fp32
    decode 0.92x (docs/benchmarks.md, sessions 59-61)."""
    if not _setting_allows():
        return False
    if not any(p.scale is None and p.weight is not None and p.weight.dtype == torch.bfloat16 for p in projections):
        return False
    return float_mv_kernel() not in (None, "scalar")


def float_mm_wanted(projections, load: bool = True) -> bool:
    """Whether a prompt's rows (more than :data:`~minigpt.infer.fastpath.kernels.DECODE_ROWS_MAX`: a prefill
    package's, an eager prefill's) times the float weights among ``projections`` (Proj objects) go through
    ``minigpt::float_mm``: on AMD CPUs (or any with ``$MINIGPT_FLOAT_MV=1``; never with ``0``), bfloat16 weights
    where the C++ kernel is vectorised (the caller checks that the CPU has no native bf16), float32 weights where it
    runs AVX2 code, the CPU having no AVX-512 (there oneDNN's float32 GEMM runs 512-bit code: not measured against
    this one). ``load``: build and load the kernel if it is not yet (:func:`float_mv_kernel`); else False until
    something has (an eager prefill does not build the runner library for itself).

    Why float32 too: on a 2-core AVX2-only Zen 3 EPYC (family 25 model 1), every float32 projection of
    SmolLM-135M's shape, eager, 2 threads, lower of two medians of 5, the kernel's time / the GEMM it replaces
    (oneDNN's, :func:`~minigpt.infer.fastpath.kernels.fp32_gemm_library`) was 0.73x at 13 to 128 rows, 0.90x at
    245, 1.03x at 512; TinyLlama-1.1B's 0.77x at 13, 0.88x at 62, 0.94x at 245, 0.98x at 512 (docs/benchmarks.md,
    session 78)."""
    if not _setting_allows():
        return False
    dtypes = {p.weight.dtype for p in projections if p.scale is None and p.weight is not None
              and p.weight.device.type == "cpu"}
    if not dtypes & {torch.float32, torch.bfloat16} or not (load or _FOUND):
        return False
    isa = float_mv_kernel()
    return isa == "avx2" if torch.float32 in dtypes else isa in ("avx2", "avx512")


def float_mm_takes(p) -> bool:
    """Whether ``minigpt::float_mm`` takes Proj ``p``: float32 weights, or bfloat16 where the CPU has no native bf16
    (there oneDNN's bf16 GEMM is faster)."""
    w = p.weight
    return p.scale is None and w is not None and (w.dtype == torch.float32 or (
        w.dtype == torch.bfloat16 and not native_bf16("cpu")))


def float_mm_linear(p, x: torch.Tensor) -> torch.Tensor:
    """``p(x)`` through ``minigpt::float_mm`` (``minigpt/infer/float_kernel.cpp``: register tiles up to 16 rows, its
    packed float32 GEMM above), ``x`` ``[..., in]`` -> ``[..., out]`` in ``x``'s dtype, summed in float32."""
    y = torch.ops.minigpt.float_mm(x.reshape(-1, x.shape[-1]).float(), p.weight)
    y = y if p.bias is None else y + p.bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], -1)
