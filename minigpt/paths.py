"""Output directories: checked before a command writes anything, and taken back when it fails having made them.

Shared by :mod:`minigpt.data.prepare` and the command line (``--out-dir``, ``tokenizer train --out``).
"""
from __future__ import annotations

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
