"""Output paths: directories checked before a command writes anything and taken back when it fails having made
them; small text files (reports, configs, benchmark results) written whole or not at all.

Shared by :mod:`minigpt.data.prepare`, the evaluators and benchmarks, and the command line (``--out-dir``,
``tokenizer train --out``, ``bench --out/--json``).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional

from minigpt.errors import MiniGPTError


def check_dir_path(path: str | Path, what: str) -> Optional[Path]:
    """Check that the directory ``path`` exists or can be made, before anything is written. Returns the topmost
    directory that making ``path`` would create (None: ``path`` exists), for :func:`remove_created`.

    Raises :class:`MiniGPTError`, its message starting with ``what`` (a flag, "output directory"), when ``path`` or
    a parent is an existing file or a dangling symbolic link."""
    path = Path(path)
    created = None
    for p in (path, *path.parents):
        if p.is_symlink() and not p.exists():
            raise MiniGPTError(f"{what} {path}: {p} is a dangling symbolic link; remove it or choose another path")
        if p.exists():
            if not p.is_dir():
                where = "is" if p == path else f"lies under {p}, which is"
                raise MiniGPTError(f"{what} {path} {where} an existing file, not a directory; choose another path "
                                   "or remove the file")
            return created
        created = p
    return created


def remove_created(path: str | Path, top: Optional[Path]) -> None:
    """Take back the directory ``path`` that a failed command made: its empty sub-directories, itself, then its
    parents up to ``top`` (what :func:`check_dir_path` returned; None: nothing was made, nothing goes). Only empty
    directories are removed (``rmdir``), so a file anyone put there keeps its directory."""
    if top is None:
        return
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        for root, _dirs, _files in os.walk(path, topdown=False):
            try:
                os.rmdir(root)
            except OSError:
                pass
    for d in (path, *path.parents):
        try:
            d.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            return
        if d == top:
            return


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all: into a hidden temporary file beside it, flushed to
    disk, then renamed over ``path`` (``os.replace``, atomic on POSIX). A full disk, a crash or Ctrl-C half way
    leaves the old file as it was, and no temporary file behind. The new file's mode is what a plain ``open``
    would give (0o666 less the umask). Returns ``path``.

    Raises ``OSError`` (errno and path) when the folder cannot be written; ``IsADirectoryError`` when ``path`` is
    a directory."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(21, "is a directory", str(path))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


def check_file_path(path: str | Path, what: str) -> Path:
    """Check, before a long run, that the file ``path`` could be written when it ends: not a directory, not under
    an existing file or a dangling link. Returns ``path``.

    Raises :class:`MiniGPTError`, its message starting with ``what`` (a flag such as ``--json``)."""
    path = Path(path)
    if path.is_dir():
        raise MiniGPTError(f"{what} {path} is a folder; give a file path")
    try:
        check_dir_path(path.parent, "its folder")
    except MiniGPTError as e:
        raise MiniGPTError(f"{what} {path} cannot be written: {e}") from None
    return path


def write_output(path: str | Path, text: str, what: str) -> Path:
    """:func:`write_text_atomic` into ``path``, making its folder first; for a command's output file.

    Raises :class:`MiniGPTError` naming ``what`` (a flag such as ``--out``) and the cause when it cannot be
    written; nothing is left half written."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_text_atomic(path, text)
    except OSError as e:
        raise MiniGPTError(f"cannot write {what} {path}: {e.strerror or e}") from None
