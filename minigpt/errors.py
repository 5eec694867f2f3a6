"""The one exception type that MiniGPT shows to users as a plain message instead of a traceback, the helpers
that keep its messages on one line, and a JSON reader whose every failure is a ``ValueError``."""
from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any


class MiniGPTError(Exception):
    """A user-facing error: the CLI prints its message as one line (no traceback) and exits 1."""


def one_line(e: BaseException) -> str:
    """``str(e)`` with its whitespace (newlines included) collapsed to single spaces, for one-line CLI messages;
    the exception's type name when the message is empty."""
    return " ".join(str(e).split()) or type(e).__name__


def json_loads(text: str | bytes) -> Any:
    """:func:`json.loads` whose every failure is a ``ValueError``, for JSON that a user, a request or a model's
    files control: bad syntax (``json.JSONDecodeError``), an integer of more digits than Python converts (a plain
    ``ValueError``), and nesting deeper than the interpreter's recursion limit, which ``json`` reports as a
    ``RecursionError`` (not a ``ValueError``: it passed handlers of bad JSON; here a ``ValueError`` saying so).

    Raises ``ValueError``; ``UnicodeDecodeError`` (also a ``ValueError``) for bytes that are not UTF-8."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read (thousands of levels of [ or {)") from None


def read_json_object(path: str | Path, what: str = "", hint: str = "") -> dict:
    """The JSON object in the UTF-8 file ``path`` (a config a model's files or a user give).

    Raises :class:`MiniGPTError` naming the file when it is not valid JSON (:func:`json_loads`) or holds another
    JSON value than an object (``what`` says which object, e.g. `` (a PEFT LoraConfig)``); ``hint`` ends both
    messages (how to fix it). ``OSError`` when it cannot be read."""
    try:
        value = json_loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as e:
        raise MiniGPTError(f"{path} is not valid JSON ({type(e).__name__}: {one_line(e)}){hint}") from None
    if not isinstance(value, dict):
        raise MiniGPTError(f"{path} must hold a JSON object{what}, not {type(value).__name__}{hint}")
    return value


def shown_json(value: Any, limit: int = 60) -> str:
    """``value`` as JSON for a one-line error message, cut to ``limit`` characters (``...`` at the end)."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# "(os error 28)": how Rust's std::io::Error prints an errno, inside the messages of the Rust libraries we write
# files with (safetensors' SafetensorError, tokenizers' Exception), which are not OSErrors.
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
# Our atomic writes' temporary names (".NAME.tmp-PID", ".NAME.tmp") stand for the file NAME they become.
_TEMPORARY = re.compile(r"^\.(.+?)\.tmp(?:-?\d+)?$")


def os_error_from(e: BaseException, path) -> OSError | None:
    """The :class:`OSError` (its errno, its message, ``path``) that a Rust library's exception ``e`` carries as
    ``(os error N)``, or None when it carries none (then ``e`` is not an I/O failure to report as one)."""
    m = _RUST_OS_ERROR.search(str(e))
    if m is None:
        return None
    code = int(m.group(1))
    return OSError(code, os.strerror(code), str(path))


def describe_os_error(e: OSError) -> str:
    """A one-line message for a failed file operation, naming the file the user asked for (not our temporary
    sibling of it) and, for the errors a user can fix (full disk, read-only or forbidden place), how."""
    name = e.filename
    if name is not None:
        parts = [(m.group(1) if (m := _TEMPORARY.match(part)) else part) for part in Path(os.fsdecode(name)).parts]
        name = str(Path(*parts))
    where = f" {name}" if name else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device writing{where}: free some space or write to another disk"
    if e.errno == errno.EROFS:
        return f"cannot write{where}: the file system is read-only; choose an output path on a writable one"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied:{where or ' a file'}: choose a path you may write, or change its permissions"
    return f"{type(e).__name__}: {one_line(e)}"
