"""int8 and int4 products through library kernels, for decode steps (eager and compiled) of few rows: ATen's
weight-only kernels on bf16 activations (:func:`aten_woq_layout` / :func:`aten_woq_linear`), FBGEMM's int8 x int8
product on activations rounded to 8 bits per row (:func:`w8a8_layout` / :func:`w8a8_linear`, reached from a
compiled step through the ``minigpt::w8a8_mm`` op, whose CPU kernel is C++ where the native runner library builds:
:func:`w8a8_kernel`) and MiniGPT's own int4 x int8 kernel on activations rounded to 8 bits per group
(:func:`q4_layout` / :func:`q4_linear`, the op ``minigpt::q4_mm``, C++ in the same library: :func:`q4_kernel`).
Which of them a model uses: :data:`WOQ_KERNELS`.

The projections are :class:`~minigpt.infer.fastpath.kernels.Proj` objects (read here by their fields only).
"""
from __future__ import annotations

import functools
import os
import subprocess
import tempfile
import threading
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from minigpt.infer.launcher import (
    RUNNER_FLAGS,
    RUNNER_SOURCES,
    NativeError,
    cache_dir,
    install_q4_kernel,
    install_w8a8_kernel,
    runner_digest,
    trusted,
)
from minigpt.model.quant import dequantize_weight_int4
from minigpt.runtime import cpu_flags

# The projections: kernels.Proj, which imports this module (so typed loosely here).
Proj = Any


# Which kernels decode steps use for int8 / int4 weights: "w8a8" (int8 through FBGEMM's int8 x int8 product,
# w8a8_layout; int4 as "auto"), "aten" (ATen's weight-only kernels on bf16 activations, aten_woq_layout), "words"
# (the compiled step's generated loops, kernels.int8_words, float32 activations) or "auto" (w8a8 for int8 where
# w8a8_available(); int4 through MiniGPT's int4 x int8 kernel where it runs vectorised, q4_wanted; what is left on
# ATen's kernels where the CPU has AVX-512, for which they are vectorised, else on the loops).
WOQ_KERNELS = ("auto", "w8a8", "aten", "words")


def aten_woq_wanted(kernel: str) -> bool:
    """Whether ``kernel`` (one of :data:`WOQ_KERNELS`) means ATen's weight-only kernels (for the weights that
    :func:`w8a8_wanted` leaves) on this CPU. Raises ``ValueError`` for another name."""
    if kernel not in WOQ_KERNELS:
        raise ValueError(f"unknown int8/int4 kernel {kernel!r}; choose {', '.join(WOQ_KERNELS)}")
    return kernel == "aten" or (kernel in ("auto", "w8a8") and torch.backends.cpu.get_cpu_capability() == "AVX512")


def w8a8_wanted(kernel: str) -> bool:
    """Whether ``kernel`` (one of :data:`WOQ_KERNELS`) may send int8 projections through :func:`w8a8_linear` here:
    with FBGEMM where :func:`w8a8_available`, else, on an AVX2 CPU, through MiniGPT's own kernel alone
    (:func:`w8a8_layouts` decides, once it knows that kernel builds)."""
    return kernel in ("auto", "w8a8") and (w8a8_available() or "avx2" in cpu_flags())


class OwnInt8:
    """What :attr:`Proj.w8a8` holds for an int8 matrix that MiniGPT's C++ kernel multiplies in place for every row
    count (``minigpt::w8a8_mm``; CPUs with AVX2 but not AVX512-VNNI, where FBGEMM's product is not exact): there is
    no packed copy. Eager products of any number of rows (prefill too) go through that kernel."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "OWN_INT8"


OWN_INT8 = OwnInt8()


def own_int8_isa() -> Optional[str]:
    """The instruction set of MiniGPT's C++ int8 kernel here (``"avx512_vnni"`` or ``"avx2"``), None where the
    runner library does not build or the kernel does not run. Builds the library the first time (~25 s)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the Python kernel's warning: irrelevant to this question
        if w8a8_kernel() != "c++":
            return None
    isa = str(torch.ops.minigpt.w8a8_isa())
    return None if isa == "fbgemm" else isa


