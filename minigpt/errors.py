"""The one exception type that MiniGPT shows to users as a plain message instead of a traceback."""


class MiniGPTError(Exception):
    """A user-facing error: the CLI prints its message as one line (no traceback) and exits 1."""


def one_line(e: BaseException) -> str:
    """``str(e)`` with its whitespace (newlines included) collapsed to single spaces, for one-line CLI messages;
    the exception's type name when the message is empty."""
    return " ".join(str(e).split()) or type(e).__name__
