"""What a tokenizer is given and what its back end may do with it: text must be valid Unicode
(:func:`check_text`), and a back end that gives up on a text is one clear error (:func:`backend_errors`)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from minigpt.errors import MiniGPTError, one_line


class InvalidText(MiniGPTError, ValueError):
    """Text that is not valid Unicode, so no tokenizer can encode it: it holds lone surrogates, which is how Python
    carries bytes that are not UTF-8 (a command-line argument or piped input, decoded with ``surrogateescape``)."""


class TokenizerFailed(InvalidText):
    """The tokenizer's back end gave up on this text (or these ids). A pattern of a ``tokenizer.json`` that
    backtracks without end (a pre-tokenizer's ``Split`` regex such as ``^(a+)+$``, a normalizer's or decoder's
    ``Replace``) stops at Oniguruma's retry limit on some texts, which ``tokenizers`` raises as a Rust panic: pyo3's
    ``PanicException``, a ``BaseException`` that no ``except Exception`` catches (the server answered 500, or its
    worker thread died; the command line printed a traceback)."""


def check_text(text: str) -> None:
    """Raise :class:`InvalidText` when ``text`` cannot be encoded as UTF-8 (it holds a lone surrogate); the message
    names the first offending byte (U+DC80..U+DCFF: an undecodable input byte) or code point, and its position."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        if 0xDC80 <= code <= 0xDCFF:
            raise InvalidText(f"the text is not valid UTF-8 (byte 0x{code - 0xDC00:02x} at position {e.start}); "
                              "give it in UTF-8 (e.g. convert it with iconv)") from None
        raise InvalidText(f"the text is not valid Unicode (a lone surrogate U+{code:04X} at position {e.start}); "
                          "surrogates must come in pairs") from None


@contextmanager
def backend_errors(what: str = "encode this text") -> Iterator[None]:
    """Around a call of the ``tokenizers`` back end: its Rust panics raised as :class:`TokenizerFailed` ("the
    tokenizer cannot ``what``: ..."). Besides a pattern at its retry limit (a pre-tokenizer's, a normalizer's or a
    decoder's), a ``tokenizer.json`` part that names what the file lacks (a post-processor's unknown special token)
    panics the same way."""
    try:
        yield
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise TokenizerFailed(f"the tokenizer cannot {what}: {one_line(e)} (its tokenizer.json has a pattern that "
                              "backtracks without end, or names what it lacks)") from None
