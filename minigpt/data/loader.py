"""Reading prepared data: the meta of a prepared directory, its token splits as memory maps, training batches
(:class:`BatchSampler`), the fixed evaluation windows and bits per byte.

A prepared directory (written by :func:`minigpt.data.prepare.prepare`) holds ``train.bin`` and ``val.bin``, raw
little-endian numpy arrays of token ids (uint16 when the vocabulary fits, else uint32) with every document followed
by the end-of-text id, and ``meta.json`` (dtype, token and byte counts per split). Windows are cut anywhere, across
document boundaries, as in nanoGPT / GPT-2 training.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Tuple

import numpy as np
import torch

from minigpt.data.sources import SPLITS, PathLike
from minigpt.errors import MiniGPTError, json_loads, one_line

META_FILE = "meta.json"


# ================================================================================================ loading
def load_meta(data_dir: PathLike) -> Dict[str, Any]:
    """Read ``data_dir/meta.json`` as written by :func:`minigpt.data.prepare.prepare`.

    Raises:
        MiniGPTError: directory or meta.json missing / unreadable (the message says to run ``minigpt prepare``).
    """
    d = Path(data_dir)
    path = d / META_FILE
    if not path.is_file():
        what = "does not exist" if not d.exists() else f"has no {META_FILE}"
        raise MiniGPTError(f"data directory {d} {what}: create it with `minigpt prepare`")
    try:
        return json_loads(path.read_text(encoding="utf-8"))
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
