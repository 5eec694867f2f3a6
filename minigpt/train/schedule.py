"""Learning-rate schedule: linear warmup, then cosine decay to ``min_lr`` (Loshchilov & Hutter 2017, SGDR;
the warmup + cosine recipe of GPT-3 and Llama, with ``min_lr = 0.1 * lr`` as in Llama 2)."""
from __future__ import annotations

import math


def warmup_cosine_lr(step: int, *, lr: float, min_lr: float, warmup_steps: int, progress: float) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    During warmup (``step < warmup_steps``) it rises linearly to ``lr``, reaching ``lr`` at ``step ==
    warmup_steps - 1``. Afterwards ``progress`` in ``[0, 1]`` is the fraction of the decay phase done and the rate
    is ``min_lr + 0.5 * (1 + cos(pi * progress)) * (lr - min_lr)``: ``lr`` at 0, the mean at 0.5, ``min_lr`` at 1
    (and beyond).
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(max(progress, 0.0), 1.0)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def decay_progress(step: int, warmup_steps: int, max_steps: int | None,
                   elapsed: float = 0.0, warmup_end_time: float | None = None,
                   max_time: float | None = None) -> float:
    """Fraction of the cosine phase completed, by steps (``max_steps``) and/or by wall-clock (``max_time`` s).

    With both budgets the larger fraction wins, so the schedule reaches ``min_lr`` when the first budget runs out.
    A time budget makes the schedule depend on the machine's speed; a step budget alone keeps runs reproducible.
    """
    fractions = []
    if max_steps:
        fractions.append((step - warmup_steps) / max(1, max_steps - warmup_steps))
    if max_time and warmup_end_time is not None:
        fractions.append((elapsed - warmup_end_time) / max(1e-9, max_time - warmup_end_time))
    return max(fractions) if fractions else 0.0
