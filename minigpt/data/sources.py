"""Where training text comes from, read as a stream: bundled corpora, ``.txt``/``.jsonl``/``.parquet`` files,
saved ``datasets`` directories and hub datasets; cut into pieces; assigned to the train or validation split.
:mod:`minigpt.data.prepare` turns these pieces into token files.

Streaming and chunking: text files are read a chunk at a time and cut into pieces at places that do not change
their tokenization (:mod:`minigpt.data.text`); every record of a record source is one document, cut the same way
when it is longer than a piece.

Train/validation split (deterministic, streaming):

* several documents (a separator, or one record per document): document ``i`` goes to val when
  ``blake2b(f"{seed}:{i}")`` read as a fraction of 2**64 is below ``val_fraction``, so val holds about
  ``val_fraction`` of the documents, chosen without reading ahead;
* one document (a ``.txt`` without separator, e.g. Shakespeare): the last ``val_fraction`` of its bytes,
  starting after the first newline at or after that point, is val, as in nanoGPT's 90/10 Shakespeare split.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple, Union

from minigpt.data.text import read_text, single_doc_cut, split_stream, utf8_message
from minigpt.errors import MiniGPTError, json_loads, one_line

PathLike = Union[str, Path]

CORPORA_DIR = Path(__file__).resolve().parent / "corpora"

SPLITS = ("train", "val")


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
    (a ``datasets.save_to_disk`` directory), ``"hf_hub"`` (``datasets.load_dataset``) or ``"hf_stream"``
    (``datasets.load_dataset(..., streaming=True)``, from an ``hf:`` name). ``doc_sep`` is the
    default document separator (text sources only; ``None`` = one document). For the record kinds every record's
    ``"text"`` is one document.
    """

    name: str
    kind: str
    path: Optional[Path] = None
    doc_sep: Optional[str] = None
    dataset: Any = field(default=None, compare=False, repr=False)  # datasets.(Iterable)Dataset for hf_* kinds


class Piece(NamedTuple):
    """A piece of a document: the unit of streaming and of batched tokenization."""

    text: str
    doc_index: int  # index among the source's non-empty documents
    doc_end: bool  # last piece of its document (the end-of-text id follows it in prepared data)


