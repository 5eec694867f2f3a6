"""``minigpt eval``: run benchmark tasks on a model and report lm-evaluation-harness-style results.

:func:`evaluate` takes a loaded model and tokenizer; :func:`evaluate_source` loads any model source first
(MiniGPT checkpoint or run directory, Hugging Face directory, GGUF or llama2.c file). The result is a dict in the
layout of lm-eval's ``--output_path`` JSON: ``results -> task -> "acc,none", "acc_stderr,none", "acc_norm,none",
...``, plus ``groups``, ``group_subtasks``, ``n-shot``, ``n-samples``, ``higher_is_better``, ``config``, and our
``chance`` (the accuracy of guessing, per task), ``truncated`` (per task, how many items had a request longer than
the model's context window, scored left-truncated as lm-eval does: ``{"items": n, "continuation_too_long": m}``,
``m`` counting those whose continuation alone did not fit, see :mod:`minigpt.eval.scoring`) and, when asked,
per-item ``samples``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from minigpt.checkpoint.native import load_tokenizer, resolve_checkpoint
from minigpt.checkpoint.tokenizer_bos import adds_bos
from minigpt.errors import MiniGPTError
from minigpt.eval import metrics
from minigpt.eval.prompts import FEWSHOT_SEED, FewshotSampler, build_requests, gold_index
from minigpt.eval.scoring import Scorer
from minigpt.eval.tasks import DEFAULT_DATA_DIR, LOGLIKELIHOOD, ROLLING, Task, load_items, resolve_tasks
from minigpt.infer.fastpath import load_for_inference
from minigpt.runtime import DTYPES, pick_device


@dataclass
class TaskRun:
    """One task's outcome: lm-eval-style metric entries, chance accuracy (None: not an accuracy task), per-item
    records, the number of items in its file (a ``bpb:`` file is one document) and of requests scored."""

    entries: dict
    chance: Optional[float]
    records: list
    n_total: int
    n_requests: int  # log-likelihood requests (bpb: rolling windows)
    truncated: int = 0  # items with a request left-truncated to the context window
    continuation_too_long: int = 0  # items with a continuation longer than the window by itself


HIGHER_IS_BETTER = {"acc": True, "acc_norm": True, "perplexity": False, "word_perplexity": False,
                    "byte_perplexity": False, "bits_per_byte": False, "token_perplexity": False}


def evaluate_source(source, tasks: list[str], device: str = "auto", dtype: Optional[str] = None,
                    fast: bool = True, bos: Optional[bool] = None, **kwargs) -> dict:
    """Load ``source`` (:func:`minigpt.checkpoint.native.resolve_checkpoint`) and run :func:`evaluate`.

    ``bos``: prepend BOS to every encoding; None follows the tokenizer's own default
    (:func:`minigpt.checkpoint.tokenizer_bos.adds_bos`). ``dtype``: float32 (default) / bfloat16 / float16.
    """
    path = resolve_checkpoint(source)
    model = load_for_inference(path, device=pick_device(device), dtype=DTYPES[dtype or "float32"], fast=fast)
    tokenizer = load_tokenizer(path)
    add_bos = adds_bos(path, tokenizer) if bos is None else bos
    out = evaluate(model, tokenizer, tasks, add_bos=add_bos, **kwargs)
    out["config"].update(model=str(source), dtype=dtype or "float32", fast=fast)
    return out


def evaluate(model, tokenizer, tasks: list[str], num_fewshot: int = 0, limit: Optional[int] = None,
             batch_size: int = 16, data_dir=None, add_bos: bool = False, reuse_prefix: bool = True,
             seed: int = FEWSHOT_SEED, samples: bool = False, log: Optional[Callable[[str], None]] = None) -> dict:
    """Evaluate ``model`` (FastPath or Transformer) on ``tasks`` (names, groups or ``bpb:PATH``).

    ``num_fewshot``: shots per prompt, drawn with ``random.Random(seed)`` (:mod:`minigpt.eval.prompts`);
    ``limit``: the first N items of each task (for ``bpb:PATH``, the first N lines); ``data_dir``: folder of the
    benchmark JSONL files (default ``../shared/data/eval``); ``samples``: keep per-item requests, log-likelihoods
    and metrics under ``"samples"``; ``log``: called with one progress line per task.

    Raises :class:`MiniGPTError` for unknown tasks, missing or malformed data, or too few few-shot examples.
    """
    if num_fewshot < 0:
        raise MiniGPTError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    if limit is not None and limit < 1:
        raise MiniGPTError(f"--limit must be at least 1, got {limit}")
    task_list, groups = resolve_tasks(tasks)
    data_dir = Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR
    scorer = Scorer(model, tokenizer, add_bos=add_bos, batch_size=batch_size, reuse_prefix=reuse_prefix)
    out: dict = {"results": {}, "groups": {}, "group_subtasks": dict(groups), "n-shot": {}, "n-samples": {},
                 "higher_is_better": {}, "chance": {}, "truncated": {}, "samples": {},
                 "config": {"num_fewshot": num_fewshot, "limit": limit, "batch_size": batch_size, "bos": add_bos,
                            "fewshot_seed": seed, "data_dir": str(data_dir)}}
    cache: dict = {}
    started = time.perf_counter()
    for task in task_list:
        t0 = time.perf_counter()
        if task.output_type == ROLLING:
            run = _rolling_task(scorer, task, limit)
        else:
            run = _scored_task(scorer, task, data_dir, num_fewshot, limit, seed, cache)
        out["results"][task.name] = {"alias": task.name, **run.entries}
        out["chance"][task.name] = run.chance
        out["truncated"][task.name] = {"items": run.truncated, "continuation_too_long": run.continuation_too_long}
        out["n-shot"][task.name] = 0 if task.output_type == ROLLING else num_fewshot
        out["n-samples"][task.name] = {"original": run.n_total, "effective": len(run.records)}
        out["higher_is_better"][task.name] = {m: HIGHER_IS_BETTER[m] for m in task.metrics}
        if samples:
            out["samples"][task.name] = run.records
        if log:
            log(f"{task.name}: {len(run.records)} items, {run.n_requests} requests, "
                f"{time.perf_counter() - t0:.1f} s")
            if run.truncated:
                log(truncation_note(task.name, run.truncated, run.continuation_too_long, scorer.max_length))
    for group, members in groups.items():
        out["groups"][group] = out["results"][group] = _group_metrics(group, out, members)
        out["chance"][group] = sum(out["chance"][m] * out["n-samples"][m]["effective"] for m in members) / max(
            1, sum(out["n-samples"][m]["effective"] for m in members))
        out["n-shot"][group] = num_fewshot
        out["truncated"][group] = {k: sum(out["truncated"][m][k] for m in members) for k in out["truncated"][members[0]]}
        out["higher_is_better"][group] = out["higher_is_better"][members[0]]
    if not samples:
        del out["samples"]
    out["total_evaluation_time_seconds"] = f"{time.perf_counter() - started:.2f}"
    return out


def truncation_note(task: str, items: int, continuation_too_long: int, max_length: int) -> str:
    """The one line telling how many of a task's items did not fit the context window."""
    note = (f"{task}: {items} item(s) longer than the model's {max_length}-token context, scored left-truncated "
            "as lm-eval does")
    if continuation_too_long:
        note += (f"; in {continuation_too_long} a choice alone is longer (lm-eval would stop there), only its last "
                 f"{max_length} tokens scored")
    return note