def aten_woq_layout(p: Proj) -> bool:
    """Give the int8 or int4 projection ``p`` what ATen's weight-only kernels read in the compiled step; False (and
    ``p`` untouched) for float weights, weights off the CPU, int4 shapes those kernels refuse (output rows not a
    multiple of 16, groups other than 32, 64, 128 or 256) and int8 rows of a length not a multiple of 16 (torch 2.13's
    ``_weight_int8pack_mm`` reads past the end of each activation row there: a NaN placed after a row of 100, 136
    or 172 values came out in the product; 64, 96, 128, 160, 176 were clean).

    int8 (``aten._weight_int8pack_mm``): the int8 matrix as it is, its per-row scales as a bf16 copy in
    ``word_scale``. int4 (``aten._weight_int4pack_mm_for_cpu``): ``words`` = the levels repacked by
    ``aten._convert_weight_to_int4pack_for_cpu`` (a second copy of the packed matrix, same size: the eager path and
    prefill keep reading ``weight``), ``word_scale`` = ``[in / group_size, out, 2]`` bf16 (scale, zero): that kernel
    computes ``(q - 8) * scale + zero``, which with zero 0 is ``Q4_0``'s ``(q - 8) * d`` exactly. A bf16
    ``word_scale`` (:attr:`Proj.aten_layout`) is what tells :func:`decode_linear` and eager decode steps to call
    these kernels.

    Why: measured on a 2-core Sapphire Rapids (docs/benchmarks.md), the compiled `small` step decodes 1.87x (int8)
    and 1.57x (int4) faster through them than through the generated loops; they vectorise on bf16 activations
    (llama.cpp rounds its activations further, to 8-bit blocks, for its ``Q8_0`` / ``Q4_0`` dot products). The cost: x rounded to bf16 (relative error <= 2^-9 per
    element) and the output rounded to bf16, ~0.3 % relative on a product, against 0.9 % (int8) and ~8 % (int4) of
    the weight rounding itself."""
    if p.scale is None or p.weight is None or p.weight.device.type != "cpu":
        return False
    if p.scale.dim() == 1:
        if p.weight.shape[1] % 16:  # measured: ATen's int8 kernel then reads past the end of each activation row
            return False
        p.words, p.word_scale = None, p.scale.to(torch.bfloat16)
        return True
    out, n_groups = p.scale.shape
    group_size = 2 * p.weight.shape[1] // n_groups
    if out % 16 or group_size not in (32, 64, 128, 256):
        return False
    levels = _q4_0_levels(p.weight, n_groups).to(torch.int32)
    p.words = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
    scale = p.scale.float().T  # [n_groups, out]
    p.word_scale = torch.stack([scale, torch.zeros_like(scale)], dim=-1).to(torch.bfloat16).contiguous()
    return True


