"""Corpus preparation (text -> token files) and batching (token files -> training batches).

Pipeline::

    resolve_source("shakespeare" | "x.txt" | "x.jsonl" | "x.parquet" | saved-dataset dir | hub name)
      -> iter_pieces / iter_documents       stream the text, never the whole corpus in memory
      -> prepare(...)                       train/val split, tokenizer training (train split only), tokenization
      -> out_dir/{train,val}.bin, meta.json, tokenizer.json
      -> load_split(...) -> BatchSampler / eval_windows

Token files are raw little-endian numpy arrays (uint16 when the vocabulary fits, else uint32), each document
followed by the end-of-text id, the packed format of nanoGPT / GPT-2 training: windows are cut anywhere, across
document boundaries, and the model learns from the separator that a new document begins.

Streaming and chunking. Text files are read ``chunk_bytes`` at a time and cut into *pieces* of at most about
``chunk_bytes`` characters, preferably just after a newline that is followed by a non-space character. Pieces
are tokenized independently, so a cut could change tokenization; the GPT-2 pre-tokenizer regex used by byte-level
BPE, however, always ends a pre-token at such a newline (``"\\n"`` followed by a letter, digit or punctuation is
its own pre-token, and BPE merges never cross pre-tokens), so cutting there gives the same ids as tokenizing the
whole document. Only when a piece has no such newline (a very long line) does the cut fall before a space
(equally harmless for words preceded by a non-space) or, failing that, anywhere, which may change the ids of
the one or two tokens at the cut.

Train/validation split (deterministic, streaming):

* several documents (a separator, or one record per document): document ``i`` goes to val when
  ``blake2b(f"{seed}:{i}")`` read as a fraction of 2**64 is below ``val_fraction``, so val holds about
  ``val_fraction`` of the documents, chosen without reading ahead;
* one document (a ``.txt`` without separator, e.g. Shakespeare): the last ``val_fraction`` of its bytes,
  starting after the first newline at or after that point, is val, as in nanoGPT's 90/10 Shakespeare split.
"""
from __future__ import annotations

import codecs
import difflib
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch

from minigpt.errors import MiniGPTError
from minigpt.tokenizer import HF_FILE, SP_FILE, Tokenizer, train_tokenizer

PathLike = Union[str, Path]

CORPORA_DIR = Path(__file__).resolve().parent / "corpora"

SPLITS = ("train", "val")
META_FILE = "meta.json"


class _SourceDefault:
    """Sentinel type: "use the source's own default document separator"."""

    def __repr__(self) -> str:
        return "SOURCE_DEFAULT"


#: Pass as ``doc_sep`` to use the source's default separator; ``None`` means "the whole file is one document".
SOURCE_DEFAULT: Any = _SourceDefault()


@dataclass(frozen=True)
class BundledCorpus:
    """A corpus shipped inside the package (see ``corpora/LICENSES.md`` for provenance and licences)."""

    path: Path
    doc_sep: Optional[str]  # None: the whole file is one document
    description: str


BUNDLED: Dict[str, BundledCorpus] = {
    "shakespeare": BundledCorpus(
        CORPORA_DIR / "shakespeare.txt", None,
        "Tiny Shakespeare (char-rnn), 1.1 MB English; one document, val = last 10% of bytes"),
    "tang-poems": BundledCorpus(
        CORPORA_DIR / "tang_poems.txt", "\n\n",
        "Complete Tang Poems (chinese-poetry), 3.2 MB classical Chinese; one poem per document"),
}

_TEXT_SUFFIXES = (".txt",)
_KNOWN_SUFFIXES = (".txt", ".jsonl", ".parquet", ".json", ".csv", ".gz", ".zst")
_SAVED_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


@dataclass(frozen=True)
class Source:
    """A resolved corpus. Create with :func:`resolve_source`.

    ``kind`` is one of ``"text"`` (a ``.txt`` file or bundled corpus), ``"jsonl"``, ``"parquet"``, ``"hf_disk"``
    (a ``datasets.save_to_disk`` directory) or ``"hf_hub"`` (``datasets.load_dataset``). ``doc_sep`` is the
    default document separator (text sources only; ``None`` = one document). For the record kinds every record's
    ``"text"`` is one document.
    """

    name: str
    kind: str
    path: Optional[Path] = None
    doc_sep: Optional[str] = None
    dataset: Any = field(default=None, compare=False, repr=False)  # loaded datasets.Dataset for hf_* kinds