# ================================================================================================ sources
def resolve_source(name_or_path: Union[str, Path, Source]) -> Source:
    """Turn a corpus name or path into a :class:`Source`, checking that it exists and is usable.

    Accepted, in this order: a :class:`Source` (returned as is); ``hf:NAME[:CONFIG][:SPLIT]``, a Hugging Face
    dataset read in streaming mode (see :func:`resolve_hf_stream`); a bundled name (:data:`BUNDLED`); an existing
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
    if s.startswith("hf:"):
        return resolve_hf_stream(s)
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
        raise MiniGPTError(f"cannot load saved dataset {s}: {one_line(e)}") from e
    ds = _pick_train_split(ds, s)
    return Source(str(p.resolve()), "hf_disk", p.resolve(), None, ds)


def _resolve_hub(s: str, bundled: str) -> Source:
    import datasets

    try:
        ds = datasets.load_dataset(s, split="train")
    except Exception as e:
        raise MiniGPTError(
            f"unknown corpus {s!r}: not a bundled corpus ({bundled}), not an existing file or directory, and "
            f"datasets.load_dataset({s!r}, split='train') failed: {one_line(e)}") from e
    ds = _pick_train_split(ds, s)
    return Source(s, "hf_hub", None, None, ds)


def resolve_hf_stream(spec: str) -> Source:
    """Open ``hf:NAME[:CONFIG][:SPLIT]`` as ``datasets.load_dataset(NAME, CONFIG, split=SPLIT, streaming=True)``.

    ``NAME`` is a hub id (``owner/name``; needs network access, and the ``HF_TOKEN`` of a logged-in user for gated
    sets) or a local directory of data files (``train.parquet``, ``*.jsonl``, ...; works offline). ``CONFIG``
    defaults to the dataset's default configuration, ``SPLIT`` to ``train``; write ``hf:NAME::SPLIT`` for a split
    without a configuration. Records stream as they are read, so nothing is downloaded up front and memory does not
    grow with the dataset; each record's ``text`` is one document. :func:`prepare` reads the stream twice when it
    trains a tokenizer (once for the tokenizer sample, once to tokenize).

    Raises:
        MiniGPTError: malformed spec, the dataset / config / split cannot be loaded (the message says that hub
            names need network access), or it has no ``text`` column.
    """
    parts = spec[len("hf:"):].split(":")
    if not parts[0] or len(parts) > 3:
        raise MiniGPTError(f"{spec!r}: expected hf:NAME[:CONFIG][:SPLIT], e.g. hf:roneneldan/TinyStories or "
                           f"hf:wikitext:wikitext-103-raw-v1:train")
    name = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:
        where = ("a local directory" if Path(name).expanduser().is_dir()
                 else "hub datasets need network access (or a local directory of data files)")
        raise MiniGPTError(f"cannot stream Hugging Face dataset {name!r} (config {config or 'default'}, split "
                           f"{split!r}); {where}: {one_line(e)}") from e
    columns = ds.column_names  # None when the builder cannot tell before reading: checked on the first batch then
    if columns is not None and "text" not in columns:
        raise MiniGPTError(f"{spec} has no 'text' column (columns: {', '.join(columns)}); rename the column holding "
                           f"the documents to 'text'")
    return Source(spec, "hf_stream", None, None, ds)


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


def effective_sep(source: Source, doc_sep: Any) -> Optional[str]:
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
    sep = effective_sep(src, doc_sep)
    check_chunk(chunk_bytes)
    if src.kind == "text":
        yield from _number(split_stream(read_text(src.path, chunk_bytes), sep, chunk_bytes))
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
    single = src.kind == "text" and effective_sep(src, doc_sep) is None
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
    for s, piece in labeled_pieces(source, doc_sep, val_fraction, seed, chunk_bytes):
        if s == split:
            yield piece


def labeled_pieces(source: Union[str, Path, Source], doc_sep: Any, val_fraction: float, seed: int,
                    chunk_bytes: int) -> Iterator[Tuple[str, Piece]]:
    src = resolve_source(source)
    sep = effective_sep(src, doc_sep)
    check_fraction(val_fraction)
    check_chunk(chunk_bytes)
    if src.kind == "text" and sep is None:
        size = src.path.stat().st_size
        cut = single_doc_cut(src.path, size, val_fraction)
        for doc_index, (split, start, end) in enumerate((("train", 0, cut), ("val", cut, size))):
            if end > start:
                for text, last in split_stream(read_text(src.path, chunk_bytes, start, end), None, chunk_bytes):
                    yield split, Piece(text, doc_index, last)
        return
    for piece in iter_pieces(src, sep, chunk_bytes):
        yield ("val" if _is_val(seed, piece.doc_index, val_fraction) else "train"), piece


def _is_val(seed: int, doc_index: int, val_fraction: float) -> bool:
    # A keyed hash instead of a shuffled index list: decidable per document while streaming, and stable across
    # Python versions and processes (unlike hash()).
    h = hashlib.blake2b(f"{seed}:{doc_index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") < val_fraction * 2.0**64


def _number(pairs: Iterable[Tuple[str, bool]]) -> Iterator[Piece]:
    doc_index = 0
    for text, last in pairs:
        yield Piece(text, doc_index, last)
        if last:
            doc_index += 1


def _record_pieces(src: Source, max_chars: int) -> Iterator[Tuple[str, bool]]:
    records = {"jsonl": _jsonl_texts, "parquet": _parquet_texts, "hf_disk": _dataset_texts,
               "hf_hub": _dataset_texts, "hf_stream": _stream_texts}[src.kind](src)
    for text in records:
        if text:
            if len(text) <= max_chars:
                yield text, True
            else:
                yield from split_stream((text,), None, max_chars)


def _jsonl_texts(src: Source) -> Iterator[str]:
    offset = 0
    with open(src.path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise MiniGPTError(utf8_message(src.path, offset + e.start, e) + f" (line {lineno})") from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                obj = json_loads(line)
            except ValueError as e:  # bad syntax, nesting thousands deep, an integer of thousands of digits
                msg = e.msg if isinstance(e, json.JSONDecodeError) else one_line(e)
                raise MiniGPTError(f"{src.path}:{lineno}: not valid JSON ({msg}); each line must be one JSON "
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
        raise MiniGPTError(f"cannot read {src.path} as Parquet: {one_line(e)}") from e
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


def _texts_of(src: Source, column) -> Iterator[str]:
    """The strings of a batch's ``text`` column (None skipped); anything else is a one-line error."""
    for text in column:
        if text is None:
            continue
        if not isinstance(text, str):
            raise MiniGPTError(f"{src.name}: column 'text' holds {type(text).__name__}, expected strings")
        yield text


def _dataset_texts(src: Source) -> Iterator[str]:
    ds = src.dataset.select_columns(["text"])
    for batch in ds.iter(batch_size=1000):
        yield from _texts_of(src, batch["text"])


def _stream_texts(src: Source) -> Iterator[str]:
    ds = src.dataset
    if ds.column_names is not None:
        ds = ds.select_columns(["text"])  # do not decode the other columns
    batches = iter(ds.iter(batch_size=1000))
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:  # a network or file error in the middle of the stream
            raise MiniGPTError(f"reading {src.name} failed: {one_line(e)}") from e
        if "text" not in batch:
            raise MiniGPTError(f"{src.name} has no 'text' column (columns: {', '.join(batch)}); rename the column "
                               f"holding the documents to 'text'")
        yield from _texts_of(src, batch["text"])


# ================================================================================================ helpers
def check_fraction(val_fraction: float) -> None:
    """``ValueError`` unless ``0 < val_fraction < 1``."""
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")


def check_chunk(chunk_bytes: int) -> None:
    """``ValueError`` unless ``chunk_bytes >= 16``."""
    if chunk_bytes < 16:
        raise ValueError(f"chunk_bytes must be >= 16, got {chunk_bytes}")
