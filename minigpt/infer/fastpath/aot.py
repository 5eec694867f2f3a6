"""The compiled decode step, compiled once per machine and shape and loaded from disk by later runs.

``torch.compile`` re-traces the step in every new process: even with Inductor's on-disk cache warm, Dynamo's trace,
AOTAutograd and the cache lookups cost 5-8 s for the `small` preset, repeated by every ``minigpt generate
--compile``. ``torch.compile(...).aot_compile(example_inputs)`` (torch >= 2.10, experimental; PyTorch's guide
"Ahead-of-Time Compilation with torch.compile") runs the whole pipeline once and returns a function that can be
saved and loaded back; loading it skips tracing and lowering (the C++ kernels it names come from Inductor's cache,
compiled again only when that cache is gone).

The artifact holds code, not weights: the step reads the weights from the :class:`~minigpt.infer.fastpath.FastPath`
passed to it on every call, so one file serves every checkpoint with the same structure. It is keyed by everything
the traced code depends on (:func:`step_key`): torch version, this package's model and fast-path sources, the CPU's
instruction set, the step's shapes (batch, new tokens, cache length), the dtype and shape of every weight tensor,
the compile mode, and the grad / inference mode of the call. The function runs with no guards on its arguments
(they are unserializable or pinned by the key), so the key is what makes a loaded step safe to call.

Where: ``$MINIGPT_COMPILE_CACHE`` (a directory; ``off`` disables the cache), else
``$XDG_CACHE_HOME/minigpt/compiled`` or ``~/.cache/minigpt/compiled``, created private (0700). A file is loaded only
when it is owned by this user and not writable by others -- loading an artifact runs its code, as Inductor's own
cache does. An unreadable or stale file is compiled again and replaced; any failure of the experimental API falls
back to the ordinary ``torch.compile`` with one warning.

With ``aoti`` (``minigpt generate --compile`` on a CPU), :func:`cached_step` first tries the same step as an
AOTInductor package (:mod:`~minigpt.infer.fastpath.aoti`, file ``KEY.pt2`` beside ``KEY.step``): no Python
wrapper per token and no Dynamo or Inductor import to load it; a package that cannot be made falls back to the
saved step here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch._guards import TracingContext, tracing

from minigpt.infer.fastpath.aoti import PREFILL_ROWS_MIN, SUFFIX, PackagedStep, export_package
from minigpt.infer.fastpath.library import OwnInt8
from minigpt.infer.fastpath.step import compile_step, simd_options

# Shared with the torch-free launcher, which must find the same cache and compute the same keys without torch.
# (ENV: the variable's name, for callers.)
from minigpt.infer.launcher import BUNDLES, ENV, cache_dir, mark_used, size_limit  # noqa: F401
from minigpt.infer.launcher import isa as _isa
from minigpt.infer.launcher import source_digest as _source_digest
from minigpt.infer.launcher import trusted as _trusted


def _tensor_signature(t: Any, any_length: bool = False) -> str:
    if t is not None and not isinstance(t, torch.Tensor):  # Proj.w8a8: FBGEMM's packed weight (library.w8a8_layout)
        return repr(t) if isinstance(t, OwnInt8) else "w8a8"  # or the mark of MiniGPT's kernel alone
    if t is None:
        return "-"
    if any_length:  # a cache tensor of a package exported for every cache length: its layout without the length
        return f"{t.dtype}{tuple(t.shape[:2])}T{tuple(t.shape[3:])}{t.is_contiguous()}{t.device.type}{t.layout}"
    # Strides too: a step is compiled for its inputs' memory layout, and a saved one runs without guards (_bound).
    strides = tuple(t.stride()) if t.layout == torch.strided else "opaque"
    return f"{t.dtype}{tuple(t.shape)}{strides}{t.device.type}{t.layout}"


def step_key(fp, batch: int, seq: int, cache_len: Optional[int], args: tuple = (), greedy: bool = False) -> str:
    """The file name (hex sha256) of the step of FastPath ``fp`` for ``[batch, seq]`` new tokens and a cache of
    ``cache_len`` columns (None: any length, the key of an AOTInductor package, exported with the length
    dynamic), under the current grad / inference mode; ``args``: the step's example arguments, whose dtypes and
    strides it also covers (a cache of another dtype, say); ``greedy``: the screened greedy step
    (:func:`~minigpt.infer.fastpath.step.static_greedy_step`)."""
    parts: list[Any] = [torch.__version__, sys.version_info[:2], _source_digest(), _isa(), fp.compile_mode,
                        repr(fp.geometry), batch, seq, cache_len, torch.is_grad_enabled(),
                        torch.is_inference_mode_enabled(), torch.get_num_threads(), simd_options()]
    if greedy:  # appended only then: the keys of existing logits steps stay valid
        parts.append(("greedy", _tensor_signature(fp.screen.proj.words), fp.screen.native))
    projections = [fp.head] + [q for lw in fp.layers for q in (lw.wqkv, lw.wo, lw.w13, lw.w2)]
    parts += [_tensor_signature(t) for t in (fp.embedding, fp.final_norm, fp.cos, fp.sin_signed)]
    parts += [(fp.final_eps,) + tuple((lw.attn_norm_eps, lw.ffn_norm_eps, _tensor_signature(lw.attn_norm))
                                      for lw in fp.layers)]
    parts += ["|".join(_tensor_signature(getattr(p, name)) for name in p.__slots__) for p in projections]
    # A cache is a list of per-layer tensors: its first stands for all (without the length for a package).
    parts += [_tensor_signature(a[0], cache_len is None) if isinstance(a, list) else _tensor_signature(a)
              for a in args]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:40]


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def load_step(path: Path) -> Callable:
    """The saved step at ``path`` (a function of ``(fp, token, input_pos, pad, k_cache, v_cache)``). Raises whatever
    torch raises for an unreadable file."""
    # Unpickling the artifact's guard state installs guards, which needs a tracing context (torch 2.13); they go
    # into this throwaway one. vec_isa_ok: Inductor would otherwise test every SIMD instruction set again by
    # building and dlopen-ing a probe library in subprocesses (~1-2 s); the file's key names this CPU's flags and
    # torch version, and the process that wrote it passed those tests.
    # (torch._inductor is one of torch's lazily imported modules: the attribute loads it here, not at start-up.)
    # The vector width it was compiled for too (simd_options, part of its key): its kernels are built again from
    # their source at load, and kernels of another width than the code that calls them abort the process.
    configs = {"cpp.vec_isa_ok": True, **simd_options()}
    with open(path, "rb") as f, tracing(TracingContext(None)), torch._inductor.config.patch(configs):
        return torch.compiler.load_compiled_function(f)


def cached_step(fp, example_args: tuple, directory: Optional[Path | bool] = None, aoti: bool = False,
                greedy: bool = False) -> tuple[Callable, str]:
    """The compiled step of FastPath ``fp`` for the shapes of ``example_args`` (``token``, ``input_pos``, ``pad``,
    ``k_cache``, ``v_cache``, as :func:`~minigpt.infer.fastpath.step.static_step` takes them), bound to ``fp``,
    and where it came from: ``"loaded"`` (a saved step), ``"saved"`` (compiled ahead of time now and saved),
    ``"jit"`` (the ordinary ``torch.compile``: cache off, or the AOT path failed); with ``aoti``, first an
    AOTInductor package (:mod:`~minigpt.infer.fastpath.aoti`, CPU): ``"aoti-loaded"`` or ``"aoti-saved"``, and
    when packaging fails (one warning) the saved step as above, its float products back in the generated loops
    (``fp.geometry.float_mv`` and ``float_mm`` turned off). Never raises for a bad cache.
    ``directory``: None = :func:`cache_dir`, False = no cache (``"jit"``). ``greedy``: the screened greedy step
    (:func:`~minigpt.infer.fastpath.step.static_greedy_step`) instead of the logits one."""
    directory = cache_dir() if directory is None else (None if directory is False else Path(directory))
    token, _, _, k_cache, _ = example_args
    if directory is None:
        return compile_step(fp, fp.compile_mode, greedy=greedy), "jit"
    if aoti and token.device.type == "cpu":
        package = directory / f"{step_key(fp, token.shape[0], token.shape[1], None, example_args, greedy)}{SUFFIX}"
        packaged = _packaged_step(fp, example_args, directory, package, greedy)
        if packaged is not None:
            return packaged
        if fp.geometry.float_mv or fp.geometry.float_mm:
            # minigpt::float_mv is for packages: a torch.compile step calls it through its Python wrapper, a round
            # trip per projection (fp32 decode 0.92x of the loops, docs/benchmarks.md, session 59). The loops then.
            fp.geometry = dataclasses.replace(fp.geometry, float_mv=False, float_mm=False)
    key = step_key(fp, token.shape[0], token.shape[1], k_cache[0].shape[2], example_args, greedy)
    path = directory / f"{key}.step"
    step = _load_saved(path, lambda p: _bound(load_step(p), fp))
    if step is not None:
        return step, "loaded"
    try:
        compiled = compile_step(fp, fp.compile_mode, serializable=True, greedy=greedy).aot_compile((example_args, {}))
    except Exception as e:  # the API is experimental: fall back to the ordinary compile
        _warn(f"ahead-of-time compilation failed ({type(e).__name__}: {str(e)[:200]}); using torch.compile")
        return compile_step(fp, fp.compile_mode, greedy=greedy), "jit"
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        compiled.save_compiled_function(str(path))  # torch writes it atomically (temporary file + rename)
        _prune_after_save(directory, path)
    except Exception as e:  # a read-only or full disk costs the next run a compile, not this one
        _warn(f"could not save the compiled step to {path} ({type(e).__name__}: {e})")
    return _bound(compiled, fp), "saved"


def _load_saved(path: Path, load: Callable[[Path], Callable]) -> Optional[Callable]:
    """``load(path)`` for a saved step or package; None when there is none, or (after one warning: the caller
    compiles it again and replaces it) when it is not trusted or cannot be loaded."""
    if not path.is_file():
        return None
    try:
        if not _trusted(path):
            raise PermissionError("owned by another user or writable by others")
        loaded = load(path)
        mark_used(path)  # the least recently used steps are the first removed (prune_steps)
        return loaded
    except Exception as e:  # any unreadable artifact
        _warn(f"ignoring the saved compiled step {path} ({type(e).__name__}: {str(e)[:200]}); compiling it again")
        return None


def _packaged_step(fp, example_args: tuple, directory: Path, path: Path, greedy: bool = False
                   ) -> Optional[tuple[Callable, str]]:
    """The AOTInductor step at ``path``, loaded, or compiled and saved there first; None (after one warning) when
    packaging fails. A file that cannot be trusted or loaded is compiled again and replaced. A package ``fp``
    already loaded (for another cache length: one package serves them all) is reused, not loaded again."""
    loaded = getattr(fp, "packages", {})
    if path in loaded:
        return loaded[path], "aoti-loaded"
    step, source = _load_saved(path, lambda p: PackagedStep(p, fp)), "aoti-loaded"
    if step is None:
        # export and AOTInductor are young: on any failure the torch.compile step still works
        if not _save_package(fp, example_args, directory, path, "the compiled step", "using the torch.compile step",
                             greedy=greedy):
            return None
        try:
            step, source = PackagedStep(path, fp), "aoti-saved"
        except Exception as e:
            _warn(f"loading the compiled step's new package failed ({type(e).__name__}: {str(e)[:200]}); "
                  "using the torch.compile step")
            return None
    loaded[path] = step
    return step, source


def _save_package(fp, example_args: tuple, directory: Path, path: Path, what: str, otherwise: str, **kind) -> bool:
    """Export and compile a package of FastPath ``fp`` at ``path`` in the cache ``directory``
    (:func:`~minigpt.infer.fastpath.aoti.export_package`, ``kind``: its ``greedy`` / ``prefill``), then trim the
    cache; False after one warning (``what`` failed; ``otherwise``, what happens instead) when anything fails."""
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        export_package(fp, example_args, path, **kind)
        _prune_after_save(directory, path)
        return True
    except Exception as e:  # any failure of export, Inductor or the C++ build
        _warn(f"packaging {what} with AOTInductor failed ({type(e).__name__}: {str(e)[:200]}); {otherwise}")
        return False


def prefill_package(fp, directory: Optional[Path] = None) -> Optional[Path]:
    """The prefill package of FastPath ``fp``: :class:`~minigpt.infer.fastpath.aoti.StepModule` with ``prefill``
    (the keys and values of a batch-1 prompt, from ``PREFILL_ROWS_MIN`` to ``PREFILL_ROWS_MAX`` tokens a call, any
    cache length; no logits), compiled and saved in ``directory`` (None: :func:`cache_dir`) when it is not there
    already; returns its path, or None when the cache is off or packaging fails (one warning). What the native
    runner feeds a prompt through (:func:`~minigpt.infer.native.write_bundle`): a prompt's rows share one read of
    the weights, where the one-token step reads them once per token.

    Why a second package rather than the step with more rows: a step's products are reductions that read every
    weight once for up to ``DECODE_ROWS_MAX`` rows, while a prompt's go through GEMMs (and its int8 and int4 ones
    through the same kernels as the step's), which Inductor picks by the number of rows when it traces them.
    Costs one more export and C++ build, about the step's (a few minutes at 135M on 2 cores), once per machine
    and model structure, in the ``--compile`` call that writes the bundle."""
    directory = cache_dir() if directory is None else Path(directory)
    if directory is None:
        return None
    rows = 2 * PREFILL_ROWS_MIN  # an example inside the exported range (neither end: export specialises 0 and 1)
    cache = fp.new_kv_cache(1, 2 * rows)
    zero = torch.zeros(1, dtype=torch.long, device=fp.device)
    args = (torch.zeros(1, rows, dtype=torch.long, device=fp.device), zero, zero.clone(), cache.k, cache.v)
    path = directory / f"{step_key(fp, 1, ('prefill', PREFILL_ROWS_MIN), None, args)}{SUFFIX}"
    if path.is_file() and _trusted(path):
        mark_used(path)
        return path
    with torch.inference_mode():  # the bundle goes without it on failure: its prompts are fed a token at a time
        saved = _save_package(fp, args, directory, path, "the prefill step",
                              "the native runner will feed prompts a token at a time", prefill=True)
    return path if saved else None


def _bound(compiled, fp) -> Callable:
    """``compiled`` with ``fp`` as its first argument, without its per-call guard check: binding the call's
    arguments to the signature and running the global-state guards would cost every token tens of microseconds,
    and the file's key already pins the grad / inference mode and the shapes (FastPath keys its steps the same)."""
    compiled.disable_guard_check()
    return partial(compiled, fp)


