"""Parallel tokenization for :func:`minigpt.data.prepare.prepare`: pieces of text in, token files out, in order.

Pieces are batched into jobs of 256 Ki characters and tokenized in ``workers`` processes (``concurrent.futures``
with the ``spawn`` start method, the tokenizer loaded once per worker from the ``tokenizer.json`` already written to
the output directory), or in this process when ``workers`` is 1 and for the first 4 MiB of text. At most
``2 * workers`` jobs are in flight and their results are appended in submission order, so memory does not grow with
the corpus and the token files are byte-identical for every number of workers. Each split's ids go to a temporary
file (:class:`SplitWriter`) that is fsync'ed and renamed into place only when the whole run succeeded.
"""
from __future__ import annotations

import collections
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from minigpt.data.sources import SPLITS, Piece
from minigpt.errors import MiniGPTError, one_line
from minigpt.tokenizer.tokenizer import Tokenizer

# Characters of text per tokenization job. Each job costs a few ms of pickling and IPC against ~0.1 s of BPE work;
# larger jobs only raise every worker's peak RSS (the back end's per-token Encoding objects): 1 MiB jobs peaked
# ~55 MB higher per process than 256 KiB ones, at the same throughput.
_JOB_CHARS = 1 << 18
# Text tokenized in the main process before the worker pool is started: a small corpus (a few MB, e.g. Shakespeare)
# is done before spawned workers would have finished importing (about 3 s each, for torch via the package).
_INPROCESS_CHARS = 4 << 20


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
    def watch_parent() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch_parent, name="minigpt-parent-watch", daemon=True).start()


def _worker_job(eot: int, dtype: str, texts: List[str], ends: List[bool]) -> Tuple[bytes, int]:
    return _tokenize_job(_worker_tokenizer, eot, np.dtype(dtype), texts, ends)


class TokenizePipeline:
    """Batches pieces into jobs of about ``_JOB_CHARS`` characters, tokenizes them in this process or in a pool of
    ``workers`` spawned processes, and appends each job's ids to its split's writer in submission order.

    Results are consumed oldest first, so the files are byte-identical whatever the number of workers; at most
    ``2 * workers`` jobs are in flight (enough to keep every worker busy while the main process reads), so memory
    does not depend on the corpus size. The pool starts only after ``_INPROCESS_CHARS`` characters, all tokenized
    in process by then, which keeps the order.

    ``writers``: a :class:`SplitWriter` per split; ``progress``: anything with ``update(n_bytes)``, told the UTF-8
    bytes of text of every job written.
    """

    def __init__(self, tok: Tokenizer, tok_path: Path, eot: int, dtype: np.dtype, workers: int,
                 writers: Dict[str, "SplitWriter"], progress: Any):
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


class SplitWriter:
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