class Piece(NamedTuple):
    """A piece of a document: the unit of streaming and of batched tokenization."""

    text: str
    doc_index: int  # index among the source's non-empty documents
    doc_end: bool  # last piece of its document (the end-of-text id follows it in prepared data)


# ================================================================================================ sources
def resolve_source(name_or_path: Union[str, Path, Source]) -> Source:
    """Turn a corpus name or path into a :class:`Source`, checking that it exists and is usable.

    Accepted, in this order: a :class:`Source` (returned as is); a bundled name (:data:`BUNDLED`); an existing
    ``.txt`` / ``.jsonl`` (one JSON object per line with a ``"text"`` string) / ``.parquet`` (string column
    ``"text"``) file; an existing directory written by ``datasets.Dataset.save_to_disk`` (column ``"text"``;
    for a ``DatasetDict`` its ``"train"`` split); otherwise, if the string is not path-like, a Hugging Face hub
    dataset loaded with ``datasets.load_dataset(name, split="train")``.

    Raises:
        MiniGPTError: missing or empty file, unsupported file type, no ``"text"`` column, unknown name.
    """
    if isinstance(name_or_path, Source):
        return name_or_path
    s = str(name_or_path)
    if s in BUNDLED:
        b = BUNDLED[s]
        if not b.path.is_file():
            raise MiniGPTError(f"bundled corpus file {b.path} is missing: reinstall minigpt")
        return Source(s, "text", b.path, b.doc_sep)
    p = Path(s).expanduser()
    if p.is_dir():
        return _resolve_saved_dataset(s, p)
    if p.exists():
        suffix = p.suffix.lower()
        kinds = {".txt": "text", ".jsonl": "jsonl", ".parquet": "parquet"}
        if suffix not in kinds:
            raise MiniGPTError(
                f"{s}: unsupported corpus file type {suffix or '(no suffix)'!r}; use a .txt (UTF-8 text), .jsonl "
                f"(one {{\"text\": ...}} object per line) or .parquet (\"text\" column) file, or a directory written "
                f"by datasets' save_to_disk")
        if p.stat().st_size == 0:
            raise MiniGPTError(f"{s} is empty: give a corpus file that contains text")
        return Source(str(p.resolve()), kinds[suffix], p.resolve(), None)
    # Hub ids are "name" or "owner/name"; anything else that does not exist is a mistyped path.
    looks_like_path = (p.suffix.lower() in _KNOWN_SUFFIXES or s.startswith((".", "/", "~")) or "\\" in s
                       or s.count("/") > 1)
    bundled = ", ".join(BUNDLED)
    if looks_like_path or not _HUB_NAME.match(s):
        raise MiniGPTError(f"{s}: no such file or directory (bundled corpora: {bundled})")
    close = difflib.get_close_matches(s, list(BUNDLED), n=1, cutoff=0.75)
    if close and "/" not in s:
        # A typo of a bundled name: answer now instead of after the hub client's network retries.
        raise MiniGPTError(f"unknown corpus {s!r}: did you mean {close[0]!r}? (bundled corpora: {bundled})")
    return _resolve_hub(s, bundled)


def _resolve_saved_dataset(s: str, p: Path) -> Source:
    if not any((p / m).is_file() for m in _SAVED_DATASET_MARKERS):
        raise MiniGPTError(
            f"{s} is a directory but not one written by datasets' save_to_disk (no "
            f"{' / '.join(_SAVED_DATASET_MARKERS)}); to use text files, concatenate them into one .txt file")
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:
        raise MiniGPTError(f"cannot load saved dataset {s}: {_one_line(e)}") from e
    ds = _pick_train_split(ds, s)
    return Source(str(p.resolve()), "hf_disk", p.resolve(), None, ds)


def _resolve_hub(s: str, bundled: str) -> Source:
    import datasets

    try:
        ds = datasets.load_dataset(s, split="train")
    except Exception as e:
        raise MiniGPTError(
            f"unknown corpus {s!r}: not a bundled corpus ({bundled}), not an existing file or directory, and "
            f"datasets.load_dataset({s!r}, split='train') failed: {_one_line(e)}") from e
    ds = _pick_train_split(ds, s)
    return Source(s, "hf_hub", None, None, ds)