def _metric_entries(values: dict[str, float], stderrs: dict[str, Optional[float]]) -> dict:
    """lm-eval's result keys: ``"acc,none"`` and ``"acc_stderr,none"`` ("N/A" when undefined)."""
    entries = {}
    for name, value in values.items():
        entries[f"{name},none"] = value
        if name in stderrs:
            entries[f"{name}_stderr,none"] = "N/A" if stderrs[name] is None else stderrs[name]
    return entries


def _scored_task(scorer: Scorer, task: Task, data_dir: Path, num_fewshot: int, limit, seed, cache) -> TaskRun:
    """A multiple-choice or LAMBADA-style task: its items scored, with metrics and records."""
    items = load_items(task, data_dir / task.eval_file, cache)
    if not items:
        raise MiniGPTError(f"{data_dir / task.eval_file} holds no records for task {task.name}")
    n_total = len(items)
    items = items[:limit] if limit else items
    pool = []
    if num_fewshot:
        pool = load_items(task, data_dir / (task.fewshot_file or task.eval_file), cache)
    sampler = FewshotSampler(task, pool, seed)
    requests = [build_requests(task, item, sampler.sample(num_fewshot, item)) for item in items]
    scores = scorer.loglikelihood(requests)
    records, per_metric = [], {m: [] for m in task.metrics}
    for i, (item, reqs, item_scores) in enumerate(zip(items, requests, scores)):
        lls = [s.loglikelihood for s in item_scores]
        if task.output_type == LOGLIKELIHOOD:
            values = {"perplexity": lls[0], "acc": float(item_scores[0].is_greedy)}
        else:
            values = metrics.multiple_choice_metrics(lls, item.choices, gold_index(task, item))
        values = {m: values[m] for m in task.metrics}
        for m, v in values.items():
            per_metric[m].append(v)
        target = item.target if task.output_type == LOGLIKELIHOOD else gold_index(task, item)
        records.append({"doc_id": i, "line": item.line, "target": target, "arguments": [list(r) for r in reqs],
                        "loglikelihoods": lls, "is_greedy": [s.is_greedy for s in item_scores],
                        "truncated": any(s.truncated for s in item_scores), **values})
    values, stderrs = {}, {}
    for m, xs in per_metric.items():
        if m == "perplexity":
            values[m], stderrs[m] = metrics.perplexity(xs)
        else:
            values[m], stderrs[m] = metrics.mean(xs), metrics.mean_stderr(xs)
    chance = 0.0 if task.output_type == LOGLIKELIHOOD else metrics.mean([1 / len(it.choices) for it in items])
    truncated = sum(any(s.truncated for s in item_scores) for item_scores in scores)
    too_long = sum(any(s.continuation_truncated for s in item_scores) for item_scores in scores)
    return TaskRun(_metric_entries(values, stderrs), chance, records, n_total, sum(len(r) for r in requests),
                   truncated, too_long)


