"""The native launcher: a saved decode-step package run through libtorch from a process that never imports torch.

Why: a one-shot ``minigpt generate --compile`` spends more time starting than decoding. Measured on a 2-core Xeon
(family 6 model 207) at 135M parameters: ``import torch`` alone is 1.3-1.8 s, llama.cpp's whole call for 128
int4 tokens 1.4-1.8 s (docs/benchmarks.md). Loading ``libtorch_cpu.so`` itself takes 0.25-0.3 s; the rest of
``import torch`` is torch's Python modules, which the compiled step does not need: an AOTInductor package
(:mod:`minigpt.infer.fastpath.aoti`) is one C++ function over tensors.

How: a ``--compile`` run that loaded a step package also writes a *bundle* (:mod:`minigpt.infer.native`):
every tensor the package reads, in one file memory-mapped by the runner (``tensors.bin`` + ``tensors.txt``), and
``manifest.json`` (the package, the runner library, the prompt's BOS rule, the stop ids). Its directory is named
by :func:`launch_key`, computed here without torch from the model directory's files (path, sizes, modification
times), the dtype, quantization and threads asked for, the torch version, MiniGPT's sources and the CPU. A later
call with the same key tokenizes with ``tokenizers``, loads the runner (``native_runner.cpp``, built once per
machine and torch version) with :mod:`ctypes` and runs greedy decoding there (:class:`NativeRunner`): all but the
prompt's last token through the bundle's prefill package (the same step over many tokens, without logits), the
rest through the one-token step. Only this module, the tokenizer and the stop-string logic are imported.

Trust: the runner and the package are code, loaded only when owned by this user and writable by no one else
(:func:`trusted`), as the compile cache's other files.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import os
import platform
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional, Sequence

ENV = "MINIGPT_COMPILE_CACHE"
FORMAT = 2  # of bundles and of launch_key: bump when either changes (2: the prefill package)
_PACKAGE = Path(__file__).resolve().parents[1]  # minigpt/
# The runner library's sources, compiled into one library: the runner, and the kernels it and Python processes
# register for the `minigpt::q4_mm`, `minigpt::w8a8_mm`, `minigpt::woq8_mm`, `minigpt::float_mv` and
# `minigpt::causal_attention` ops.
RUNNER_SOURCES = tuple(_PACKAGE / "infer" / name
                       for name in ("native_runner.cpp", "w8a8_op.cpp", "q4_kernel.cpp", "w8a8_kernel.cpp",
                                    "woq8_kernel.cpp", "float_kernel.cpp", "attention_kernel.cpp"))
RUNNER_HEADERS = tuple(_PACKAGE / "infer" / name for name in ("runner_ops.h", "w8a8_op.h"))  # included by them
# Their compiler flags (with the include paths and the ABI macro, minigpt.infer.fastpath.library.build_runner).
# -fopenmp: ATen's parallel_for, which the int4 kernel's threads come from, is OpenMP inlined from the headers and
# serial without it; the library then needs libgomp.so.1, which torch ships and has loaded already.
# -O3, not -O2: at -O2 GCC left the kernels' loops over activation rows and accumulator chains (fixed small trip
# counts) rolled, with the int32/float32 accumulators in stack slots loaded and stored around every vpdpbusd/FMA;
# -O3 unrolls them into registers (the same instructions in the same order: the same bits). The int4 x int8 kernel
# (q4_kernel.cpp) on SmolLM-135M's 120 layer matrices, 2-core Zen 4 EPYC: 16 rows 23-24 -> 12-16 ms, 64 rows 87-98
# -> 43-60 ms; bf16 decode (float_kernel.cpp, bound by memory) unchanged (docs/benchmarks.md, session 66).
RUNNER_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-w", "-fopenmp")
ERROR_BYTES = 2048
# Cache lengths of the compiled step are rounded up to a multiple of this, so that generations of nearby lengths
# share one compiled graph (a `torch.compile` step is compiled per [batch, cache length]); the native runner's
# caches are sized the same way, so that it computes what FastPath's compiled step computes, to the bit.
CACHE_BUCKET = 64
# The environment switches read while a step package is built, which change what it computes or calls: the int8 /
# int4 kernel choice, the greedy head screen, the float products through minigpt::float_mv, Inductor's vector
# width, and the C++ kernels' instruction-set caps (the runner reads those again when it runs, but whether a kernel
# is called at all was decided from them when the package was built). A bundle runs one such package, so they are
# part of its key: else a later call with another setting would rerun the old package.
STEP_SWITCHES = ("MINIGPT_WOQ_KERNEL", "MINIGPT_HEAD_SCREEN", "MINIGPT_FLOAT_MV", "MINIGPT_STEP_SIMDLEN",
                 "MINIGPT_FLOAT_MV_ISA", "MINIGPT_WOQ8_ISA", "MINIGPT_Q4_ISA", "MINIGPT_W8A8_ISA",
                 "MINIGPT_W8A8_KERNEL")


class NativeError(RuntimeError):
    """The native runner could not load or run a bundle (the message says why)."""


def cache_dir() -> Optional[Path]:
    """The directory of saved steps, or None when ``$MINIGPT_COMPILE_CACHE`` is ``off`` (or ``0`` / ``none``):
    ``$MINIGPT_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/minigpt/compiled`` or ``~/.cache/minigpt/compiled``."""
    value = os.environ.get(ENV)
    if value is not None and value.strip().lower() in ("", "0", "off", "none", "false"):
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "minigpt" / "compiled"


BUNDLES = "native"  # the compile cache's subdirectory of native bundles, one directory per launch key


def bundle_dir(key: str, directory: Optional[Path] = None) -> Optional[Path]:
    """The directory of bundle ``key`` (its ``manifest.json``, ``tensors.bin``, ...) under the compile cache
    ``directory`` (None: :func:`cache_dir`), whether or not it exists; None when the cache is off."""
    directory = cache_dir() if directory is None else directory
    return None if directory is None else directory / BUNDLES / key


@lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of the sources the compiled step traces: minigpt/model and minigpt/infer/fastpath (``*.py``)."""
    h = hashlib.sha256()
    for folder in ("model", "infer/fastpath"):
        for path in sorted((_PACKAGE / folder).glob("*.py")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


@lru_cache(maxsize=1)
def isa() -> str:
    """The CPU's model and flags (Linux ``/proc/cpuinfo``), else the platform, and the instruction-set caps
    ``$ATEN_CPU_CAPABILITY`` and ``$ONEDNN_MAX_CPU_ISA``: Inductor's C++ is built for them."""
    caps = " | ".join(os.environ.get(k, "") for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"))
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        picked = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(("flags", "model name"))][:2]
        return " | ".join([*picked, caps])
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def trusted(path: Path) -> bool:
    """Owned by this user and writable by nobody else (POSIX; elsewhere the directory's permissions decide)."""
    if not hasattr(os, "getuid"):
        return True
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


@lru_cache(maxsize=1)
def torch_version() -> str:
    """The installed torch's version (``"2.13.0+cpu"``), "none" without torch, read without importing torch: the
    ``__version__`` line of ``torch/version.py``, found by :func:`importlib.util.find_spec` (which imports
    nothing).

    Why not the package metadata: ``import importlib.metadata`` alone is 23-30 ms on a 2-core Zen 4 EPYC; the native
    path's imports and key start ~20 ms sooner without it (paired, 2 x 41 processes), ~1.3 % of a one-shot
    128-token bf16 ``generate --compile`` call there (docs/benchmarks.md)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return "none"
    try:
        found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]",
                          Path(spec.origin).with_name("version.py").read_text(), re.M)
    except OSError:
        found = None
    return found.group(1) if found else "none"


def runner_digest() -> str:
    """sha256 of the runner's C++ sources and headers, torch's version and the Python ABI: the runner library's file
    name."""
    h = hashlib.sha256()
    for source in (*RUNNER_SOURCES, *RUNNER_HEADERS):
        h.update(source.read_bytes())
    h.update(repr((FORMAT, RUNNER_FLAGS, torch_version(), sys.version_info[:2], platform.machine())).encode())
    return h.hexdigest()[:40]


def install_w8a8_kernel(library: Path) -> None:
    """Make the runner library's C++ function the CPU kernel of ``minigpt::w8a8_mm`` (FBGEMM's int8 x int8
    product, :mod:`minigpt.infer.fastpath.library`) in this Python process, with its ``w8a8_adopt`` /
    ``w8a8_forget`` ops for the packed copies. Raises :class:`NativeError` when the library cannot be loaded or
    the op already has another CPU kernel here."""
    _install(library, "mg_w8a8_install")


def install_q4_kernel(library: Path) -> None:
    """Make the runner library's C++ function (``q4_kernel.cpp``) the CPU kernel of ``minigpt::q4_mm`` (int4 x
    int8 products, :mod:`minigpt.infer.fastpath.library`) in this Python process, with the ``minigpt::q4_isa`` op
    naming the instruction set it runs. Raises :class:`NativeError` when the library cannot be loaded or the op
    already has another CPU kernel here."""
    _install(library, "mg_q4_install")


def install_woq8_kernel(library: Path) -> None:
    """Make the runner library's C++ function (``woq8_kernel.cpp``) the CPU kernel of ``minigpt::woq8_mm`` (float32
    activations x int8 weights: the head screen, :mod:`minigpt.infer.fastpath.screen`) in this Python process, with
    the ``minigpt::woq8_isa`` op naming the instruction set it runs. Raises :class:`NativeError` when the library
    cannot be loaded or the op already has another CPU kernel here."""
    _install(library, "mg_woq8_install")


def install_float_kernel(library: Path) -> None:
    """Make the runner library's C++ function (``float_kernel.cpp``) the CPU kernel of ``minigpt::float_mv``
    (float32 activations x float32 or bfloat16 weights, decode steps' rows: :mod:`minigpt.infer.fastpath.float_mv`)
    in this Python process, with the ``minigpt::float_mv_isa`` op naming the instruction set it runs. Raises
    :class:`NativeError` when the library cannot be loaded or the op already has another CPU kernel here."""
    _install(library, "mg_float_install")


def install_attention_kernel(library: Path) -> None:
    """Make the runner library's C++ function (``attention_kernel.cpp``) the CPU kernel of
    ``minigpt::causal_attention`` (float32 causal prefill attention: :mod:`minigpt.infer.fastpath.prefill_attention`)
    in this Python process, with the ``minigpt::attention_isa`` op naming the instruction set it runs. Raises
    :class:`NativeError` when the library cannot be loaded or the op already has another CPU kernel here."""
    _install(library, "mg_attention_install")


def _install(library: Path, symbol: str) -> None:
    """Call the runner library's ``int symbol(char *err, int errlen)`` (0, or -1 with the reason in ``err``)."""
    install = getattr(_library(library), symbol)
    install.restype = ctypes.c_int
    install.argtypes = [ctypes.c_char_p, ctypes.c_int]
    err = ctypes.create_string_buffer(ERROR_BYTES)
    if install(err, ERROR_BYTES) != 0:
        raise NativeError(err.value.decode(errors="replace"))


_LOADED: dict[str, ctypes.CDLL] = {}


def _library(library: Path) -> ctypes.CDLL:
    """The runner library, loaded once per process by file name (its source and torch digest): two caches' copies
    of one build would otherwise be two libraries, each with its own table of packed matrices, and only the first
    one's kernel registered for the op."""
    name = Path(library).name
    if name not in _LOADED:
        try:
            _LOADED[name] = ctypes.CDLL(str(library))
        except OSError as e:
            raise NativeError(f"cannot load the native runner {library}: {e}") from None
    return _LOADED[name]


def launch_key(source: Path, dtype: str, quantize: Optional[str], threads: Optional[int]) -> Optional[str]:
    """The bundle name (hex) of ``minigpt generate SOURCE --compile --dtype DTYPE [--quantize Q] [--threads N]``:
    the model directory (resolved path; name, size and modification time of each file in it), the options, the
    torch version, MiniGPT's sources, the CPU and the :data:`STEP_SWITCHES` set in the environment. None when
    ``source`` is not a model directory (``config.json``). A rewritten checkpoint or another torch, source tree,
    CPU or switch gives another key, hence no stale bundle."""
    source = Path(source)
    if not (source / "config.json").is_file():
        return None
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in source.iterdir() if p.is_file())
    parts = [FORMAT, str(source.resolve()), files, dtype, quantize, threads, torch_version(), sys.version_info[:2],
             source_digest(), runner_digest(), isa()]
    # Appended only when one is set: the keys of existing bundles stay valid.
    switches = [(name, os.environ[name]) for name in STEP_SWITCHES if os.environ.get(name)]
    if switches:
        parts.append(switches)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:40]


