"""Build SFT conversations, DPO pairs and evaluation prompts from the bundled Tang poems (seeded, split by title).

    python scripts/build_poetry_sets.py [--corpus minigpt/data/corpora/tang_poems.txt] [--out-dir data/poetry]
                                        [--seed 0] [--eval-titles 200]

Writes into --out-dir (JSONL, UTF-8):

* ``sft_train.jsonl`` / ``sft_val.jsonl``: ``{"id", "messages"}`` for `minigpt sft` (three tasks: write a poem of a
  form with a given title, continue a poem from its first couplet, name a poem's author);
* ``dpo_train.jsonl`` / ``dpo_val.jsonl``: ``{"id", "prompt", "chosen", "rejected"}`` for `minigpt dpo`: a form
  request, the poem of that form as chosen, a poem of another form as rejected;
* ``eval_prompts.jsonl``: one form request per held-out title, with ``form`` and the ``reference`` poem, for
  ``scripts/poetry_form_table.py`` (the base / SFT / DPO table of ``make chat-demo``).

Every poem whose title is held out goes to the ``_val`` and eval files, so no evaluation title is seen in training.
The task definitions, the forms and the checker are in ``minigpt/data/poetry.py``. The same corpus and seed always
give the same files.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from minigpt.data.poetry import build_sets, read_poems
from minigpt.errors import MiniGPTError

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / "minigpt" / "data" / "corpora" / "tang_poems.txt"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="poem corpus (title, author, lines; blank line)")
    parser.add_argument("--out-dir", default="data/poetry", help="output folder (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the title split and of the rejected poems")
    parser.add_argument("--eval-titles", type=int, default=200, help="titles held out for validation and evaluation")
    args = parser.parse_args(argv)
    try:
        poems = read_poems(args.corpus)
        sets = build_sets(poems, seed=args.seed, eval_titles=args.eval_titles)
    except MiniGPTError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in sets.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                          encoding="utf-8")
    forms = Counter(p.form for p in poems if p.form)
    print(f"{len(poems)} poems, {sum(forms.values())} of a regular form ({', '.join(f'{k} {v}' for k, v in forms.items())})")
    print(" | ".join(f"{name}: {len(rows)}" for name, rows in sets.items()) + f" -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
