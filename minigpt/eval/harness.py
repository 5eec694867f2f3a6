"""lm-evaluation-harness task YAMLs for the local benchmark files, so that lm-eval itself can score the same items.

``minigpt/eval/lm_eval_tasks/`` holds one YAML per task, named ``minigpt_<task>`` (``minigpt_arc_easy``, ...): the
prompt fields of lm-eval's own task YAML, with ``dataset_path: json`` and ``dataset_kwargs.data_files`` pointing
at ``../shared/data/eval/*.jsonl`` (relative to the repository root). From the repository root::

    HF_DATASETS_OFFLINE=1 lm_eval --model hf --model_args pretrained=HF_DIR \\
        --include_path minigpt/eval/lm_eval_tasks --tasks minigpt_arc_easy,minigpt_hellaswag

:func:`write_task_dir` copies them with the data paths pointing at another folder (``--data-dir``). Nothing here
imports lm-eval.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from minigpt.errors import MiniGPTError

TASK_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
DATA_PREFIX = "../shared/data/eval/"
# Our task name -> the name of its lm-eval YAML.
LM_EVAL_NAMES = {name: f"minigpt_{name}" for name in
                 ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "lambada_openai")}


def write_task_dir(data_dir, out_dir, cache_dir=None) -> Path:
    """Copy the task YAMLs (and their ``utils.py``) into ``out_dir`` with every data file under ``data_dir``
    (made absolute); returns ``out_dir``, ready for lm-eval's ``TaskManager(include_path=...)``. ``cache_dir``:
    where ``datasets`` keeps its Arrow copies of the files (default: its own cache under the home directory).

    Raises :class:`MiniGPTError` when ``out_dir`` cannot be written.
    """
    data_dir, out_dir = Path(data_dir).resolve(), Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(TASK_DIR.iterdir()):
            if path.suffix == ".yaml":
                text = path.read_text(encoding="utf-8").replace(DATA_PREFIX, f"{data_dir.as_posix()}/")
                if cache_dir is not None:
                    cache = f"  cache_dir: {Path(cache_dir).resolve()}\n"
                    text = text.replace("dataset_kwargs:\n", "dataset_kwargs:\n" + cache)
                (out_dir / path.name).write_text(text, encoding="utf-8")
            elif path.suffix == ".py":
                shutil.copyfile(path, out_dir / path.name)
    except OSError as e:
        raise MiniGPTError(f"cannot write the lm-eval task folder {out_dir}: {e}") from None
    return out_dir
