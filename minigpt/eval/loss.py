"""Validation loss: the mean next-token cross-entropy (nats/token) of a model over fixed windows of held-out
tokens. The one implementation behind the trainer's evaluations (:func:`minigpt.train.trainer.evaluate`, which
shards the windows over ranks and sums across them) and the benchmarks' perplexities
(:func:`minigpt.analysis.bench.reports.quant_report`).

Perplexity is ``exp(loss)``; bits per byte is :func:`minigpt.data.loader.bits_per_byte`.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager, Optional

import numpy as np
import torch

from minigpt.data.loader import eval_windows
from minigpt.model.transformer import lm_loss


@torch.no_grad()
def loss_sum(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int,
             autocast: Optional[ContextManager] = None, device: Optional[torch.device] = None) -> tuple[float, int]:
    """Summed next-token loss (nats) and the number of tokens scored, over windows ``x``, ``y``
    ``[n_windows, seq_len]`` (``y`` the targets of ``x``), ``batch_size`` windows per forward.

    The model runs in eval mode (no dropout) and goes back to its previous mode afterwards. ``autocast``: a
    reusable context entered around each forward (mixed precision), ``device``: where the windows are moved to.
    The per-batch mean (:func:`minigpt.model.transformer.lm_loss`, float32) is weighted by its token count, so
    the sum does not depend on ``batch_size`` beyond rounding; callers divide, or first add up the sums of
    several ranks.
    """
    was_training = model.training
    model.eval()
    ctx = autocast if autocast is not None else nullcontext()
    total, count = 0.0, 0
    for i in range(0, x.shape[0], batch_size):
        xb, yb = x[i:i + batch_size], y[i:i + batch_size]
        if device is not None:
            xb, yb = xb.to(device), yb.to(device)
        with ctx:
            total += lm_loss(model(xb), yb).item() * yb.numel()
        count += yb.numel()
    model.train(was_training)
    return total, count


def validation_loss(model: torch.nn.Module, tokens: torch.Tensor | np.ndarray, seq_len: int,
                    max_windows: Optional[int] = None, batch: int = 8) -> float:
    """Mean next-token loss (nats/token) of ``model`` over non-overlapping windows of ``seq_len`` tiling the 1-D
    token array ``tokens`` (every token scored once; at most ``max_windows`` windows, evenly spaced, as
    :func:`minigpt.data.loader.eval_windows` picks them), ``batch`` windows per forward.

    Raises:
        ValueError: fewer than ``seq_len + 1`` tokens.
    """
    array = tokens.numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    n = (len(array) - 1) // seq_len
    x, y = eval_windows(array, seq_len, min(n, max_windows or n))
    total, count = loss_sum(model, x, y, batch)
    return total / count