def size_limit(env: str, default_gb: float) -> int:
    """Bytes: ``$env`` GB (10^9 bytes; a number >= 0; unset or empty: ``default_gb``). Raises ``RuntimeError`` naming
    the variable when it is not such a number."""
    value = os.environ.get(env, "").strip()
    if not value:
        return int(default_gb * 1e9)
    try:
        gb = float(value)
    except ValueError:
        gb = float("nan")
    if not (gb >= 0 and gb != float("inf")):
        raise RuntimeError(f"${env}={value!r} is not a size in GB: give a number >= 0, e.g. {default_gb:g}")
    return int(gb * 1e9)


def mark_used(path: Path) -> None:
    """Mark a file of the compile cache (a bundle's ``manifest.json``, a saved step or package) used now: its
    modification time, which the least-recently-used trimming reads; a read-only cache is left as it is."""
    try:
        os.utime(path)
    except OSError:
        pass


def read_manifest(key: str) -> Optional[dict]:
    """The manifest of bundle ``key`` in the compile cache, or None when there is none or it cannot be used (not
    trusted, unreadable, or naming files that are gone); its modification time is set to now (the bundle's last
    use, which :func:`minigpt.infer.native.prune_bundles` orders by)."""
    bundle = bundle_dir(key)
    if bundle is None:
        return None
    path = bundle / "manifest.json"
    try:
        if not path.is_file() or not trusted(path):
            return None
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT:
            return None
        named = [manifest["runner"], manifest["package"]]
        if manifest["prefill"] is not None:  # None: a bundle without one, whose prompts go a token at a time
            named.append(manifest["prefill"])
        if not all(Path(p).is_file() and trusted(Path(p)) for p in named):
            return None
        manifest["bundle"] = str(path.parent)
        mark_used(path)  # the least recently used bundles are the first removed (native.prune_bundles)
        return manifest
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cache_length(tokens: int, positions: int) -> int:
    """FastPath's compiled cache length for ``tokens`` (prompt + new): rounded up to :data:`CACHE_BUCKET`, at most
    ``positions`` (the model's context)."""
    return min(positions, -(-tokens // CACHE_BUCKET) * CACHE_BUCKET)


_ON_TOKEN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64)


class NativeRunner:
    """The runner library (``native_runner.cpp``) with one bundle loaded: ``package`` (an AOTInductor step of batch
    1, one new token), ``bundle`` (its tensors), ``threads`` (0: libtorch's default); ``prefill``: the bundle's
    prefill package (:func:`~minigpt.infer.fastpath.aot.prefill_package`, prompt rows from ``prefill_rows[0]``
    to ``prefill_rows[1]`` a call), or None to feed prompts a token at a time through the step. Raises
    :class:`NativeError` when the library or the bundle cannot be loaded (a missing tensor, a truncated file, a
    package of another structure)."""

    def __init__(self, library: Path, package: Path, bundle: Path, threads: int = 0, prefill: Optional[Path] = None,
                 prefill_rows: Sequence[int] = (1, 1)) -> None:
        lib = _library(library)
        lib.mg_open.restype = ctypes.c_void_p
        lib.mg_open.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                                ctypes.c_int]
        lib.mg_generate.restype = ctypes.c_long
        lib.mg_generate.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_long, ctypes.c_long,
                                    ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.POINTER(ctypes.c_int64),
                                    ctypes.c_long, _ON_TOKEN, ctypes.POINTER(ctypes.c_long), ctypes.c_char_p,
                                    ctypes.c_int]
        lib.mg_close.argtypes = [ctypes.c_void_p]
        self._lib = lib
        self.prefill_rows = (int(prefill_rows[0]), int(prefill_rows[1]))
        self.prefilled = 0  # the last generate's prompt tokens that went through the prefill package
        err = ctypes.create_string_buffer(ERROR_BYTES)
        self._handle = lib.mg_open(str(package).encode(), b"" if prefill is None else str(prefill).encode(),
                                   str(bundle).encode(), threads, err, ERROR_BYTES)
        if not self._handle:
            raise NativeError(f"cannot load the native bundle {bundle}: {err.value.decode(errors='replace')}")

    def generate(self, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (),
                 on_token: Optional[Callable[[int], bool]] = None, cache_len: Optional[int] = None) -> list[int]:
        """Greedy tokens after ``prompt`` (all but its last token through the prefill package when there is one,
        in calls of at most ``prefill_rows[1]`` tokens; the rest a token at a time through the step): at most
        ``max_new_tokens``,
        ending at the first of ``stop_ids`` (included) or when ``on_token(token)`` (called for each) returns True;
        an exception it raises ends the generation and is raised from here.
        ``cache_len``: the KV cache's columns (:func:`cache_length`; None: exactly prompt + new tokens). Raises
        :class:`NativeError` for an empty prompt, a cache too short, or a failure inside the runner."""
        cache_len = len(prompt) + max_new_tokens if cache_len is None else cache_len
        if not prompt or max_new_tokens < 1 or cache_len < len(prompt) + max_new_tokens - 1:
            raise NativeError("the native runner needs a prompt of at least one token, one new token, and a cache "
                              "that holds them")
        tokens: list[int] = []
        raised: list[BaseException] = []

        def callback(token: int) -> int:
            # ctypes would print an exception raised here and go on; it stops the generation and is raised below.
            tokens.append(token)
            try:
                return 1 if on_token is not None and on_token(token) else 0
            except BaseException as e:  # noqa: BLE001 -- re-raised after the runner returns
                raised.append(e)
                return 1

        keep = _ON_TOKEN(callback)  # referenced until the call returns
        ids = (ctypes.c_int64 * len(prompt))(*prompt)
        stops = (ctypes.c_int64 * max(1, len(stop_ids)))(*stop_ids)
        err = ctypes.create_string_buffer(ERROR_BYTES)
        prefilled = ctypes.c_long(0)
        n = self._lib.mg_generate(self._handle, ids, len(prompt), max_new_tokens, cache_len, *self.prefill_rows,
                                  stops, len(stop_ids), keep, ctypes.byref(prefilled), err, ERROR_BYTES)
        self.prefilled = prefilled.value
        if raised:
            raise raised[0]
        if n < 0:
            raise NativeError(f"the native runner failed: {err.value.decode(errors='replace')}")
        return tokens

    def close(self) -> None:
        """Free the bundle's mapping and the package (the object is unusable afterwards)."""
        if self._handle:
            self._lib.mg_close(self._handle)
            self._handle = None

    def __enter__(self) -> "NativeRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
