"""The one exception type that MiniGPT shows to users as a plain message instead of a traceback, and the helpers
that keep its messages on one line."""
from __future__ import annotations

import json
from typing import Any


class MiniGPTError(Exception):
    """A user-facing error: the CLI prints its message as one line (no traceback) and exits 1."""


def one_line(e: BaseException) -> str:
    """``str(e)`` with its whitespace (newlines included) collapsed to single spaces, for one-line CLI messages;
    the exception's type name when the message is empty."""
    return " ".join(str(e).split()) or type(e).__name__


def shown_json(value: Any, limit: int = 60) -> str:
    """``value`` as JSON for a one-line error message, cut to ``limit`` characters (``...`` at the end)."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."
