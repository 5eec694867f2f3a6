"""Atomic directories on disk: written under a temporary name, fsynced, given a SHA-256 manifest, then renamed, so
a crash leaves either the old directory or the new one, never half of one. Every write of a model or training
checkpoint goes through here."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from minigpt.errors import MiniGPTError

FORMAT = "minigpt"
MANIFEST = "manifest.json"


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def begin_atomic_dir(final: str | Path) -> Path:
    """Create and return an empty temporary sibling of ``final`` to write a directory into."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit_atomic_dir(tmp: Path, final: str | Path) -> Path:
    """Write ``tmp``'s SHA-256 manifest (every file, subdirectories included), fsync everything, rename to
    ``final``. An existing ``final`` is replaced only once the new directory is complete."""
    final = Path(final)
    files = sorted(p for p in tmp.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {str(p.relative_to(tmp)): {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for p in [*files, tmp / MANIFEST]:
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        _fsync_dir(d)
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)
    return final


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temporary directory; on success it becomes ``final`` (see :func:`commit_atomic_dir`). On an
    exception the temporary directory is removed and ``final`` is untouched."""
    tmp = begin_atomic_dir(final)
    try:
        yield tmp
        commit_atomic_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def verify_manifest(path: str | Path) -> None:
    """Check every file listed in ``path/manifest.json`` against its size and SHA-256.

    Raises :class:`MiniGPTError` naming the first missing, truncated or corrupt file. A directory without a
    manifest (e.g. a Hugging Face download) passes.
    """
    path = Path(path)
    mf = path / MANIFEST
    if not mf.is_file():
        return
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise MiniGPTError(f"{mf} is corrupt ({e})") from None
    for name, info in manifest.items():
        p = path / name
        if not p.is_file():
            raise MiniGPTError(f"checkpoint {path} is missing {name}")
        if p.stat().st_size != info["bytes"] or sha256_file(p) != info["sha256"]:
            raise MiniGPTError(f"checkpoint {path} is corrupt: {name} does not match its SHA-256 in {MANIFEST}")
