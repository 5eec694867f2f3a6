"""The torch side of the native launcher (:mod:`minigpt.infer.launcher`): building the runner library and writing
the bundle a later, torch-free ``minigpt generate --compile`` runs.

A bundle is written by a ``--compile`` run that loaded (or saved) an AOTInductor step package of batch 1 and one
new token, once per :func:`~minigpt.infer.launcher.launch_key`, with a second package that prefills a prompt
(:func:`~minigpt.infer.fastpath.aot.prefill_package`, compiled then if missing): the tensors of
:func:`~minigpt.infer.fastpath.aoti.step_tensors` (the fused weights, RoPE tables, int4 levels in ATen's layout:
what the package reads, in the layout it was compiled for), each written once even when several names share it
(a tied head), 64-byte aligned, and a manifest; for a step whose int8 products go through FBGEMM (the
``minigpt::w8a8_mm`` op), the list of those matrices, which the runner packs for FBGEMM when it opens the bundle
(~0.1 s at 135M int4, whose LM head is int8; ~0.4 s for every matrix of an int8 model, on 2 cores).

Each bundle is a second copy of its model's step tensors (542 MB for a 135M model in fp32), so the bundles are
kept to ``$MINIGPT_NATIVE_CACHE_GB`` (default 8) together: writing one removes the least recently used others
beyond it (:func:`prune_bundles`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from minigpt.infer.fastpath.aot import prefill_package
from minigpt.infer.fastpath.aoti import (
    PARTIAL_MAX_AGE_S,
    PREFILL_ROWS_MAX,
    PREFILL_ROWS_MIN,
    step_projections,
    step_tensors,
)
from minigpt.infer.fastpath.library import build_runner
from minigpt.infer.launcher import FORMAT, bundle_dir, cache_dir, launch_key, mark_used, size_limit

LIMIT_ENV = "MINIGPT_NATIVE_CACHE_GB"
LIMIT_GB = 8.0  # the default: GB (10^9 bytes) of bundles kept

ALIGN = 64  # bytes: tensors.bin offsets (cache lines; AOTInductor's own constants are aligned so)
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.int8: "int8",
           torch.uint8: "uint8", torch.int32: "int32", torch.int64: "int64"}


def write_bundle(fp, source: Path, dtype: str, quantize: Optional[str], threads: Optional[int], bos: bool,
                 stop_ids: Sequence[int], announce: Optional[Callable[[], None]] = None) -> Optional[Path]:
    """Write the native bundle of FastPath ``fp`` (loaded from the model directory ``source`` with these ``dtype``,
    ``quantize`` and ``threads`` options, whose compiled one-token step is an AOTInductor package) unless it
    exists; returns its directory, or None when the launcher cannot run this model (no package loaded, a tensor
    not contiguous, no cache directory, not a model directory).

    ``bos``: whether a plain prompt starts with BOS for this model; ``stop_ids``: the ids that end a generation;
    ``announce``: called once before a new bundle's slow part (the runner's build, the prefill package's compile).
    Raises ``OSError`` / ``RuntimeError`` when writing or building fails or ``$MINIGPT_NATIVE_CACHE_GB`` is not a
    size (the caller warns and goes on). A new bundle is followed by :func:`prune_bundles`."""
    limit = bundle_limit()
    key = launch_key(source, dtype, quantize, threads)
    directory = cache_dir()
    packages = [p for p in getattr(fp, "packages", {})]
    if key is None or directory is None or len(packages) != 1:
        return None
    bundle = bundle_dir(key, directory)
    if (bundle / "manifest.json").is_file():
        mark_used(bundle / "manifest.json")
        prefill = json.loads((bundle / "manifest.json").read_text()).get("prefill")
        if prefill is not None and not Path(prefill).is_file():  # pruned or deleted: read_manifest refuses the
            prefill_package(fp, directory)  # bundle until it is back (the same key: the same path)
        return bundle
    named = step_tensors(fp)
    if not all(t.is_contiguous() and t.device.type == "cpu" and t.dtype in _DTYPES for t in named.values()):
        return None
    # The int8 matrices the runner packs for FBGEMM, each by its weight and scale: checked before the runner's
    # build and the prefill package's compile (minutes), which a bundle refused here would not use.
    pairs = [(f"{k}_weight", f"{k}_scale") for k, p in step_projections(fp).items() if p.w8a8 is not None]
    if any(w not in named or s not in named for w, s in pairs):
        return None
    if announce is not None:
        announce()
    runner = build_runner(directory)
    prefill = prefill_package(fp, directory)  # None: the runner feeds prompts a token at a time
    bundle.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    work = Path(tempfile.mkdtemp(prefix=".partial-", dir=bundle.parent))
    try:
        lines, offsets, end = [], {}, 0
        with open(work / "tensors.bin", "wb") as f:
            for name, t in named.items():
                at = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
                if at not in offsets:  # a tensor under two names (the tied head and embedding) is written once
                    end = -(-end // ALIGN) * ALIGN
                    f.seek(end)
                    data = t.detach().reshape(-1).view(torch.uint8).numpy()
                    f.write(memoryview(data))
                    offsets[at] = end
                    end += data.nbytes
                lines.append(" ".join(map(str, [name, _DTYPES[t.dtype], offsets[at], t.dim(), *t.shape, *t.stride()])))
        (work / "w8a8.txt").write_text("".join(f"{w} {s}\n" for w, s in pairs))
        c = fp.config
        (work / "tensors.txt").write_text(f"minigpt-native 1 {c.n_layers} {c.n_kv_heads} {c.head_dim}\n"
                                          + "\n".join(lines) + "\n")
        manifest = {"format": FORMAT, "package": str(packages[0]), "runner": str(runner), "source": str(source),
                    "prefill": None if prefill is None else str(prefill),
                    "prefill_rows": [PREFILL_ROWS_MIN, PREFILL_ROWS_MAX],
                    "bos": bool(bos), "stop_ids": [int(i) for i in stop_ids], "vocab_size": c.vocab_size,
                    "positions": min(c.max_seq_len, int(fp.cos.shape[0]))}
        (work / "manifest.json").write_text(json.dumps(manifest, indent=1))
        os.chmod(work, 0o700)
        try:
            os.rename(work, bundle)  # atomic: a bundle directory is complete or absent
        except OSError:
            if not (bundle / "manifest.json").is_file():  # not another process's bundle of the same key
                raise
    finally:
        if work.exists():
            for p in work.iterdir():
                p.unlink()
            work.rmdir()
    prune_bundles(bundle.parent, bundle, limit)
    return bundle


def bundle_limit() -> int:
    """The bytes of bundles to keep: ``$MINIGPT_NATIVE_CACHE_GB`` GB (a number >= 0; unset or empty:
    :data:`LIMIT_GB`). Raises ``RuntimeError`` naming the variable when it is not such a number."""
    return size_limit(LIMIT_ENV, LIMIT_GB)


def prune_bundles(directory: Path, keep: Path, limit: int) -> list[Path]:
    """Remove the least recently used bundles in ``directory`` (the compile cache's ``native/``) until the others
    hold at most ``limit`` bytes, and temporary directories of killed writes (older than a day); returns what was
    removed. "Used" is the modification time of a bundle's ``manifest.json``, which every use refreshes
    (:func:`~minigpt.infer.launcher.read_manifest`, :func:`write_bundle`). ``keep`` (the bundle just written) is
    never removed: one larger than ``limit`` stays, alone. Each directory is renamed before it is deleted, so that
    a reader finds a whole bundle or none (one that loses the race gets :class:`~minigpt.infer.launcher.NativeError`
    from the runner and runs the ordinary command). Links are left alone; a directory that vanishes meanwhile is
    skipped."""
    bundles, removed, now = [], [], time.time()
    for entry in directory.iterdir():
        try:
            if entry.is_symlink() or not entry.is_dir():
                continue
            if entry.name.startswith(".partial-"):
                if now - entry.stat().st_mtime > PARTIAL_MAX_AGE_S and _remove(entry):
                    removed.append(entry)
                continue
            manifest = entry / "manifest.json"
            used = (manifest if manifest.is_file() else entry).stat().st_mtime
            size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file() and not f.is_symlink())
        except FileNotFoundError:
            continue
        bundles.append((used, entry, size))
    total = sum(size for _, _, size in bundles)
    for _, entry, size in sorted(bundles, key=lambda b: b[0]):  # the least recently used first
        if total <= limit:
            break
        if entry != keep and _remove(entry):
            total -= size
            removed.append(entry)
    return removed


def _remove(entry: Path) -> bool:
    """Rename ``entry`` to a temporary name, then delete it; False when another process got there first."""
    doomed = entry.with_name(f".partial-removed-{entry.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(entry, doomed)
    except OSError:
        return False
    shutil.rmtree(doomed, ignore_errors=True)
    return True