def _pick_train_split(ds: Any, s: str) -> Any:
    import datasets

    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if "train" not in ds:
            raise MiniGPTError(f"{s} has splits {sorted(ds.keys())} but no 'train' split")
        ds = ds["train"]
    if "text" not in ds.column_names:
        raise MiniGPTError(f"{s} has no 'text' column (columns: {', '.join(ds.column_names)}); rename the column "
                           f"holding the documents to 'text'")
    return ds


def _effective_sep(source: Source, doc_sep: Any) -> Optional[str]:
    if doc_sep is SOURCE_DEFAULT:
        return source.doc_sep
    if doc_sep is None:
        return None
    if not isinstance(doc_sep, str) or doc_sep == "":
        raise ValueError(f"doc_sep must be a non-empty string or None, got {doc_sep!r}")
    if source.kind != "text":
        raise MiniGPTError(f"a document separator only applies to .txt corpora; in {source.kind} corpora each "
                           f"record's 'text' is one document: drop the separator option")
    return doc_sep


# ================================================================================================ streaming
def iter_pieces(source: Union[str, Path, Source], doc_sep: Any = SOURCE_DEFAULT,
                chunk_bytes: int = 1 << 20) -> Iterator[Piece]:
    """Stream the whole corpus (both splits) as :class:`Piece` s of at most about ``chunk_bytes`` characters.

    Memory is O(chunk_bytes) for text and JSONL files, O(row group) for Parquet. Empty documents are skipped.

    Raises:
        MiniGPTError: non-UTF-8 bytes (with their byte offset), malformed JSONL, missing ``"text"``.
    """
    src = resolve_source(source)
    sep = _effective_sep(src, doc_sep)
    _check_chunk(chunk_bytes)
    if src.kind == "text":
        yield from _number(_split_stream(_read_text(src.path, chunk_bytes), sep, chunk_bytes))
    else:
        yield from _number(_record_pieces(src, chunk_bytes))


def iter_documents(source: Union[str, Path, Source], doc_sep: Any = SOURCE_DEFAULT,
                   chunk_bytes: int = 1 << 20) -> Iterator[str]:
    """Stream the corpus's documents.

    With several documents (a separator, or a record source) each item is one whole document. When the corpus is
    one document (a ``.txt`` with ``doc_sep=None``, e.g. Shakespeare) the items are consecutive pieces of it, cut
    at newlines, that together form the document, so memory does not grow with the file.
    ``doc_sep`` defaults to the source's own separator (:data:`SOURCE_DEFAULT`); ``None`` forces one document.
    """
    src = resolve_source(source)
    single = src.kind == "text" and _effective_sep(src, doc_sep) is None
    parts: List[str] = []
    for piece in iter_pieces(src, doc_sep, chunk_bytes):
        if single:
            yield piece.text
            continue
        parts.append(piece.text)
        if piece.doc_end:
            yield "".join(parts)
            parts = []


