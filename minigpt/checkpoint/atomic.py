"""Atomic directories on disk: written under a temporary name, fsynced, given a SHA-256 manifest, then renamed, so
a crash leaves either the old directory or the new one, never half of one. Every write of a model or training
checkpoint goes through here."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Iterable, Iterator, Optional

from safetensors import SafetensorError
from safetensors.torch import save_file

from minigpt.errors import MiniGPTError, json_loads, os_error_from

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


def _refuse_non_dir(final: Path) -> None:
    """Raise :class:`MiniGPTError` when ``final`` exists (or is a link, even a broken one) and is not a directory:
    the atomic write would otherwise rename it aside and delete it."""
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        kind = "a symbolic link" if final.is_symlink() else "an existing file, not a directory"
        raise MiniGPTError(f"{final} is {kind}; nothing was written: remove it or choose another path")


def save_tensors(tensors: dict, path: str | Path, metadata: Optional[dict] = None) -> None:
    """``safetensors.torch.save_file(tensors, path, metadata)``, whose failure to write (a full disk, a read-only
    file system) is raised as the ``OSError`` it is (errno and ``path``) instead of safetensors' own exception type,
    so that the command line reports it in one line. Other safetensors errors are raised unchanged."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        raise (os_error_from(e, path) or e) from None


def begin_atomic_dir(final: str | Path) -> Path:
    """Create and return an empty temporary sibling of ``final`` to write a directory into.

    Raises :class:`MiniGPTError`, before creating anything, when ``final`` exists and is not a directory."""
    final = Path(final)
    _refuse_non_dir(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit_atomic_dir(tmp: Path, final: str | Path) -> Path:
    """Write ``tmp``'s SHA-256 manifest (every file, subdirectories included), fsync everything, rename to
    ``final``. An existing ``final`` is replaced only once the new directory is complete.

    Raises :class:`MiniGPTError`, before writing or renaming anything, when ``final`` exists and is not a directory
    (a file or a symbolic link)."""
    final = Path(final)
    _refuse_non_dir(final)
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


def _unlisted(directory: Path) -> Optional[str]:
    """The first file (relative name) under ``directory`` that its ``manifest.json`` does not list; ``manifest.json``
    itself when it is missing or unreadable; None when the directory holds only what :func:`commit_atomic_dir`
    wrote there."""
    try:
        listed = json_loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return MANIFEST
    if not isinstance(listed, dict):
        return MANIFEST
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if not p.is_dir())
    return next((name for name in files if name != MANIFEST and name not in listed), None)


def _check_apart(out: Path, sources: Iterable[Optional[str | Path]], inside_ok: bool = False) -> None:
    """Raise :class:`MiniGPTError` when ``out`` is, contains or (unless ``inside_ok``) lies inside one of
    ``sources`` (None entries skipped), symbolic links and ``..`` resolved."""
    target = out.resolve()
    for source in sources:
        if source is None:
            continue
        src = Path(source).resolve()
        if target == src:
            raise MiniGPTError(f"output {out} is the source {source}; writing it would replace the source: choose "
                               "another output path")
        if target in src.parents:
            raise MiniGPTError(f"output {out} contains the source {source}; writing it would delete the source: "
                               "choose an output path outside it")
        if not inside_ok and src in target.parents:
            raise MiniGPTError(f"output {out} is inside the source {source}; writing it would change the source: "
                               "choose an output path outside it")


def check_output_dir(out: str | Path, sources: Iterable[Optional[str | Path]]) -> Path:
    """Check, before anything is loaded or written, that the model directory ``out`` may be (re)placed by an atomic
    write (:func:`atomic_dir`) of a model read from ``sources`` (the paths as given and as resolved; None skipped).
    Returns ``out`` as a :class:`Path`.

    Raises :class:`MiniGPTError` naming ``out`` when it is one of the sources, lies inside one or contains one
    (symbolic links and ``..`` resolved); when it is an existing file or a symbolic link; or when it is a non-empty
    directory holding a file its ``manifest.json`` does not list (a directory of the user's own files, or one that
    :func:`commit_atomic_dir` did not write): the write would delete it. A missing or empty directory, or an earlier
    output of this project (re-running a conversion to the same path), may be replaced.
    """
    out = Path(out)
    _check_apart(out, sources)
    if out.is_symlink():
        raise MiniGPTError(f"output {out} is a symbolic link; it would be replaced by a directory: give the "
                           "directory it points to, or another path")
    if out.exists() and not out.is_dir():
        raise MiniGPTError(f"output {out} is an existing file, not a directory; it would be replaced: choose "
                           "another output directory or remove the file")
    if out.is_dir() and any(out.iterdir()) and (name := _unlisted(out)) is not None:
        why = "has no manifest.json" if name == MANIFEST else f"holds {name}, which its manifest.json does not list"
        raise MiniGPTError(f"output {out} is a non-empty directory that minigpt did not write ({why}); it would be "
                           "replaced and its files deleted: choose a new or empty directory, or remove it")
    return out


