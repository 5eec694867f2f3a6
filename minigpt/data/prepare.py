"""Corpus preparation: text -> token files.

Pipeline::

    sources.resolve_source("shakespeare" | "x.txt" | "x.jsonl" | "x.parquet" | saved-dataset dir | hub name)
      -> sources.iter_pieces / iter_documents   stream the text, never the whole corpus in memory
      -> prepare(...)                           train/val split, tokenizer training (train split only), tokenization
      -> out_dir/{train,val}.bin, meta.json, tokenizer.json
      -> loader.load_split(...) -> BatchSampler / eval_windows       (minigpt.data.loader)

Token files are raw little-endian numpy arrays (uint16 when the vocabulary fits, else uint32), each document
followed by the end-of-text id, the packed format of nanoGPT / GPT-2 training: windows are cut anywhere, across
document boundaries, and the model learns from the separator that a new document begins.

Where the text comes from, how it is cut into pieces and split into train and validation: :mod:`minigpt.data.sources`.

Scale. :func:`prepare` reads the corpus as a stream and tokenizes jobs of 256 Ki characters of text in ``workers``
processes (:mod:`minigpt.data.pipeline`): memory does not grow with the corpus and the output is byte-identical for
every number of workers. Token files are written under temporary names, fsync'ed and renamed; a re-run after an
interrupted one removes the leftover temporaries, and a lock on the output directory refuses a concurrent run.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Tuple, Union

import numpy as np

# The loader's names stay importable from here, where they lived before minigpt.data.loader existed; new code
# imports them from minigpt.data (or minigpt.data.loader).
from minigpt.data.loader import META_FILE, BatchSampler, bits_per_byte, eval_windows, load_meta, load_split  # noqa: F401
from minigpt.data.pipeline import SplitWriter, TokenizePipeline
from minigpt.data.sources import (
    SOURCE_DEFAULT,
    SPLITS,
    PathLike,
    Piece,
    Source,
    check_chunk,
    check_fraction,
    effective_sep,
    labeled_pieces,
    resolve_source,
)
from minigpt.errors import MiniGPTError
from minigpt.paths import check_dir_path, remove_created
from minigpt.tokenizer.tokenizer import (
    HF_FILE,
    SP_FILE,
    Tokenizer,
    check_vocab_size,
    train_tokenizer,
)

try:
    import fcntl
except ImportError:  # Windows: no advisory locks (see _DirLock)
    fcntl = None

__all__ = ["DEFAULT_TOKENIZER_SAMPLE_BYTES", "default_workers", "prepare"]

#: Default of ``prepare(tokenizer_sample_bytes=...)``: the BPE is trained on the first 200 MB (UTF-8 bytes) of the
#: train split. Trainer time grows with the bytes read (about 2.3 MB/s on the 2 shared cores of the development
#: machine, so about 1.5 minutes) and its memory with the distinct words seen; 200 MB is tens of millions of words,
#: plenty to rank the frequent pairs that become the merges of a vocabulary of a few tens of thousands of tokens.
DEFAULT_TOKENIZER_SAMPLE_BYTES = 200_000_000

STAGING_PREFIX = ".tokenizer.tmp-"  # the folder the new tokenizer waits in until the token files are complete
_PROGRESS_INTERVAL_S = 15.0  # plain progress lines (stderr not a terminal) at most this often


# ================================================================================================ prepare
def default_workers() -> int:
    """Default number of tokenizer processes for :func:`prepare`: 1 with 2 usable CPU cores or fewer, else the
    usable cores, at most 8.

    With 1, tokenization runs in the main process, where the ``tokenizers`` back end already spreads each job's
    pieces over its own thread pool, so a 2-core machine is busy without worker processes; each of those costs
    ~3 s of CPU and ~300 MB RSS to start (spawned, it imports the package, hence torch). Measured on the 2 shared
    cores of the development machine, the same 200 MB file: 1.14 MB/s with 1, 1.06 MB/s with 2 workers (same CPU
    time, identical output). On more cores separate processes scale further, since the main process then only
    reads, cuts and writes, and no Python work is serialised between tokenizer calls; past about 8 the main
    process and the workers' memory stop paying off.
    """
    try:
        cores = len(os.sched_getaffinity(0))  # respects taskset / container CPU sets, unlike os.cpu_count()
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    return 1 if cores <= 2 else min(8, cores)


def prepare(source: Union[str, Path, Source], out_dir: PathLike, tokenizer: Union[Tokenizer, PathLike, None] = None,
            vocab_size: Optional[int] = None, val_fraction: float = 0.1, seed: int = 1234,
            doc_sep: Any = SOURCE_DEFAULT, chunk_bytes: int = 1 << 16,
            log: Optional[Callable[[str], None]] = None, workers: Optional[int] = None,
            tokenizer_sample_bytes: Optional[int] = DEFAULT_TOKENIZER_SAMPLE_BYTES,
            progress: bool = False) -> Dict[str, Any]:
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
        log: optional callable receiving one-line progress messages (including the final throughput line).
        workers: tokenizer processes (default :func:`default_workers`). With 1, and for the first 4 MiB of text
            (so small corpora do not wait for workers to start), tokenization runs in this process. The output
            does not depend on it.
        tokenizer_sample_bytes: train the tokenizer on the train-split pieces up to the first that brings the
            total to this many UTF-8 bytes (default :data:`DEFAULT_TOKENIZER_SAMPLE_BYTES`, 200 MB); ``None`` or 0:
            on the whole train split. Bounds the time and memory of tokenizer training on huge corpora; it takes
            the *first* bytes, so shuffle a corpus whose beginning is not representative.
        progress: show progress on stderr (a tqdm bar when stderr is a terminal, else a line every 15 s) and end
            with a throughput line (MB/s of input text).

    Returns:
        The meta dict also written to ``meta.json``: ``source``, ``tokenizer_sha256``, ``tokenizer_file``,
        ``vocab_size``, ``dtype``, ``eot_id``, ``doc_sep``, ``val_fraction``, ``seed`` and, per split,
        ``{"tokens", "bytes", "documents"}`` where ``bytes`` counts the UTF-8 bytes of the split's text
        (separators and special tokens excluded), the denominator of :func:`minigpt.data.loader.bits_per_byte`.

    Raises:
        ValueError: bad arguments (both or neither of tokenizer / vocab_size, val_fraction outside (0, 1),
            vocab_size out of range).
        MiniGPTError: unusable source, a split that would be empty, ``workers`` < 1, a negative
            ``tokenizer_sample_bytes``, ``out_dir`` an existing file or under one, another prepare writing to
            ``out_dir``, or a worker process that died.

    Arguments and the source are checked before ``out_dir`` is created; when the run fails later, a directory this
    call created is removed again with the files it wrote there (an existing one is kept).

    Memory is bounded: the stream is read ``chunk_bytes`` at a time and at most ``2 * workers`` jobs of 256 Ki
    characters are in flight. Token files are written to temporary names, fsync'ed and renamed at the end; the
    old ``meta.json`` is removed first, so an interrupted run never leaves token files that look valid but do not
    match their meta. Temporaries left by an interrupted run are removed by the next one.
    """
    say = log or (lambda msg: None)
    if (tokenizer is None) == (vocab_size is None):
        raise ValueError("prepare needs exactly one of tokenizer= (an existing tokenizer) or vocab_size= (train one)")
    check_fraction(val_fraction)
    check_chunk(chunk_bytes)
    workers = default_workers() if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise MiniGPTError(f"workers must be a whole number >= 1, got {workers!r}")
    if tokenizer_sample_bytes is not None and (isinstance(tokenizer_sample_bytes, bool)
                                               or not isinstance(tokenizer_sample_bytes, int)
                                               or tokenizer_sample_bytes < 0):
        raise MiniGPTError(f"the tokenizer sample size must be a whole number of bytes >= 0 (0: the whole train "
                           f"split), got {tokenizer_sample_bytes!r}")
    if vocab_size is not None:
        check_vocab_size(vocab_size)
    src = resolve_source(source)
    sep = effective_sep(src, doc_sep)
    out = Path(out_dir)
    text_size = src.path.stat().st_size if src.kind == "text" else None  # for progress totals only
    started = time.perf_counter()

    def labeled() -> Iterator[Tuple[str, Piece]]:
        return labeled_pieces(src, sep, val_fraction, seed, chunk_bytes)

    with _NewDir(out), _DirLock(out) as lock:  # a failure removes the directory again if this call made it
        removed = _remove_stale_temporaries(out)
        if removed:
            say(f"removed {removed} temporary file(s) left in {out} by an interrupted prepare")
        if tokenizer is None:
            tok = _train_on_sample(src, sep, labeled, vocab_size, val_fraction, tokenizer_sample_bytes or None,
                                   text_size, progress, say)
        elif isinstance(tokenizer, Tokenizer):
            tok = tokenizer
        else:
            t = Path(tokenizer)
            tok = Tokenizer.from_dir(t) if t.is_dir() else Tokenizer.from_file(t)
        eot = tok.eos_id
        if eot is None:
            raise MiniGPTError("the tokenizer has no end-of-text token (<|endoftext|> or </s>) to separate "
                               "documents; train one with vocab_size instead")
        dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)

        # The new tokenizer waits in a staging folder and the token files in temporaries until every split is
        # written: a run that fails leaves a directory prepared before exactly as it was.
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
        tok_path = tok.save(staging)  # also what the worker processes load
        sha256 = tok.sha256  # (cached) hashing a large vocabulary's JSON peaks at a few MB: not on top of the pass
        tokenize_start = time.perf_counter()
        writers: Dict[str, SplitWriter] = {}
        bar = _Progress(progress, "tokenizing", text_size)
        pipe = TokenizePipeline(tok, tok_path, eot, dtype, workers, writers, bar)
        try:
            for s in SPLITS:
                writers[s] = SplitWriter(out / f"{s}.bin", dtype)
            say(f"tokenizing {src.name}")
            for split, piece in labeled():
                pipe.add(split, piece)
            pipe.finish()
            for w in writers.values():
                w.close()
            for split in SPLITS:
                if writers[split].documents == 0:
                    raise MiniGPTError(_empty_split_message(src, sep, split, val_fraction))
            (out / META_FILE).unlink(missing_ok=True)  # first: meta.json marks the directory prepared
            for w in writers.values():
                w.commit()
            tok_path = tok_path.replace(out / tok_path.name)
            for stale in (HF_FILE, SP_FILE):  # Tokenizer.from_dir prefers tokenizer.json: never leave an old one
                if stale != tok_path.name:
                    (out / stale).unlink(missing_ok=True)
        finally:
            pipe.shutdown()
            bar.close()
            for w in writers.values():
                w.discard()
            shutil.rmtree(staging, ignore_errors=True)
        tokenize_s = time.perf_counter() - tokenize_start

        meta: Dict[str, Any] = {
            "source": src.name,
            "tokenizer_sha256": sha256,
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
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(out / META_FILE)
        lock.fsync()  # make the renames durable: meta.json must never survive a crash without its token files

    n_bytes = sum(w.bytes for w in writers.values())
    where = f"{workers} worker processes" if pipe.pool_started else "the main process"
    report = (f"tokenized {n_bytes / 1e6:.1f} MB of text into {sum(w.tokens for w in writers.values())} tokens in "
              f"{tokenize_s:.1f} s ({n_bytes / 1e6 / max(tokenize_s, 1e-9):.2f} MB/s, {where}); "
              f"{time.perf_counter() - started:.1f} s in all")
    say(report)
    if progress:
        print(f"prepare: {report}", file=sys.stderr, flush=True)
    return meta


def _train_on_sample(src: Source, sep: Optional[str], labeled: Callable[[], Iterator[Tuple[str, Piece]]],
                     vocab_size: int, val_fraction: float, limit: Optional[int], text_size: Optional[int],
                     progress: bool, say: Callable[[str], None]) -> Tokenizer:
    """Train the BPE on the first ``limit`` UTF-8 bytes of the train split (all of it when ``limit`` is None).

    ``train_tokenizer`` pulls the pieces from a generator, so the corpus is never held in memory; the trainer keeps
    one count per distinct pre-token (word), which the sample limit also bounds.
    """
    seen = {"train": 0, "val": 0}  # UTF-8 bytes (train) / characters (val) read, to catch an empty split early
    exhausted = False
    total = None if text_size is None else int(text_size * (1 - val_fraction))
    if limit is not None:
        total = limit if total is None else min(limit, total)
    bar = _Progress(progress, "tokenizer sample", total)

    def train_texts() -> Iterator[str]:
        nonlocal exhausted
        for split, piece in labeled():
            if split == "val":
                seen["val"] += len(piece.text)
                continue
            n = len(piece.text.encode("utf-8"))
            seen["train"] += n
            bar.update(n)
            yield piece.text
            if limit is not None and seen["train"] >= limit:
                return
        exhausted = True

    t0 = time.perf_counter()
    sample = "the whole train split" if limit is None else f"the first {limit / 1e6:g} MB of the train split"
    say(f"training a {vocab_size}-token byte-level BPE on {sample} of {src.name}")
    try:
        tok = train_tokenizer(train_texts(), vocab_size)
    finally:
        bar.close()
    if exhausted:  # the whole corpus was read: fail before the longer tokenization pass
        for split, n in seen.items():
            if n == 0:
                raise MiniGPTError(_empty_split_message(src, sep, split, val_fraction))
    say(f"trained the tokenizer on {seen['train'] / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s")
    return tok


class _NewDir:
    """Create the output directory ``out`` (and missing parents) on entry; on a failure inside, remove the files
    prepare writes there and then the directories this call made (:func:`~minigpt.paths.remove_created`). An
    existing directory is never removed, nor a file prepare does not write (someone else's: the directory then
    stays).

    Raises:
        MiniGPTError: ``out`` (or a parent) is an existing file, or a dangling symbolic link.
    """

    def __init__(self, out: Path):
        self.out = out
        self.created: Optional[Path] = None  # the topmost directory this call creates

    def __enter__(self) -> "_NewDir":
        self.created = check_dir_path(self.out, "output directory")
        self.out.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None or self.created is None:
            return
        mine = [HF_FILE, SP_FILE, META_FILE, *(f"{s}.bin" for s in SPLITS)]
        patterns = [f"{s}.bin.tmp*" for s in SPLITS] + [f"{n}.tmp" for n in mine] + [f".{n}.tmp-*" for n in mine]
        for path in [self.out / n for n in mine] + [q for pattern in patterns for q in self.out.glob(pattern)]:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
        remove_created(self.out, self.created)


def _remove_stale_temporaries(out: Path) -> int:
    """Delete the temporary files an interrupted prepare left in ``out``; return how many there were.

    Only called under :class:`_DirLock`, so none of them can belong to a prepare that is still running.
    """
    names = [f"{s}.bin.tmp*" for s in SPLITS] + [f"{n}.tmp" for n in (META_FILE, HF_FILE, SP_FILE)]
    removed = 0
    for pattern in names:
        for path in out.glob(pattern):
            path.unlink(missing_ok=True)
            removed += 1
    for path in out.glob(f"{STAGING_PREFIX}*"):
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


class _DirLock:
    """An exclusive ``flock`` on the output directory while :func:`prepare` writes to it.

    Two prepares into one directory would rename files over each other, and cleaning up a dead run's temporaries
    must not delete a live run's. The kernel drops the lock when the process dies, even by SIGKILL, so an
    interrupted run never blocks the next one. Without ``fcntl`` (Windows) it only supplies :meth:`fsync`.

    Raises:
        MiniGPTError: another process holds the lock.
    """

    def __init__(self, directory: Path):
        self.directory, self.fd = directory, None

    def __enter__(self) -> "_DirLock":
        if fcntl is None:
            return self
        self.fd = os.open(self.directory, os.O_RDONLY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            self.fd = None
            raise MiniGPTError(f"another `minigpt prepare` is writing to {self.directory}: wait for it to finish or "
                               f"use another output directory") from None
        return self

    def fsync(self) -> None:
        """Flush the directory entries (the renames) to disk."""
        if self.fd is not None:
            os.fsync(self.fd)

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _Progress:
    """Progress in bytes of text on stderr: a tqdm bar when stderr is a terminal, else a plain line at most every
    ``_PROGRESS_INTERVAL_S`` seconds (so logs and pipes do not fill with carriage returns); silent when disabled."""

    def __init__(self, enabled: bool, desc: str, total: Optional[int]):
        self.enabled, self.desc, self.total = enabled, desc, total
        self.n = 0
        self.start = self.last = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, dynamic_ncols=True)

    def update(self, n: int) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled:
            now = time.perf_counter()
            if now - self.last >= _PROGRESS_INTERVAL_S:
                self.last = now
                done = f"{self.n / 1e6:.1f} MB"
                if self.total:
                    done += f" of {self.total / 1e6:.1f} MB ({min(100.0, 100.0 * self.n / self.total):.0f}%)"
                rate = self.n / 1e6 / (now - self.start)
                print(f"prepare: {self.desc}: {done}, {rate:.2f} MB/s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _empty_split_message(src: Source, sep: Optional[str], split: str, val_fraction: float) -> str:
    if src.kind == "text" and sep is None:
        return (f"the {split} split of {src.name} would be empty: the corpus is one document and val starts after "
                f"the first newline in its last {val_fraction:.0%}; use a larger file or one with more lines")
    return (f"the {split} split of {src.name} would be empty (val_fraction={val_fraction}): use more documents, "
            f"a {'larger' if split == 'val' else 'smaller'} val_fraction, a different seed"
            + (", or no document separator (then val is the last bytes of the text)" if src.kind == "text" else ""))