def _rolling_task(scorer: Scorer, task: Task, limit) -> TaskRun:
    """``bpb:PATH``: the file (its first ``limit`` lines) as one document, scored in rolling windows."""
    path = Path(task.eval_file)
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except (OSError, UnicodeDecodeError) as e:
        raise MiniGPTError(f"{task.name}: cannot read {path} ({type(e).__name__}: {e})") from None
    text = "".join(lines[:limit] if limit else lines)
    if not text.strip():
        raise MiniGPTError(f"{task.name}: {path} is empty")
    (score,) = scorer.loglikelihood_rolling([text])
    values = metrics.rolling_metrics(score.loglikelihood, score.n_tokens, text)
    record = {"doc_id": 0, "loglikelihood": score.loglikelihood, "tokens": score.n_tokens,
              "bytes": len(text.encode("utf-8")), **values}
    windows = -(-score.n_tokens // scorer.max_length)
    return TaskRun(_metric_entries(values, {}), None, [record], 1, windows)


def _group_metrics(group: str, out: dict, members: list[str]) -> dict:
    """Size-weighted mean and pooled stderr of each metric over a group's tasks."""
    entries = {"alias": group}
    sizes = [out["n-samples"][m]["effective"] for m in members]
    for key in out["results"][members[0]]:
        if not key.endswith(",none") or "_stderr," in key:
            continue
        name = key[:-len(",none")]
        values = [out["results"][m][key] for m in members]
        entries[key] = sum(v * n for v, n in zip(values, sizes)) / sum(sizes)
        stderrs = [out["results"][m].get(f"{name}_stderr,none") for m in members]
        usable = all(isinstance(s, float) for s in stderrs)
        se = metrics.pooled_stderr(stderrs, sizes) if usable else None
        entries[f"{name}_stderr,none"] = "N/A" if se is None else se
    return entries