def iter_split(source: Union[str, Path, Source], split: str, doc_sep: Any = SOURCE_DEFAULT,
               val_fraction: float = 0.1, seed: int = 1234, chunk_bytes: int = 1 << 20) -> Iterator[Piece]:
    """Stream the pieces of one split (``"train"`` or ``"val"``), split as described in the module docstring."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    for s, piece in _labeled_pieces(source, doc_sep, val_fraction, seed, chunk_bytes):
        if s == split:
            yield piece


def _labeled_pieces(source: Union[str, Path, Source], doc_sep: Any, val_fraction: float, seed: int,
                    chunk_bytes: int) -> Iterator[Tuple[str, Piece]]:
    src = resolve_source(source)
    sep = _effective_sep(src, doc_sep)
    _check_fraction(val_fraction)
    _check_chunk(chunk_bytes)
    if src.kind == "text" and sep is None:
        size = src.path.stat().st_size
        cut = _single_doc_cut(src.path, size, val_fraction)
        for doc_index, (split, start, end) in enumerate((("train", 0, cut), ("val", cut, size))):
            if end > start:
                for text, last in _split_stream(_read_text(src.path, chunk_bytes, start, end), None, chunk_bytes):
                    yield split, Piece(text, doc_index, last)
        return
    for piece in iter_pieces(src, sep, chunk_bytes):
        yield ("val" if _is_val(seed, piece.doc_index, val_fraction) else "train"), piece


def _is_val(seed: int, doc_index: int, val_fraction: float) -> bool:
    # A keyed hash instead of a shuffled index list: decidable per document while streaming, and stable across
    # Python versions and processes (unlike hash()).
    h = hashlib.blake2b(f"{seed}:{doc_index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") < val_fraction * 2.0**64


def _single_doc_cut(path: Path, size: int, val_fraction: float) -> int:
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


def _read_text(path: Path, chunk_bytes: int, start: int = 0, end: Optional[int] = None) -> Iterator[str]:
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
                raise MiniGPTError(_utf8_message(path, pos - len(raw) - held + e.start, e)) from None
            if text:
                yield text


def _utf8_message(path: Path, offset: int, e: UnicodeDecodeError) -> str:
    bad = e.object[e.start:e.end].hex(" ")
    return (f"{path} is not valid UTF-8: byte offset {offset} (bytes {bad}: {e.reason}); convert the file to "
            f"UTF-8, e.g. iconv -f WINDOWS-1252 -t UTF-8 in.txt > out.txt")


def _split_stream(chunks: Iterable[str], sep: Optional[str], max_chars: int) -> Iterator[Tuple[str, bool]]:
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
            cut = _cut_point(buf, min(max_chars, len(buf) - hold))
            if cut <= 0:
                break
            yield buf[:cut], False
            doc_open = True
            buf = buf[cut:]
    if buf or doc_open:
        yield buf, True


def _cut_point(buf: str, limit: int) -> int:
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


def _number(pairs: Iterable[Tuple[str, bool]]) -> Iterator[Piece]:
    doc_index = 0
    for text, last in pairs:
        yield Piece(text, doc_index, last)
        if last:
            doc_index += 1


def _record_pieces(src: Source, max_chars: int) -> Iterator[Tuple[str, bool]]:
    records = {"jsonl": _jsonl_texts, "parquet": _parquet_texts, "hf_disk": _dataset_texts,
               "hf_hub": _dataset_texts}[src.kind](src)
    for text in records:
        if text:
            if len(text) <= max_chars:
                yield text, True
            else:
                yield from _split_stream((text,), None, max_chars)


def _jsonl_texts(src: Source) -> Iterator[str]:
    offset = 0
    with open(src.path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise MiniGPTError(_utf8_message(src.path, offset + e.start, e) + f" (line {lineno})") from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise MiniGPTError(f"{src.path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON "
                                   f"object such as {{\"text\": \"...\"}}") from None
            if not isinstance(obj, dict) or "text" not in obj:
                keys = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
                raise MiniGPTError(f"{src.path}:{lineno}: no \"text\" field (found: {keys or 'nothing'}); each line "
                                   f"must be a JSON object with the document in \"text\"")
            text = obj["text"]
            if text is None:
                continue
            if not isinstance(text, str):
                raise MiniGPTError(f"{src.path}:{lineno}: \"text\" is a {type(text).__name__}, expected a string")
            yield text


def _parquet_texts(src: Source) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(src.path))
    except Exception as e:
        raise MiniGPTError(f"cannot read {src.path} as Parquet: {_one_line(e)}") from e
    names = pf.schema_arrow.names
    if "text" not in names:
        raise MiniGPTError(f"{src.path} has no 'text' column (columns: {', '.join(names)}); rename the column "
                           f"holding the documents to 'text'")
    typ = pf.schema_arrow.field("text").type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
        raise MiniGPTError(f"{src.path}: column 'text' has type {typ}, expected string")
    # One batch per row group (or less): memory stays at a row group, never the whole file.
    for batch in pf.iter_batches(columns=["text"], batch_size=4096):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def _dataset_texts(src: Source) -> Iterator[str]:
    ds = src.dataset.select_columns(["text"])
    for batch in ds.iter(batch_size=1000):
        for text in batch["text"]:
            if text is None:
                continue
            if not isinstance(text, str):
                raise MiniGPTError(f"{src.name}: column 'text' holds {type(text).__name__}, expected strings")
            yield text


# ================================================================================================ prepare
def prepare(source: Union[str, Path, Source], out_dir: PathLike, tokenizer: Union[Tokenizer, PathLike, None] = None,
            vocab_size: Optional[int] = None, val_fraction: float = 0.1, seed: int = 1234,
            doc_sep: Any = SOURCE_DEFAULT, chunk_bytes: int = 1 << 16,
            log: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Split, (train a tokenizer on the train split,) tokenize and write a corpus; return the meta dict.

    Args:
        source: anything :func:`resolve_source` accepts.
        out_dir: created if needed. Receives ``train.bin``, ``val.bin`` (raw uint16/uint32 token ids, each
            document followed by the end-of-text id), ``meta.json`` and the tokenizer (``tokenizer.json``, or
            ``tokenizer.model`` for a given sentencepiece tokenizer) so the directory is self-contained.
        tokenizer: a :class:`Tokenizer`, or a tokenizer file / directory; exclusive with ``vocab_size``.
        vocab_size: train a byte-level BPE of this size on the train split only, so that no validation text
            influences the merges.
        val_fraction: in (0, 1); see the module docstring for how documents / bytes are assigned.
        seed: selects the validation documents.
        doc_sep: document separator for ``.txt`` corpora; default: the source's own (``"\\n\\n"`` for
            ``tang-poems``, none otherwise); ``None``: the file is one document.
        chunk_bytes: streaming granularity (read size and maximum piece length).
        log: optional callable receiving one-line progress messages.

    Returns:
        The meta dict also written to ``meta.json``: ``source``, ``tokenizer_sha256``, ``tokenizer_file``,
        ``vocab_size``, ``dtype``, ``eot_id``, ``doc_sep``, ``val_fraction``, ``seed`` and, per split,
        ``{"tokens", "bytes", "documents"}`` where ``bytes`` counts the UTF-8 bytes of the split's text
        (separators and special tokens excluded), the denominator of :func:`bits_per_byte`.

    Raises:
        ValueError: bad arguments (both or neither of tokenizer / vocab_size, val_fraction outside (0, 1)).
        MiniGPTError: unusable source, or a split that would be empty.

    Files are written to temporary names and renamed at the end; the old ``meta.json`` is removed first, so an
    interrupted run never leaves token files that look valid but do not match their meta.
    """
    say = log or (lambda msg: None)
    if (tokenizer is None) == (vocab_size is None):
        raise ValueError("prepare needs exactly one of tokenizer= (an existing tokenizer) or vocab_size= (train one)")
    _check_fraction(val_fraction)
    _check_chunk(chunk_bytes)
    src = resolve_source(source)
    sep = _effective_sep(src, doc_sep)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def labeled() -> Iterator[Tuple[str, Piece]]:
        return _labeled_pieces(src, sep, val_fraction, seed, chunk_bytes)

    if tokenizer is None:
        counts = {"train": 0, "val": 0}

        def train_texts() -> Iterator[str]:
            for split, piece in labeled():
                counts[split] += len(piece.text)
                if split == "train":
                    yield piece.text

        say(f"training a {vocab_size}-token byte-level BPE on the train split of {src.name}")
        tok = train_tokenizer(train_texts(), vocab_size)
        for split, n in counts.items():
            if n == 0:  # fail before the longer tokenization pass
                raise MiniGPTError(_empty_split_message(src, sep, split, val_fraction))
    elif isinstance(tokenizer, Tokenizer):
        tok = tokenizer
    else:
        t = Path(tokenizer)
        tok = Tokenizer.from_dir(t) if t.is_dir() else Tokenizer.from_file(t)
    eot = tok.eos_id
    if eot is None:
        raise MiniGPTError("the tokenizer has no end-of-text token (<|endoftext|> or </s>) to separate documents; "
                           "train one with vocab_size instead")
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)

    (out / META_FILE).unlink(missing_ok=True)
    tok_path = tok.save(out)
    for stale in (HF_FILE, SP_FILE):  # Tokenizer.from_dir prefers tokenizer.json: never leave an old one behind
        if stale != tok_path.name:
            (out / stale).unlink(missing_ok=True)

    writers = {s: _SplitWriter(out / f"{s}.bin", dtype, tok, eot) for s in SPLITS}
    try:
        say(f"tokenizing {src.name}")
        for split, piece in labeled():
            writers[split].add(piece)
        for w in writers.values():
            w.close()
        for split in SPLITS:
            if writers[split].documents == 0:
                raise MiniGPTError(_empty_split_message(src, sep, split, val_fraction))
        for w in writers.values():
            w.commit()
    finally:
        for w in writers.values():
            w.discard()

    meta: Dict[str, Any] = {
        "source": src.name,
        "tokenizer_sha256": tok.sha256,
        "tokenizer_file": tok_path.name,
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "eot_id": eot,
        "doc_sep": sep,
        "val_fraction": val_fraction,
        "seed": seed,
    }
    for split in SPLITS:
        w = writers[split]
        meta[split] = {"tokens": w.tokens, "bytes": w.bytes, "documents": w.documents}
        say(f"{split}: {w.documents} documents, {w.bytes} bytes, {w.tokens} tokens")
    tmp = out / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(out / META_FILE)
    return meta


