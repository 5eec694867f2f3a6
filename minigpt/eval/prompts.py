"""Few-shot prompts and log-likelihood requests, laid out exactly as lm-evaluation-harness lays them out.

From ``lm_eval/api/task.py`` (``ConfigurableTask.fewshot_context``, ``build_qa_turn``, ``construct_requests``) and
``lm_eval/api/samplers.py`` (``ContextSampler``, ``FirstNSampler``), lm-eval 0.4:

* a shot is ``text + target_delimiter + answer + fewshot_delimiter`` (``" "`` and ``"\\n\\n"`` by default), the
  answer being ``choices[target]`` or the target string; for multiple-input tasks (WinoGrande) the shot's text is
  its gold context ``choices[text]``;
* the prompt is ``description + shots + text``; each choice is then a request ``(prompt, target_delimiter +
  choice)``; multiple-input tasks make one request ``(prompt_i, target_delimiter + target)`` per context, and
  ``loglikelihood`` tasks (LAMBADA) one request ``(prompt, target)`` with no delimiter (so a LAMBADA shot,
  ``text + " " + " word"``, has two spaces, as in lm-eval);
* shots are drawn by one ``random.Random(seed)`` per task (seed 1234: lm-eval's ``fewshot_random_seed``) that
  every evaluated item draws from in turn, ``rnd.sample(pool, k)``; when the pool is the evaluated split,
  ``rnd.sample(pool, k + 1)`` minus the evaluated record, first ``k`` kept; the ``first_n`` sampler takes the first
  ``k`` records in order.
"""
from __future__ import annotations

import random
from typing import Optional

from minigpt.errors import MiniGPTError
from minigpt.eval.tasks import LOGLIKELIHOOD, Item, Task

FEWSHOT_SEED = 1234


class FewshotSampler:
    """Draws the ``k`` shots of each evaluated item from ``pool``, in lm-eval's order of random calls.

    One sampler per task, called once per evaluated item in order: the shots of item ``i`` depend on the draws
    for items ``0 .. i-1``, as in lm-eval (whose ``--limit`` keeps the first items, so a limited run sees the same
    shots as the head of a full one).
    """

    def __init__(self, task: Task, pool: list[Item], seed: int = FEWSHOT_SEED) -> None:
        self.task = task
        self.pool = pool
        self.rnd = random.Random(seed)

    def sample(self, k: int, item: Item) -> list[Item]:
        """The ``k`` shots for ``item``. Raises :class:`MiniGPTError` when the pool holds fewer than ``k`` records."""
        if k == 0:
            return []
        pool, task = self.pool, self.task
        exclude = task.exclude_eval_item
        available = len(pool) - (sum(1 for x in pool if x.raw == item.raw) if exclude else 0)
        if k > available:
            raise MiniGPTError(f"--num-fewshot {k} is more than the {available} few-shot examples of {task.name}")
        if task.first_n:
            return [x for x in pool if not (exclude and x.raw == item.raw)][:k]
        if not exclude:
            # random.sample picks by index from len(pool) alone, so sampling indices draws what lm-eval draws.
            return [pool[i] for i in self.rnd.sample(range(len(pool)), k)]
        drawn = [pool[i] for i in self.rnd.sample(range(len(pool)), min(k + 1, len(pool)))]
        shots = [x for x in drawn if x.raw != item.raw][:k]
        if len(shots) < k:  # duplicates of the evaluated record were drawn: lm-eval redraws from the rest
            rest = [x for x in pool if x.raw != item.raw]
            shots = [rest[i] for i in self.rnd.sample(range(len(rest)), k)]
        return shots


def shot_text(task: Task, shot: Item) -> str:
    """One solved example: question, target delimiter, answer, few-shot delimiter."""
    if task.multiple_input:
        question, answer = shot.choices[shot.text], shot.target
    else:
        question = shot.text
        answer = shot.choices[shot.target] if shot.choices and isinstance(shot.target, int) else shot.target
    return question + task.target_delimiter + answer + task.fewshot_delimiter


def fewshot_prefix(task: Task, shots: list[Item]) -> str:
    """The task description followed by the solved shots: everything of a prompt before the evaluated item."""
    return task.description + "".join(shot_text(task, s) for s in shots)


def build_requests(task: Task, item: Item, shots: Optional[list[Item]] = None) -> list[tuple[str, str]]:
    """The ``(context, continuation)`` requests of one item: one per choice (multiple choice), or one (LAMBADA)."""
    prefix = fewshot_prefix(task, shots or [])
    if task.output_type == LOGLIKELIHOOD:
        return [(prefix + item.text, item.target)]
    if task.multiple_input:
        return [(prefix + context, task.target_delimiter + item.target) for context in item.choices]
    return [(prefix + item.text, task.target_delimiter + choice) for choice in item.choices]


def gold_index(task: Task, item: Item) -> int:
    """The index of the correct request among :func:`build_requests`' (multiple choice only)."""
    return item.text if task.multiple_input else item.target