# Saved steps and packages kept (code only, ~0.6-7 MB each at 135M; every new shape, model structure, torch or
# MiniGPT version writes another): GB (10^9 bytes), unless $MINIGPT_COMPILED_STEPS_GB says otherwise.
STEPS_LIMIT_ENV = "MINIGPT_COMPILED_STEPS_GB"
STEPS_LIMIT_GB = 2.0


def prune_steps(directory: Path, keep: Path, limit: int) -> list[Path]:
    """Remove the least recently used saved steps and step packages (``*.step``, ``*.pt2``) in ``directory`` until
    the others hold at most ``limit`` bytes; returns those removed. "Used" is a file's modification time, which
    every load refreshes (:func:`_load_saved`). ``keep`` (the file just written) stays, and so does every package
    a native bundle names (``native/*/manifest.json``: its runner loads that file). Links and temporary files are
    left alone; a file that vanishes meanwhile is skipped."""
    pinned = {keep.absolute()}
    for manifest in (directory / BUNDLES).glob("*/manifest.json"):
        try:
            named = json.loads(manifest.read_text())
            pinned.update(Path(named[k]).absolute() for k in ("package", "prefill") if named.get(k) is not None)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    files = []
    for f in directory.iterdir():
        if f.suffix not in (".step", SUFFIX) or f.name.startswith(".") or f.is_symlink():
            continue
        try:
            st = f.stat()
        except FileNotFoundError:
            continue
        files.append((st.st_mtime, f, st.st_size))
    total, removed = sum(size for _, _, size in files), []
    for _, f, size in sorted(files):  # the least recently used first
        if total <= limit:
            break
        if f.absolute() in pinned:
            continue
        try:
            f.unlink()
            removed.append(f)
        except FileNotFoundError:  # another process removed it
            pass
        total -= size
    return removed


def _prune_after_save(directory: Path, path: Path) -> None:
    """:func:`prune_steps` after ``path`` was written; a bad limit or an unwritable directory costs one warning."""
    try:
        prune_steps(directory, path, size_limit(STEPS_LIMIT_ENV, STEPS_LIMIT_GB))
    except (OSError, RuntimeError) as e:
        _warn(f"could not trim the saved compiled steps in {directory} ({type(e).__name__}: {e})")
