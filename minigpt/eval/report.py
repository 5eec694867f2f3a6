"""Human-readable views of an evaluation: a markdown table, and a report folder with a bar chart.

Both read the results dict of :func:`minigpt.eval.runner.evaluate` (lm-eval's layout). A reference results JSON
(ours, or lm-eval's own ``--output_path`` file) can be shown beside it; its tasks are matched by name, ignoring a
``minigpt_`` prefix (the names of our lm-eval task YAMLs).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from minigpt.errors import MiniGPTError
from minigpt.paths import write_text_atomic

ACCURACY_METRICS = ("acc", "acc_norm")


def _fmt(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _rows(out: dict, task: str):
    """``(metric, value, stderr)`` for each metric of one task's results."""
    entry = out["results"].get(task, {})
    for key, value in entry.items():
        if key.endswith(",none") and "_stderr," not in key:
            name = key[:-len(",none")]
            yield name, value, entry.get(f"{name}_stderr,none", "")


def _shown_tasks(out: dict, with_subtasks: bool) -> list[str]:
    members = {m for ms in out.get("group_subtasks", {}).values() for m in ms}
    return [t for t in out["results"] if with_subtasks or t not in members]


def results_table(out: dict, with_subtasks: bool = False, reference: Optional[dict] = None) -> str:
    """A markdown table: task, shots, metric, value, stderr, chance (accuracy metrics) and, with ``reference``,
    the reference's value. Subtasks of a group are left out unless ``with_subtasks``."""
    header = ["Task", "n-shot", "Metric", "Value", "± Stderr", "Chance"] + (["Reference"] if reference else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for task in _shown_tasks(out, with_subtasks):
        for metric, value, stderr in _rows(out, task):
            chance = out.get("chance", {}).get(task) if metric in ACCURACY_METRICS else None
            cells = [task, str(out.get("n-shot", {}).get(task, "")), metric, _fmt(value), _fmt(stderr),
                     "" if chance is None else _fmt(float(chance))]
            if reference:
                ref = reference_value(reference, task, metric)
                cells.append("" if ref is None else _fmt(ref))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def reference_value(reference: dict, task: str, metric: str) -> Optional[float]:
    """``metric`` of ``task`` in a reference results dict (task names with or without a ``minigpt_`` prefix)."""
    for name in (task, f"minigpt_{task}"):
        entry = reference.get("results", {}).get(name)
        if entry and isinstance(entry.get(f"{metric},none"), (int, float)):
            return float(entry[f"{metric},none"])
    return None


def write_report(out: dict, directory, reference: Optional[dict] = None) -> Path:
    """Write ``results.md`` (every task and subtask, the run's settings) and ``results.png`` (one bar per task:
    ``acc_norm`` where reported, else ``acc``, with its standard error, a dash at chance level and, with
    ``reference``, the reference's bar beside it) into ``directory``. Returns the folder.

    Raises :class:`MiniGPTError` when the folder cannot be written.
    """
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        config = ", ".join(f"{k}={v}" for k, v in out.get("config", {}).items())
        text = f"# Evaluation\n\n{config}\n\n{results_table(out, True, reference)}\n\n![results](results.png)\n"
        write_text_atomic(directory / "results.md", text)
        _bar_chart(out, directory / "results.png", reference)
    except OSError as e:
        raise MiniGPTError(f"cannot write the report into {directory}: {e}") from None
    return directory


def _bar_chart(out: dict, path: Path, reference: Optional[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = []  # (task, metric, value, stderr, chance, reference)
    for task in _shown_tasks(out, with_subtasks=False):
        values = {m: (v, s) for m, v, s in _rows(out, task)}
        metric = next((m for m in ("acc_norm", "acc") if m in values), None)
        if metric is None:
            continue
        value, stderr = values[metric]
        ref = reference_value(reference, task, metric) if reference else None
        bars.append((task, metric, value, stderr if isinstance(stderr, float) else 0.0,
                     out.get("chance", {}).get(task), ref))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(bars) + 1.5), 4.0))
    width = 0.38 if reference else 0.6
    for i, (_task, _metric, value, stderr, chance, ref) in enumerate(bars):
        x = i - width / 2 if reference else i
        ax.bar(x, value, width, yerr=stderr, capsize=3, color="tab:blue", label="this model" if i == 0 else None)
        if reference and ref is not None:
            ax.bar(i + width / 2, ref, width, color="tab:gray", label="reference" if i == 0 else None)
        if chance is not None:
            ax.hlines(chance, i - 0.45, i + 0.45, colors="tab:red", linestyles="--",
                      label="chance" if i == 0 else None)
    ax.set_xticks(range(len(bars)), [f"{t}\n({m})" for t, m, *_ in bars], fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.set_title(f"{out.get('config', {}).get('model', 'model')}, {out.get('config', {}).get('num_fewshot', 0)}-shot",
                 fontsize=9)
    if bars:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
