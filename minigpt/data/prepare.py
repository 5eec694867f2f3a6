"""Corpus preparation (text -> token files) and batching (token files -> training batches).

Pipeline::

    sources.resolve_source("shakespeare" | "x.txt" | "x.jsonl" | "x.parquet" | saved-dataset dir | hub name)
      -> sources.iter_pieces / iter_documents   stream the text, never the whole corpus in memory
      -> prepare(...)                           train/val split, tokenizer training (train split only), tokenization
      -> out_dir/{train,val}.bin, meta.json, tokenizer.json
      -> load_split(...) -> BatchSampler / eval_windows

Token files are raw little-endian numpy arrays (uint16 when the vocabulary fits, else uint32), each document
followed by the end-of-text id, the packed format of nanoGPT / GPT-2 training: windows are cut anywhere, across
document boundaries, and the model learns from the separator that a new document begins.

Where the text comes from, how it is cut into pieces and split into train and validation: :mod:`minigpt.data.sources`.

Scale. :func:`prepare` reads the corpus as a stream and tokenizes jobs of 256 Ki characters of text in ``workers``
processes (``concurrent.futures`` with the ``spawn`` start method, the tokenizer loaded once per worker from the
``tokenizer.json`` already written to the output directory). At most ``2 * workers`` jobs are in flight and their
results are appended in submission order, so memory does not grow with the corpus and the output is byte-identical
for every number of workers. Token files are written under temporary names, fsync'ed and renamed; a re-run after an
interrupted one removes the leftover temporaries, and a lock on the output directory refuses a concurrent run.
"""
from __future__ import annotations

import collections
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np
import torch

from minigpt.errors import MiniGPTError, one_line
from minigpt.data.sources import (SOURCE_DEFAULT, SPLITS, PathLike, Piece, Source, check_chunk, check_fraction,
                             effective_sep, labeled_pieces, resolve_source)
from minigpt.tokenizer.tokenizer import HF_FILE, SP_FILE, Tokenizer, train_tokenizer

META_FILE = "meta.json"

#: Default of ``prepare(tokenizer_sample_bytes=...)``: the BPE is trained on the first 200 MB (UTF-8 bytes) of the
#: train split. Trainer time grows with the bytes read (about 2.3 MB/s on the 2 shared cores of the development
#: machine, so about 1.5 minutes) and its memory with the distinct words seen; 200 MB is tens of millions of words,
#: plenty to rank the frequent pairs that become the merges of a vocabulary of a few tens of thousands of tokens.
DEFAULT_TOKENIZER_SAMPLE_BYTES = 200_000_000

# Characters of text per tokenization job. Each job costs a few ms of pickling and IPC against ~0.1 s of BPE work;
# larger jobs only raise every worker's peak RSS (the back end's per-token Encoding objects): 1 MiB jobs peaked
# ~55 MB higher per process than 256 KiB ones, at the same throughput.
_JOB_CHARS = 1 << 18
# Text tokenized in the main process before the worker pool is started: a small corpus (a few MB, e.g. Shakespeare)
# is done before spawned workers would have finished importing (about 3 s each, for torch via the package).
_INPROCESS_CHARS = 4 << 20
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
        (separators and special tokens excluded), the denominator of :func:`bits_per_byte`.

    Raises:
        ValueError: bad arguments (both or neither of tokenizer / vocab_size, val_fraction outside (0, 1)).
        MiniGPTError: unusable source, a split that would be empty, ``workers`` < 1, a negative
            ``tokenizer_sample_bytes``, another prepare writing to ``out_dir``, or a worker process that died.

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
    src = resolve_source(source)
    sep = effective_sep(src, doc_sep)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text_size = src.path.stat().st_size if src.kind == "text" else None  # for progress totals only
    started = time.perf_counter()

    def labeled() -> Iterator[Tuple[str, Piece]]:
        return labeled_pieces(src, sep, val_fraction, seed, chunk_bytes)

    with _DirLock(out) as lock:
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

        (out / META_FILE).unlink(missing_ok=True)
        tok_path = tok.save(out)  # also what the worker processes load
        for stale in (HF_FILE, SP_FILE):  # Tokenizer.from_dir prefers tokenizer.json: never leave an old one behind
            if stale != tok_path.name:
                (out / stale).unlink(missing_ok=True)

        sha256 = tok.sha256  # (cached) hashing a large vocabulary's JSON peaks at a few MB: not on top of the pass
        tokenize_start = time.perf_counter()
        writers: Dict[str, _SplitWriter] = {}
        bar = _Progress(progress, "tokenizing", text_size)
        pipe = _TokenizePipeline(tok, tok_path, eot, dtype, workers, writers, bar)
        try:
            for s in SPLITS:
                writers[s] = _SplitWriter(out / f"{s}.bin", dtype)
            say(f"tokenizing {src.name}")
            for split, piece in labeled():
                pipe.add(split, piece)
            pipe.finish()
            for w in writers.values():
                w.close()
            for split in SPLITS:
                if writers[split].documents == 0:
                    raise MiniGPTError(_empty_split_message(src, sep, split, val_fraction))
            for w in writers.values():
                w.commit()
        finally:
            pipe.shutdown()
            bar.close()
            for w in writers.values():
                w.discard()
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


def _tokenize_job(tok: Tokenizer, eot: int, dtype: np.dtype, texts: List[str], ends: List[bool]) -> Tuple[bytes, int]:
    """Token ids of one job as raw ``dtype`` bytes (end-of-text after each document end), and its UTF-8 bytes."""
    ids: List[int] = []
    for piece_ids, end in zip(tok.encode_batch(texts), ends):
        ids.extend(piece_ids)
        if end:
            ids.append(eot)
    return np.asarray(ids, dtype=dtype).tobytes(), sum(len(t.encode("utf-8")) for t in texts)