def _q4_0_levels(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """The levels (0..15, uint8) ``[out, in]`` of a ``Q4_0``-packed matrix ``[out, in / 2]`` of ``groups`` groups a
    row: in a group of ``g`` inputs, byte ``b`` holds input ``b`` (low nibble) and ``g / 2 + b`` (high)."""
    out = packed.shape[0]
    grouped = packed.view(out, groups, -1)
    return torch.stack([grouped & 15, grouped >> 4], dim=2).view(out, -1)


@functools.lru_cache(maxsize=None)
def _group_size_tensor(group_size: int) -> torch.Tensor:
    return torch.tensor(group_size)


def aten_woq_linear(p: Proj, x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``p(x)`` through ATen's weight-only kernel for ``p`` (:func:`aten_woq_layout`): ``x`` ``[..., in]`` ->
    ``[..., out]`` in ``x``'s dtype, scales and bias applied, any number of rows. ``group_size``: of an int4 ``p``,
    a Python int (the traced step's shapes are symbolic, and the kernel takes a constant)."""
    xb = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()  # the kernels read rows densely
    if p.scale.dim() == 2:
        # The op aten._weight_int4pack_mm_for_cpu lowers to, called directly with the group size as a 0-dim tensor:
        # through the aten op, Inductor (torch 2.13) makes that tensor itself, and inside the step's nested compile
        # region the kernel then refuses it ("group size must be a scalar"). An opaque custom op around the aten op
        # also worked but cost ~12 % of the int4 decode rate (`small`: 478 against 545 tokens/s) in Python dispatch.
        # Eager steps reuse one tensor per group size (120 calls a token at 135M); a traced step makes its own.
        size = torch.tensor(group_size) if torch.compiler.is_compiling() else _group_size_tensor(group_size)
        y = torch.ops.quantized.int4mm_packed_weight_cpu(xb, p.words, size, p.word_scale)
    else:
        y = torch.ops.aten._weight_int8pack_mm(xb, p.weight, p.word_scale)
    y = y.float() if p.bias is None else y.float() + p.bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def w8a8_available() -> bool:
    """Whether :func:`w8a8_linear` is exact here: PyTorch has FBGEMM (x86 builds) and the CPU has AVX512-VNNI.

    Without VNNI, FBGEMM multiplies uint8 activations by int8 weights with ``vpmaddubsw``, which adds pairs of
    products in 16 bits and saturates (2 x 255 x 127 > 32767; pytorch/pytorch#44939, pytorch/FBGEMM#125); PyTorch's
    own dynamic quantization uses 7-bit activations on such CPUs for that reason. VNNI's ``vpdpbusd`` sums into 32
    bits."""
    return "fbgemm" in torch.backends.quantized.supported_engines and "avx512_vnni" in cpu_flags()


# FBGEMM's prepacked weights and the row scales, keyed by their int8 matrix's (address, shape): the compiled step
# passes the matrix to the `minigpt::w8a8_mm` op, which finds them here (Inductor cannot trace the packed object).
_PACKED: dict[tuple[int, tuple[int, ...]], tuple[Any, torch.Tensor]] = {}
_KERNEL: list[str] = []  # the op's CPU kernel once w8a8_kernel has registered it: ["c++"] or ["python"]
_KERNEL_LOCK = threading.RLock()  # held while either changes (re-entrant: a finalizer may run inside)


def _packed_key(weight: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return weight.data_ptr(), tuple(weight.shape)


def w8a8_layout(p: Proj) -> bool:
    """Prepare the int8 projection ``p`` (per-row scales) for :func:`w8a8_linear`: FBGEMM's prepacked copy of its
    int8 matrix and scales (the same bytes again, in FBGEMM's blocked layout), stored in ``p.w8a8``. False (``p``
    untouched) for other weights, weights off the CPU or a PyTorch without FBGEMM. Many at once:
    :func:`w8a8_layouts`.

    Why: one activation row times an int8 matrix is bound by converting each weight to float in ATen's
    weight-only kernel (``_weight_int8pack_mm``: 10.2 GB/s over SmolLM-135M's 120 layer matrices on a 2-core
    Sapphire Rapids), while FBGEMM's int8 x int8 product with int32 sums reads them at 17--21 GB/s, and at 4 and 8
    rows 1.6x and 2.1x faster still (docs/benchmarks.md). The price is the activations rounded to 8 bits per row,
    as llama.cpp does for its ``Q8_0`` dot products (in blocks of 32)."""
    return w8a8_layouts([p])[0]


def w8a8_layouts(projections: list[Proj]) -> list[bool]:
    """:func:`w8a8_layout` of each projection, packed by ``torch.get_num_threads()`` threads: FBGEMM packs one
    matrix on one core at ~0.24 GB/s (SmolLM-135M's 163 MB of int8: ~0.7 s), and the packing releases the GIL."""
    todo = [p for p in projections if p.scale is not None and p.scale.dim() == 1 and p.weight is not None
            and p.weight.dtype == torch.int8 and p.weight.device.type == "cpu"]
    if todo and not w8a8_available() and "avx2" in cpu_flags() and own_int8_isa() == "avx2":
        return _own_layouts(projections, todo)
    if not todo or not w8a8_available():
        return [False] * len(projections)
    engine = torch.backends.quantized.engine
    try:
        with warnings.catch_warnings():
            # quantized tensors are deprecated in PyTorch (pinned at 2.13 here); these only carry the weights and
            # their scales into FBGEMM's packing routine
            warnings.simplefilter("ignore", UserWarning)
            torch.backends.quantized.engine = "fbgemm"  # the packed type decides the kernel at every call
            quantized = [torch._make_per_channel_quantized_tensor(
                p.weight.contiguous(), p.scale.double(), torch.zeros(p.weight.shape[0], dtype=torch.int64), 0)
                for p in todo]
            with ThreadPoolExecutor(max(1, min(len(todo), torch.get_num_threads()))) as pool:
                packed = list(pool.map(lambda q: torch.ops.quantized.linear_prepack(q, None), quantized))
    except RuntimeError:
        return [False] * len(projections)
    finally:
        torch.backends.quantized.engine = engine
    with _KERNEL_LOCK:
        for p, pk in zip(todo, packed):
            key = _packed_key(p.weight)
            _PACKED[key] = pk, p.scale
            if _KERNEL == ["c++"]:
                torch.ops.minigpt.w8a8_adopt(key[0], *key[1], pk, p.scale)
            # freed memory may be reused by another matrix; at exit nothing is reused (and the ops may be gone)
            weakref.finalize(p.weight, _forget, key).atexit = False
            p.w8a8 = pk
    done = {id(p) for p in todo}
    return [id(p) in done for p in projections]


def _own_layouts(projections: list[Proj], todo: list[Proj]) -> list[bool]:
    """:func:`w8a8_layouts` on an AVX2 CPU without VNNI: each int8 matrix handed to the C++ kernel as it lies in
    memory (``minigpt::w8a8_register``), ``p.w8a8`` = :data:`OWN_INT8`. Why: the compiled step's generated loops
    pick each weight out of its float32 word and convert it to float, where the kernel widens 16 bytes with one
    instruction and multiplies them with one (``vpmaddwd``): 135M int8 decode 42 -> 99 tokens/s, and 0.50x -> 1.39x
    llama.cpp's ``Q8_0`` built for AVX2, both capped to AVX2 on an AVX-512 Xeon (docs/benchmarks.md)."""
    with _KERNEL_LOCK:
        for p in todo:
            key = _packed_key(p.weight)
            torch.ops.minigpt.w8a8_register(key[0], *key[1], p.scale)
            weakref.finalize(p.weight, _forget, key).atexit = False
            p.w8a8 = OWN_INT8
    done = {id(p) for p in todo}
    return [id(p) in done for p in projections]


def w8a8_linear(p: Proj, x: torch.Tensor) -> torch.Tensor:
    """``p(x)`` with the activations rounded to 8 bits as well: ``x`` ``[..., in]`` -> ``[..., out]`` in ``x``'s dtype,
    any number of rows.

    Each row of ``x`` is quantized on its own, symmetric: ``s = max|x| / 127``, ``q = round(x / s)`` in -127..127
    (passed to FBGEMM as ``x / s`` with scale 1 and zero point 128, so that a row's result never depends on the
    other rows of a batch; FBGEMM rounds ``x / s + 128`` to float32 first, so a value within float32 rounding of a
    half may land on the other integer); ``y = s * w_scale * sum(q * w) (+ bias)``, the sum exact in int32 (FBGEMM,
    ``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``; compiled steps of up to 4 rows: MiniGPT's own
    kernel, ``minigpt/infer/w8a8_kernel.cpp``, the same bits). llama.cpp likewise rounds activations to 8 bits
    (blocks of 32, ``Q8_0``) for its integer dot products. Measured on stories260K (a real checkpoint, dim 64), every
    int8 projection and the head through it: next-token loss on 511 TinyStories tokens 1.3140 nats against 1.3112
    for fp32 and 1.3100 for ATen's bf16-activation kernel; 200 greedy tokens from BOS equal fp32's up to token 61,
    as with ATen's kernel and with float activations (the int8 weights' rounding decides there)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    s = x2.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) / 127.0  # [rows, 1]
    fbgemm = p.w8a8 is not None and p.w8a8 is not OWN_INT8
    if fbgemm and not torch.compiler.is_compiling():  # eager: no trip through the op and its lookup
        y = _W8A8_MM(x2 / s, 1.0, 128, p.w8a8) * s
    else:  # a traced step (its projections carry no packed object), or MiniGPT's kernel alone: the op finds it
        y = torch.ops.minigpt.w8a8_mm(x2 / s, p.weight) * s
    if p.bias is not None:
        y = y + p.bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], -1)


# `minigpt::w8a8_mm(x, weight)`: FBGEMM's product of the rows of ``x`` (already divided by their scale, so that
# rounding to integers is the 8-bit quantization) with the prepacked ``weight``. Defined here with its shape
# function (for tracing) and the Python kernel below under CompositeExplicitAutograd, so that it always runs (an
# eager `static_step`, say); a CPU kernel, chosen at the first compiled step that needs it (w8a8_kernel), takes
# precedence. Registered through the low-level Library API: a `torch.library.custom_op` costs ~10 us more a call.
_LIB = torch.library.Library("minigpt", "FRAGMENT")
_LIB.define("w8a8_mm(Tensor x, Tensor weight) -> Tensor")
_W8A8_MM = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32


def _w8a8_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    entry = _PACKED.get(_packed_key(weight))
    if entry is None:
        raise RuntimeError("minigpt::w8a8_mm: this int8 matrix has no packed copy (w8a8_layout was not called on it)")
    return _W8A8_MM(x, 1.0, 128, entry[0])


_LIB.impl("w8a8_mm", _w8a8_mm, "CompositeExplicitAutograd")


def _forget(key: tuple[int, tuple[int, ...]]) -> None:
    with _KERNEL_LOCK:
        _PACKED.pop(key, None)
        if _KERNEL == ["c++"]:
            torch.ops.minigpt.w8a8_forget(key[0])


def build_runner(directory: Path) -> Path:
    """The runner library (``minigpt/infer/native_runner.cpp``, ``q4_kernel.cpp`` and ``w8a8_kernel.cpp`` against
    this torch's headers and libraries) in ``directory``, built when absent (a C++17 compiler: ``$CXX`` or ``c++``;
    the sources compiled side by side, ~25 s on 2 cores) and written atomically. It is both the native launcher's runner and
    this module's C++ kernels of ``minigpt::w8a8_mm`` and ``minigpt::q4_mm``. Raises ``RuntimeError`` with the
    compiler's last lines when the build fails."""
    path = directory / f"runner-{runner_digest()}.so"
    if path.is_file() and trusted(path):
        return path
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    root = Path(torch.__file__).resolve().parent  # torch.utils.cpp_extension's include and library paths on a CPU
    lib = root / "lib"
    cxx = os.environ.get("CXX", "c++")
    flags = [*RUNNER_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
    with tempfile.TemporaryDirectory(prefix=".partial-", dir=directory) as work:
        objects = [str(Path(work) / f"{source.stem}.o") for source in RUNNER_SOURCES]
        tmp = str(Path(work) / "runner.so")
        try:
            jobs = [subprocess.Popen([cxx, *flags, "-c", str(source), "-o", obj], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
                    for source, obj in zip(RUNNER_SOURCES, objects)]
            results = []
            for job in jobs:
                stderr = job.communicate()[1]  # reads the pipe to the end, then waits
                results.append((job.returncode, stderr))
            if all(code == 0 for code, _ in results):
                link = subprocess.run([cxx, "-shared", "-fopenmp", *objects, "-o", tmp, f"-L{lib}", "-ltorch_cpu", "-lc10",
                                       f"-Wl,-rpath,{lib}"], capture_output=True, text=True)
                results.append((link.returncode, link.stderr))
        except OSError as e:  # no compiler at all
            raise RuntimeError(f"building the native runner failed ({cxx}): {e}") from None
        for code, stderr in results:
            if code != 0:
                tail = " ".join(stderr.strip().splitlines()[-3:])
                raise RuntimeError(f"building the native runner failed ({cxx}): {tail[:400]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, path)
    return path


def w8a8_kernel() -> str:
    """Register the CPU kernel of ``minigpt::w8a8_mm`` for this process (once) and return which it is: ``"c++"``,
    the native runner library's (``minigpt/infer/native_runner.cpp``, built into the compile cache once per
    machine and torch version, ~25 s; the packed copies made here are handed to it), else ``"python"``
    (:func:`_w8a8_mm`), with a warning saying why (the compile cache is off, no C++ compiler, the build failed).

    Why C++: a compiled step (an AOTInductor package or ``torch.compile``'s code) calls the op ~120 times a token at
    135M, and a Python kernel makes each call a round trip into the interpreter: int8 decode 58-65 against 88-98
    tokens/s with the C++ kernel, same tokens (2-core Xeon model 207, docs/benchmarks.md). The C++ kernel sends
    calls of up to 4 rows to MiniGPT's own int8 kernel (``minigpt/infer/w8a8_kernel.cpp``, FBGEMM's bits, tested)
    and the rest to the same FBGEMM function on the same packed copies, so the numbers are identical."""
    with _KERNEL_LOCK:
        if _KERNEL:
            return _KERNEL[0]
        try:
            directory = cache_dir()
            if directory is None:
                raise RuntimeError("the compile cache is off ($MINIGPT_COMPILE_CACHE), where its library is built")
            install_w8a8_kernel(build_runner(directory))
            for key, (packed, scale) in list(_PACKED.items()):
                torch.ops.minigpt.w8a8_adopt(key[0], *key[1], packed, scale)
            _KERNEL.append("c++")
        except (OSError, RuntimeError, NativeError) as e:  # NativeError is a RuntimeError; named for the reader
            # the Python kernel for CPU too: a runner library loaded later then refuses to take over
            if not torch._C._dispatch_has_kernel_for_dispatch_key("minigpt::w8a8_mm", "CPU"):
                _LIB.impl("w8a8_mm", _w8a8_mm, "CPU")
            warnings.warn(f"int8 products of compiled steps run through MiniGPT's Python kernel, slower (int8 decode "
                          f"~1.4x at 135M): {e}", RuntimeWarning, stacklevel=2)
            _KERNEL.append("python")
        return _KERNEL[0]


# --- int4 x int8: minigpt::q4_mm ---------------------------------------------------------------------------------
# `minigpt::q4_mm(x, weight, scale)`: float32 rows times an int4 matrix in q4_layout's blocks, the activations rounded
# to 8 bits per group inside (minigpt/infer/q4_kernel.cpp, whose header gives the layout and the arithmetic). The
# reference kernel below (CompositeExplicitAutograd: it always runs) computes the same integers in PyTorch; the C++
# one, registered for CPU by q4_kernel(), is the one decode steps use.
_LIB.define("q4_mm(Tensor x, Tensor weight, Tensor scale) -> Tensor")
_Q4: list[str] = []  # once q4_kernel has looked: the instruction set of the C++ kernel, or "" (none here)


def q4_levels(weight: torch.Tensor) -> torch.Tensor:
    """The int4 levels (0..15, ``int16``) ``[out, in]`` of a matrix in :func:`q4_layout`'s blocks ``weight``
    ``[out / 16, in / 8, 64]``: row ``16 b + i``, input ``8 c + 4 h + j`` is nibble ``h`` of byte ``4 i + j`` of
    ``weight[b, c]``."""
    blocks, chunks = weight.shape[0], weight.shape[1]
    w = weight.view(blocks, chunks, 16, 4).to(torch.int16)
    levels = torch.stack([w & 15, w >> 4], dim=3)  # [block, chunk, row, half, j]
    return levels.permute(0, 2, 1, 3, 4).reshape(blocks * 16, chunks * 8)


def _q4_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, n_in = x.shape
    groups = scale.shape[1]
    group = n_in // groups
    xg = x.float().reshape(rows, groups, group)
    d = xg.abs().amax(-1, keepdim=True) / 127.0  # llama.cpp's Q8_0 scale, kept in float32
    inv = torch.where((d != 0) & d.isfinite(), 1.0 / d, torch.zeros_like(d))
    q = torch.round(xg * inv)  # ties to even, as the C++ kernel's nearbyint
    levels = (q4_levels(weight) - 8).double().view(-1, groups, group)
    isum = torch.einsum("rgk,ogk->rog", q.double(), levels).float()  # exact: small integers
    s = scale.permute(0, 2, 1).reshape(-1, groups).float()  # [out, groups]
    return (isum * (s[None] * d.view(rows, 1, groups))).sum(-1)


_LIB.impl("q4_mm", _q4_mm, "CompositeExplicitAutograd")


# `minigpt::q4_dequant(packed, scale, bf16)`: an int4 matrix (packed [out, in / 2] uint8, scale [out, groups] float16,
# minigpt.model.quant) as float32, or bfloat16, [out, in], for prefill's GEMM. Reference: dequantize_weight_int4; the
# C++ kernel (q4_kernel.cpp), registered with q4_mm's, gives the same numbers in one pass.
_LIB.define("q4_dequant(Tensor packed, Tensor scale, bool bf16) -> Tensor")
_LIB.impl("q4_dequant", lambda packed, scale, bf16: dequantize_weight_int4(
    packed, scale, 2 * packed.shape[1] // scale.shape[1], torch.bfloat16 if bf16 else torch.float32),
    "CompositeExplicitAutograd")


@torch.library.register_fake("minigpt::q4_mm")
def _q4_mm_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] * 16)


def q4_kernel() -> Optional[str]:
    """Register the C++ CPU kernel of ``minigpt::q4_mm`` for this process (once) and return the instruction set it
    runs (``"avx512_vnni"``, ``"avx2"`` or ``"scalar"``; ``$MINIGPT_Q4_ISA`` caps it), or None where it cannot be
    had: the compile cache is off (the runner library is built there), no C++ compiler, the build failed."""
    return runner_kernel(_Q4, install_q4_kernel, "q4_isa")


def runner_kernel(found: list[str], install: Callable[[Path], None], isa_op: str) -> Optional[str]:
    """Once per process (``found`` empty until then, the answer appended to it): build the runner library, make
    ``install(library)`` register its C++ kernel of an op, and return the instruction set it runs, the string the
    op ``minigpt::<isa_op>`` returns; None where it cannot be had (the compile cache, where the library is built, is
    off; no C++ compiler; the build failed; the library refused to register)."""
    with _KERNEL_LOCK:
        if not found:
            try:
                directory = cache_dir()
                if directory is None:
                    raise RuntimeError("the compile cache is off")
                install(build_runner(directory))
                found.append(str(getattr(torch.ops.minigpt, isa_op)()))
            except (OSError, RuntimeError):  # NativeError is a RuntimeError
                found.append("")
        return found[0] or None


def q4_wanted(kernel: str) -> bool:
    """Whether ``kernel`` (one of :data:`WOQ_KERNELS`) sends int4 projections through :func:`q4_linear` here:
    ``"auto"`` or ``"w8a8"`` and the C++ kernel vectorised on this CPU (AVX512-VNNI or AVX2, :func:`q4_kernel`;
    building it the first time takes ~25 s)."""
    return kernel in ("auto", "w8a8") and q4_kernel() not in (None, "scalar")


def q4_layout(p: Proj) -> bool:
    """Give the int4 projection ``p`` (group-wise ``Q4_0`` levels, :mod:`minigpt.model.quant`) the blocked copy
    :func:`q4_linear` reads: ``words`` ``[out / 16, in / 8, 64]`` uint8 (16 rows x 8 inputs per 64 bytes, see
    ``minigpt/infer/q4_kernel.cpp``) and ``word_scale`` ``[out / 16, groups, 16]`` float16 (the group scales of a
    block's rows side by side). False (``p`` untouched) for other weights, weights off the CPU, output rows not a
    multiple of 16 or groups not a multiple of 8 inputs. The packed matrix is kept (eager prefill reads it): the
    copy doubles the int4 bytes in memory, not those a step reads.

    Why: ATen's int4 kernel (:func:`aten_woq_layout`) converts every weight to float and multiplies bf16
    activations; it read SmolLM-135M's layer matrices at ~9.8 GB/s on a 2-core Xeon (model 207). Multiplying the
    4-bit levels by 8-bit activations in integers, 16 rows per vector (``vpdpbusd``), as llama.cpp's ``Q4_0`` x
    ``Q8_0`` dot products do, needs a fraction of the instructions (docs/benchmarks.md)."""
    if p.scale is None or p.scale.dim() != 2 or p.weight is None or p.weight.device.type != "cpu":
        return False
    out, groups = p.scale.shape
    n_in = 2 * p.weight.shape[1]
    if out % 16 or n_in % groups or (n_in // groups) % 8:
        return False
    lv = _q4_0_levels(p.weight, groups).view(out // 16, 16, n_in // 8, 2, 4)  # [block, row, chunk, half, j]
    p.words = (lv[:, :, :, 0] | (lv[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous().view(out // 16, -1, 64)
    p.word_scale = p.scale.to(torch.float16).view(out // 16, 16, groups).transpose(1, 2).contiguous()
    return True


def q4_linear(p: Proj, x: torch.Tensor) -> torch.Tensor:
    """``p(x)`` through ``minigpt::q4_mm`` for ``p`` in :func:`q4_layout`'s blocks: ``x`` ``[..., in]`` ->
    ``[..., out]`` in ``x``'s dtype, bias applied, any number of rows (each row's result independent of the others).
    The activations are rounded to 8 bits per group of the weight (llama.cpp's ``Q8_0``: ``d = max|x| / 127``);
    the integer sums are exact, the group products accumulated in float32."""
    y = torch.ops.minigpt.q4_mm(x.reshape(-1, x.shape[-1]).float().contiguous(), p.words, p.word_scale)
    if p.bias is not None:
        y = y + p.bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], -1)


@torch.library.register_fake("minigpt::w8a8_mm")
def _w8a8_mm_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])