class _SplitWriter:
    """Tokenizes one split's pieces in batches and appends the ids to a temporary file."""

    def __init__(self, path: Path, dtype: np.dtype, tok: Tokenizer, eot: int, batch_chars: int = 1 << 20):
        self.path, self.dtype, self.tok, self.eot, self.batch_chars = path, dtype, tok, eot, batch_chars
        self.tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        self.file = open(self.tmp, "wb")
        self.pending: List[Piece] = []
        self.pending_chars = 0
        self.tokens = self.bytes = self.documents = 0

    def add(self, piece: Piece) -> None:
        self.pending.append(piece)
        self.pending_chars += len(piece.text)
        self.bytes += len(piece.text.encode("utf-8"))
        self.documents += piece.doc_end
        if self.pending_chars >= self.batch_chars:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        ids: List[int] = []
        for piece, piece_ids in zip(self.pending, self.tok.encode_batch([p.text for p in self.pending])):
            ids.extend(piece_ids)
            if piece.doc_end:
                ids.append(self.eot)
        arr = np.asarray(ids, dtype=self.dtype)
        arr.tofile(self.file)
        self.tokens += arr.size
        self.pending, self.pending_chars = [], 0

    def close(self) -> None:
        self._flush()
        self.file.close()

    def commit(self) -> None:
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.tmp.unlink(missing_ok=True)


