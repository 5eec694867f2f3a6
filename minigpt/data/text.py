"""UTF-8 text read as a stream and cut into pieces that tokenize like the whole (used by
:mod:`minigpt.data.sources`).

Text files are read ``chunk_bytes`` at a time and cut into *pieces* of at most about ``chunk_bytes`` characters,
preferably just after a newline that is followed by a non-space character. Pieces are tokenized independently, so
a cut could change tokenization; the GPT-2 pre-tokenizer regex used by byte-level BPE, however, always ends a
pre-token at such a newline (``"\\n"`` followed by a letter, digit or punctuation is its own pre-token, and BPE
merges never cross pre-tokens), so cutting there gives the same ids as tokenizing the whole document. Only when a
piece has no such newline (a very long line) does the cut fall before a space (equally harmless for words preceded
by a non-space) or, failing that, anywhere, which may change the ids of the one or two tokens at the cut.
"""
from __future__ import annotations

import codecs
from pathlib import Path
from typing import Iterable, Iterator, Optional, Tuple

from minigpt.errors import MiniGPTError


def single_doc_cut(path: Path, size: int, val_fraction: float) -> int:
    """Byte offset where val starts: just after the first newline at or after ``size * (1 - val_fraction)``."""
    target = int(size * (1.0 - val_fraction))
    with open(path, "rb") as f:
        start = max(target - 1, 0)  # a newline right before the target already makes the target a boundary
        f.seek(start)
        pos = start
        while True:
            block = f.read(1 << 16)
            if not block:
                break
            i = block.find(b"\n")
            if i >= 0:
                return pos + i + 1
            pos += len(block)
        # No newline after the target: cut at the next UTF-8 character start (skip continuation bytes 10xxxxxx).
        f.seek(target)
        tail = f.read(4)
    k = 0
    while k < len(tail) and tail[k] & 0xC0 == 0x80:
        k += 1
    return target + k


def read_text(path: Path, chunk_bytes: int, start: int = 0, end: Optional[int] = None) -> Iterator[str]:
    """Decode bytes ``[start, end)`` of a UTF-8 file in chunks; a bad byte raises MiniGPTError with its offset."""
    if end is None:
        end = path.stat().st_size
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        while pos < end:
            raw = f.read(min(chunk_bytes, end - pos))
            if not raw:
                break
            held = len(decoder.getstate()[0])  # bytes of an incomplete character carried from the last chunk
            pos += len(raw)
            try:
                text = decoder.decode(raw, final=pos >= end)
            except UnicodeDecodeError as e:
                raise MiniGPTError(utf8_message(path, pos - len(raw) - held + e.start, e)) from None
            if text:
                yield text


def utf8_message(path: Path, offset: int, e: UnicodeDecodeError) -> str:
    bad = e.object[e.start:e.end].hex(" ")
    return (f"{path} is not valid UTF-8: byte offset {offset} (bytes {bad}: {e.reason}); convert the file to "
            f"UTF-8, e.g. iconv -f WINDOWS-1252 -t UTF-8 in.txt > out.txt")


def split_stream(chunks: Iterable[str], sep: Optional[str], max_chars: int) -> Iterator[Tuple[str, bool]]:
    """Re-cut a stream of text chunks into ``(piece, ends_document)`` pairs.

    Documents are separated by ``sep`` (None: the stream is one document); separators are dropped; empty
    documents are skipped; pieces hold at most ``max_chars`` characters except where a separator search needs
    ``len(sep) - 1`` characters of look-ahead.
    """
    buf = ""
    doc_open = False  # a piece of the current document was already yielded
    # A separator may straddle two chunks: never cut into the last len(sep) - 1 characters before more text is
    # read, or "...\n" + "\n..." would be missed as "\n\n".
    hold = len(sep) - 1 if sep else 0
    for chunk in chunks:
        buf += chunk
        if sep is not None and sep in buf:
            parts = buf.split(sep)
            for part in parts[:-1]:
                if part or doc_open:
                    yield part, True
                doc_open = False
            buf = parts[-1]
        while len(buf) > max_chars:
            cut = cut_point(buf, min(max_chars, len(buf) - hold))
            if cut <= 0:
                break
            yield buf[:cut], False
            doc_open = True
            buf = buf[cut:]
    if buf or doc_open:
        yield buf, True


def cut_point(buf: str, limit: int) -> int:
    """A position ``0 < c <= limit`` to cut ``buf`` at, preferring places that do not change tokenization."""
    if limit <= 0:
        return 0
    floor = limit // 2  # do not make pieces much smaller than asked for
    # Best: just after a newline followed by a non-space (see the module docstring for why this is exact).
    i = buf.rfind("\n", floor, limit)
    first_newline = i
    while i >= floor:
        nxt = buf[i + 1] if i + 1 < len(buf) else ""
        if nxt and not nxt.isspace():
            return i + 1
        i = buf.rfind("\n", floor, i)
    if first_newline >= 0:
        return first_newline + 1
    j = buf.rfind(" ", max(floor, 1), limit)  # before a space: " word" stays one pre-token
    if j > 0:
        return j
    return limit