_worker_tokenizer: Optional[Tokenizer] = None


def _worker_init(tok_path: str, parent_pid: int) -> None:
    """Initializer of a tokenizer worker process: load the tokenizer once, and exit when the parent dies."""
    global _worker_tokenizer
    # Ctrl-C reaches the whole process group; only the main process decides to stop (it shuts the pool down).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The processes are the parallelism: a Rust thread pool in every worker would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = Tokenizer.from_file(tok_path)
    # A worker holds a write end of its own task queue, so a parent killed by SIGKILL (or OOM) would leave it
    # blocked on that queue forever, ~300 MB each: watch for re-parenting instead.
    import threading

    def watch_parent() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch_parent, name="minigpt-parent-watch", daemon=True).start()


def _worker_job(eot: int, dtype: str, texts: List[str], ends: List[bool]) -> Tuple[bytes, int]:
    return _tokenize_job(_worker_tokenizer, eot, np.dtype(dtype), texts, ends)


class _TokenizePipeline:
    """Batches pieces into jobs of about ``_JOB_CHARS`` characters, tokenizes them in this process or in a pool of
    ``workers`` spawned processes, and appends each job's ids to its split's writer in submission order.

    Results are consumed oldest first, so the files are byte-identical whatever the number of workers; at most
    ``2 * workers`` jobs are in flight (enough to keep every worker busy while the main process reads), so memory
    does not depend on the corpus size. The pool starts only after ``_INPROCESS_CHARS`` characters, all tokenized
    in process by then, which keeps the order.
    """

    def __init__(self, tok: Tokenizer, tok_path: Path, eot: int, dtype: np.dtype, workers: int,
                 writers: Dict[str, "_SplitWriter"], progress: "_Progress"):
        self.tok, self.tok_path, self.eot, self.dtype, self.workers = tok, tok_path, eot, dtype, workers
        self.writers, self.progress = writers, progress
        self.pending: Dict[str, Tuple[List[str], List[bool]]] = {s: ([], []) for s in SPLITS}
        self.pending_chars = {s: 0 for s in SPLITS}
        self.in_flight: "collections.deque" = collections.deque()
        self.executor: Any = None
        self.submitted_chars = 0
        self.pool_started = False

    def add(self, split: str, piece: Piece) -> None:
        texts, ends = self.pending[split]
        texts.append(piece.text)
        ends.append(piece.doc_end)
        self.writers[split].documents += piece.doc_end
        self.pending_chars[split] += len(piece.text)
        if self.pending_chars[split] >= _JOB_CHARS:
            self._submit(split)

    def finish(self) -> None:
        """Submit the partial jobs and write every outstanding result."""
        for split in SPLITS:
            self._submit(split)
        while self.in_flight:
            self._collect()

    def shutdown(self) -> None:
        """Stop the workers; jobs not yet started are cancelled (used on success and on errors alike)."""
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.executor = None

    def _submit(self, split: str) -> None:
        texts, ends = self.pending[split]
        if not texts:
            return
        self.submitted_chars += self.pending_chars[split]
        self.pending[split], self.pending_chars[split] = ([], []), 0
        if self.workers == 1 or (self.executor is None and self.submitted_chars <= _INPROCESS_CHARS):
            self._write(split, _tokenize_job(self.tok, self.eot, self.dtype, texts, ends))
            return
        if self.executor is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # spawn, not fork: the parent may hold threads (the tokenizers thread pool, torch, datasets' fsspec),
            # and forking a threaded process can deadlock a child on a lock some other thread held.
            self.executor = ProcessPoolExecutor(max_workers=self.workers, initializer=_worker_init,
                                                initargs=(str(self.tok_path), os.getpid()),
                                                mp_context=multiprocessing.get_context("spawn"))
            self.pool_started = True
        while len(self.in_flight) >= 2 * self.workers:
            self._collect()
        self.in_flight.append((split, self.executor.submit(_worker_job, self.eot, self.dtype.str, texts, ends)))

    def _collect(self) -> None:
        from concurrent.futures.process import BrokenProcessPool

        split, future = self.in_flight.popleft()
        try:
            result = future.result()
        except BrokenProcessPool as e:
            raise MiniGPTError(f"a tokenizer worker process died ({one_line(e)}); if it ran out of memory, re-run "
                               f"with fewer workers (--workers); a script that calls prepare() with workers > 1 "
                               f"must do so under `if __name__ == '__main__':` (workers are spawned)") from e
        self._write(split, result)

    def _write(self, split: str, result: Tuple[bytes, int]) -> None:
        blob, n_bytes = result
        self.writers[split].append(blob, n_bytes)
        self.progress.update(n_bytes)


class _SplitWriter:
    """One split's token file: ids are appended to a temporary file that :meth:`commit` renames into place."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype = path, dtype
        self.tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        self.file = open(self.tmp, "wb")
        self.tokens = self.bytes = self.documents = 0

    def append(self, blob: bytes, n_bytes: int) -> None:
        self.file.write(blob)
        self.tokens += len(blob) // self.dtype.itemsize
        self.bytes += n_bytes

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())  # data on disk before the rename publishes the name
        self.file.close()

    def commit(self) -> None:
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.tmp.unlink(missing_ok=True)


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
        try:
            import fcntl
        except ImportError:
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
        raise MiniGPTError(f"cannot read {path}: {one_line(e)}; re-run `minigpt prepare`") from e


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