def check_output_file(path: str | Path, sources: Iterable[Optional[str | Path]]) -> Path:
    """Check, before anything is loaded or written, that the single file ``path`` (e.g. a ``.gguf``) may be
    written from ``sources``. An existing regular file is overwritten, as llama.cpp's converter does, and a new file
    may go inside a source directory (llama.cpp's default place for it). Returns ``path`` as a :class:`Path`.

    Raises :class:`MiniGPTError` naming ``path`` when it is one of the sources or contains one (symbolic links and
    ``..`` resolved), is a directory, or lies under an existing file.
    """
    path = Path(path)
    _check_apart(path, sources, inside_ok=True)
    if path.is_dir():
        raise MiniGPTError(f"output {path} is a directory; choose a file path (ending in .gguf) or remove it")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise MiniGPTError(f"output {path} lies under {parent}, an existing file, not a directory: choose another "
                           "output path")
    return path


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

    A file that matched once is not hashed again while its stat signature (device, inode, size, modification and
    change times in ns) is the one recorded then (:func:`verified_stamps`; git's index trusts the same fields):
    hashing runs at ~2 GB/s, 0.28 of a 0.59 s load for 135M fp32 weights, seconds for billions of parameters.
    Any write to the file, or a ``touch`` restoring its old modification time, changes the change time and brings
    the hash back. Raises :class:`MiniGPTError` naming the first missing, truncated or corrupt file. A directory
    without a manifest (e.g. a Hugging Face download) passes.
    """
    path = Path(path)
    mf = path / MANIFEST
    if not mf.is_file():
        return
    try:
        manifest = json_loads(mf.read_text())
    except ValueError as e:
        raise MiniGPTError(f"{mf} is corrupt ({e})") from None
    if not isinstance(manifest, dict) or not all(_entry_ok(name, info) for name, info in manifest.items()):
        raise MiniGPTError(f"{mf} is corrupt: expected {{relative file name: {{\"sha256\": hex, \"bytes\": size}}}}")
    stamps = verified_stamps()
    seen = stamps.load() if stamps else {}
    for name, info in manifest.items():
        p = path / name
        if not p.is_file():
            raise MiniGPTError(f"checkpoint {path} is missing {name}")
        st = p.stat()
        if st.st_size != info["bytes"]:
            raise MiniGPTError(f"checkpoint {path} is corrupt: {name} does not match its size in {MANIFEST}")
        key, signature = str(p.resolve()), [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                                            info["sha256"]]
        if seen.get(key) == signature:
            continue
        if sha256_file(p) != info["sha256"]:
            raise MiniGPTError(f"checkpoint {path} is corrupt: {name} does not match its SHA-256 in {MANIFEST}")
        # Only files changed over RACY_NS ago: file times are kernel clock ticks apart, so a write in the same tick
        # as the hashed state would keep the signature (git's "racy clean" entries, rehashed for the same reason).
        if stamps and time.time_ns() - st.st_ctime_ns > RACY_NS:
            stamps.add(key, signature)


def _entry_ok(name: str, info) -> bool:
    """A manifest entry as :func:`commit_atomic_dir` writes it: a name inside the directory, its size and hash."""
    parts = Path(name).parts
    return (bool(parts) and not Path(name).is_absolute() and ".." not in parts and isinstance(info, dict)
            and isinstance(info.get("sha256"), str) and type(info.get("bytes")) is int)


class _Stamps:
    """The stat signatures of files whose SHA-256 matched their manifest, in one JSON file
    (``{absolute path: [dev, ino, size, mtime_ns, ctime_ns, sha256]}``), rewritten atomically; at most
    :data:`STAMPS_MAX` entries, the oldest dropped first. Unreadable, foreign or hostile files count as empty."""

    def __init__(self, file: Path) -> None:
        self.file = file

    def load(self) -> dict:
        try:
            st = self.file.stat()
            if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
                return {}  # another user's file could vouch for a corrupt checkpoint
            data = json_loads(self.file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def add(self, key: str, signature: list) -> None:
        data = self.load()
        data.pop(key, None)
        data[key] = signature
        data = dict(list(data.items())[-STAMPS_MAX:])
        tmp = self.file.with_name(f".{self.file.name}.tmp-{os.getpid()}")
        try:  # a read-only or full disk costs the next load a hash, nothing else
            self.file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # private whatever the umask
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(data))
            os.replace(tmp, self.file)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()


STAMPS_ENV = "MINIGPT_VERIFIED_CACHE"
STAMPS_MAX = 1000
RACY_NS = 2_000_000_000


def verified_stamps() -> Optional[_Stamps]:
    """Where :func:`verify_manifest` records files it hashed: ``$MINIGPT_VERIFIED_CACHE`` (a file; ``off`` hashes
    on every load), else ``$XDG_CACHE_HOME/minigpt/verified.json`` or ``~/.cache/minigpt/verified.json``."""
    value = os.environ.get(STAMPS_ENV)
    if value is not None and value.strip().lower() in ("", "0", "off", "none", "false"):
        return None
    if value:
        return _Stamps(Path(value).expanduser())
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return _Stamps(Path(base) / "minigpt" / "verified.json")
