"""The one exception type that MiniGPT shows to users as a plain message instead of a traceback."""


class MiniGPTError(Exception):
    """A user-facing error: the CLI prints its message as one line (no traceback) and exits 1."""