def _empty_split_message(src: Source, sep: Optional[str], split: str, val_fraction: float) -> str:
    if src.kind == "text" and sep is None:
        return (f"the {split} split of {src.name} would be empty: the corpus is one document and val starts after "
                f"the first newline in its last {val_fraction:.0%}; use a larger file or one with more lines")
    return (f"the {split} split of {src.name} would be empty (val_fraction={val_fraction}): use more documents, "
            f"a {'larger' if split == 'val' else 'smaller'} val_fraction, a different seed"
            + (", or no document separator (then val is the last bytes of the text)" if src.kind == "text" else ""))


# ================================================================================================ loading
def load_meta(data_dir: PathLike) -> Dict[str, Any]:
    """Read ``data_dir/meta.json`` as written by :func:`prepare`.

    Raises:
        MiniGPTError: directory or meta.json missing / unreadable (the message says to run ``minigpt prepare``).
    """
    d = Path(data_dir)
    path = d / META_FILE
    if not path.is_file():
        what = "does not exist" if not d.exists() else f"has no {META_FILE}"
        raise MiniGPTError(f"data directory {d} {what}: create it with `minigpt prepare`")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise MiniGPTError(f"cannot read {path}: {_one_line(e)}; re-run `minigpt prepare`") from e


def load_split(data_dir: PathLike, split: str) -> np.memmap:
    """Memory-map ``data_dir/{split}.bin`` (read only) as a 1-D array of token ids, dtype from meta.json.

    Raises:
        ValueError: ``split`` not ``"train"`` / ``"val"``.
        MiniGPTError: file missing, or its size disagrees with meta.json (interrupted or mixed-up prepare).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    meta = load_meta(data_dir)
    path = Path(data_dir) / f"{split}.bin"
    if not path.is_file():
        raise MiniGPTError(f"{path} is missing: create the data directory with `minigpt prepare`")
    dtype = np.dtype(meta["dtype"])
    expected = int(meta[split]["tokens"]) * dtype.itemsize
    size = path.stat().st_size
    if size != expected or size == 0:
        raise MiniGPTError(f"{path} has {size} bytes but meta.json says {meta[split]['tokens']} {dtype.name} tokens "
                           f"({expected} bytes): re-run `minigpt prepare`")
    return np.memmap(path, dtype=dtype, mode="r")


# ================================================================================================ batching
class BatchSampler:
    """Random packed windows of a token array, reproducible and resumable.

    Each batch holds ``batch_size`` windows of ``seq_len + 1`` consecutive tokens at offsets drawn uniformly
    from ``[0, len(tokens) - seq_len - 1]`` by a ``torch.Generator`` seeded with ``seed`` (nanoGPT's
    ``get_batch``); windows may span document boundaries (the end-of-text id marks them).
    :meth:`state_dict` / :meth:`load_state_dict` capture the generator so a resumed run draws exactly the batches
    the uninterrupted run would have drawn.

    Data parallelism: every rank holds its own generator with the same seed, draws the offsets of the whole
    global batch (``batch_size * world_size`` windows) and keeps its own slice ``rank``. The data order is
    therefore independent of the world size: two ranks of batch ``b`` see exactly the windows one process of batch
    ``2b`` sees, and a run can resume on a different number of ranks without changing its data.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, rank: int = 0,
                 world_size: int = 1):
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if len(tokens) < seq_len + 1:
            raise ValueError(f"the split has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}: use a "
                             f"shorter seq_len or more data")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank {rank} of {world_size}")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0
        self._arange = np.arange(seq_len + 1)

    def next(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return ``(x, y)``, int64 tensors of shape ``[batch_size, seq_len]`` with ``y[:, t] == x[:, t + 1]``
        for ``t < seq_len - 1`` (the next-token targets)."""
        high = len(self.tokens) - self.seq_len  # exclusive: offset + seq_len + 1 <= len(tokens)
        offsets = torch.randint(0, high, (self.batch_size * self.world_size,), generator=self.generator).numpy()
        offsets = offsets[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        windows = torch.from_numpy(np.asarray(self.tokens[offsets[:, None] + self._arange], dtype=np.int64))
        self.batches_drawn += 1
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __iter__(self) -> "BatchSampler":
        return self

    def __next__(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    def state_dict(self) -> Dict[str, Any]:
        """``{"generator_state": ByteTensor, "batches_drawn": int}``; save it with the checkpoint."""
        return {"generator_state": self.generator.get_state(), "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: the next batches equal those the saved sampler would have drawn."""
        self.generator.set_state(state["generator_state"])
        self.batches_drawn = int(state["batches_drawn"])


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A fixed set of evaluation windows: ``(x, y)`` int64 tensors of shape ``[n, seq_len]``.

    The split is tiled by ``(len(tokens) - 1) // seq_len`` non-overlapping windows (window ``i`` predicts tokens
    ``i*seq_len + 1 .. (i+1)*seq_len``, so together they score every token once); when there are more than
    ``max_windows``, ``max_windows`` of them evenly spaced over the split are used. No randomness: every
    evaluation of every run sees the same tokens, so losses are comparable.

    Raises:
        ValueError: fewer than ``seq_len + 1`` tokens, or ``max_windows < 1``.
    """
    if max_windows < 1 or seq_len < 1:
        raise ValueError(f"seq_len and max_windows must be >= 1, got {seq_len} and {max_windows}")
    available = (len(tokens) - 1) // seq_len
    if available < 1:
        raise ValueError(f"the split has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    n = min(available, max_windows)
    starts = (np.arange(n, dtype=np.int64) * available // n) * seq_len
    windows = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64)
    w = torch.from_numpy(windows)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def bits_per_byte(loss_nats: float, tokens: int, n_bytes: int) -> float:
    """Convert a mean per-token cross-entropy (nats) into bits per UTF-8 byte of text.

    ``bpb = loss_nats * tokens / n_bytes / ln 2``: total nats over the text (``loss * tokens``), per byte, in bits.
    This is the tokenizer-independent metric of Gao et al. 2020, "The Pile: An 800GB Dataset of Diverse Text for
    Language Modeling" (arXiv:2101.00027), ``BPB = (L_T / L_B) * loss / ln 2`` with ``L_T`` tokens and ``L_B``
    bytes. Use the split's ``tokens`` and ``bytes`` from meta.json (the end-of-text tokens count as tokens, their
    loss included, while separators add no bytes); with a loss measured on a subset of windows this is an
    estimate that assumes the subset has the split's bytes-per-token ratio.

    Raises:
        ValueError: ``n_bytes`` <= 0 or ``tokens`` < 0.
    """
    if n_bytes <= 0 or tokens < 0:
        raise ValueError(f"need n_bytes > 0 and tokens >= 0, got {n_bytes} and {tokens}")
    return float(loss_nats) * tokens / n_bytes / math.log(2)


# ================================================================================================ helpers
def _check_fraction(val_fraction: float) -> None:
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")


def _check_chunk(chunk_bytes: int) -> None:
    if chunk_bytes < 16:
        raise ValueError(f"chunk_bytes must be >= 16, got {chunk_bytes}")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
