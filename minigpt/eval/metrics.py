"""Per-item metrics and their aggregation, with lm-evaluation-harness's definitions (``lm_eval/api/metrics.py``,
``lm_eval/api/task.py`` ``ConfigurableTask.process_results``, lm-eval 0.4).

* ``acc``: the choice with the highest log-likelihood is the gold one; ``acc_norm``: the highest log-likelihood
  divided by the choice's length in characters (``len(choice)``, the choice string without the target delimiter;
  Gao et al., lm-eval). Ties go to the first choice (``numpy.argmax``).
* the standard error of a mean is ``sample_std / sqrt(n)`` (``mean_stderr``; ``n - 1`` in the variance); None for
  fewer than two items.
* LAMBADA's ``perplexity`` is ``exp(-mean(loglikelihood of the target word))`` over passages; its stderr here is
  the delta-method ``perplexity * stderr(loglikelihoods)`` (lm-eval bootstraps it instead).
* rolling log-likelihood (``bpb:PATH``): ``word_perplexity = exp(-sum ll / words)``, ``byte_perplexity =
  exp(-sum ll / bytes)``, ``bits_per_byte = -sum ll / bytes / ln 2`` (words: ``re.split(r"\\s+", text)``, bytes:
  UTF-8), plus ``token_perplexity = exp(-sum ll / tokens)``.
* a group (CMMLU) is the size-weighted mean of its tasks, with the pooled standard error
  ``sqrt(sum((n_i - 1) * se_i^2 * n_i) / (sum n_i - k) / sum n_i)`` (``pooled_sample_stderr``).
"""
from __future__ import annotations

import math
import re
from typing import Optional, Sequence


def argmax(values: Sequence[float]) -> int:
    """Index of the largest value, the first one on ties (as ``numpy.argmax``)."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def multiple_choice_metrics(lls: Sequence[float], choices: Sequence[str], gold: int) -> dict[str, float]:
    """``acc`` and ``acc_norm`` (0.0 or 1.0) of one item from its choices' log-likelihoods."""
    normed = [ll / len(choice) for ll, choice in zip(lls, choices)]
    return {"acc": float(argmax(lls) == gold), "acc_norm": float(argmax(normed) == gold)}


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def mean_stderr(values: Sequence[float]) -> Optional[float]:
    """Standard error of the mean, ``sample_std / sqrt(n)``; None when ``n < 2``."""
    n = len(values)
    if n < 2:
        return None
    mu = mean(values)
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (n - 1)) / math.sqrt(n)


def perplexity(lls: Sequence[float]) -> tuple[float, Optional[float]]:
    """``(exp(-mean(lls)), delta-method stderr)`` of per-item log-likelihoods (nats)."""
    value = math.exp(-mean(lls))
    se = mean_stderr(lls)
    return value, None if se is None else value * se


def rolling_metrics(ll: float, n_tokens: int, text: str) -> dict[str, float]:
    """Perplexities and bits per byte of a text whose rolling log-likelihood is ``ll`` nats over ``n_tokens``."""
    n_bytes = len(text.encode("utf-8"))
    n_words = len(re.split(r"\s+", text))
    return {"word_perplexity": math.exp(-ll / n_words), "byte_perplexity": math.exp(-ll / n_bytes),
            "bits_per_byte": -ll / n_bytes / math.log(2), "token_perplexity": math.exp(-ll / n_tokens)}


def pooled_stderr(stderrs: Sequence[float], sizes: Sequence[int]) -> Optional[float]:
    """Standard error of a size-weighted mean of ``k`` subtask means (lm-eval's ``pooled_sample_stderr``)."""
    if len(sizes) < 1 or sum(sizes) <= len(sizes):
        return None
    var = sum((n - 1) * se ** 2 * n for se, n in zip(stderrs, sizes)) / (sum(sizes) - len(sizes))
    return math.sqrt(var / sum(sizes))
