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
from minigpt.runtime import cpu_vendor

FLOAT_MV_ENV = "MINIGPT_FLOAT_MV"

_LIB = torch.library.Library("minigpt", "FRAGMENT")
_LIB.define("float_mv(Tensor x, Tensor weight) -> Tensor")
_FOUND: list[str] = []  # once float_mv_kernel has looked: the C++ kernel's instruction set, or "" (none here)


def _float_mv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.float() @ weight.float().T


_LIB.impl("float_mv", _float_mv, "CompositeExplicitAutograd")
# The same product for a prompt's rows (a prefill package's, any number): the C++ kernel multiplies up to 16 rows
# in register tiles, bf16 converted in registers, and more through its own packed GEMM (each weight converted once
# per block of rows into a float32 panel).
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
    choice = os.environ.get(FLOAT_MV_ENV, "").strip()
    if choice == "0" or (choice != "1" and cpu_vendor() != "AuthenticAMD"):
        return False
    if not any(p.scale is None and p.weight is not None and p.weight.dtype == torch.bfloat16 for p in projections):
        return False
    return float_mv_kernel() not in (None, "scalar")
