"""Does the model write the requested poem form? A Markdown table over several models (e.g. base, SFT, DPO).

    python scripts/poetry_form_table.py --prompts data/poetry/eval_prompts.jsonl MODEL [MODEL ...]
                                        [--limit 100] [--max-new-tokens 120] [--batch-size 32]
                                        [--answers answers.jsonl]

Each prompt of ``eval_prompts.jsonl`` (from ``scripts/build_poetry_sets.py``; titles never seen in training) is
rendered with the model's chat template, as ``minigpt chat`` does (a model without one gets the plain
``User: ... / Assistant:`` template), and answered greedily, ``--batch-size`` prompts per forward pass (the same
answers as one at a time). ``minigpt.data.poetry.check_form`` then judges each answer: the verse and line count,
the characters per verse, and no text besides the poem. The table gives the share of answers passing each check
and all of them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from minigpt.data.poetry import check_form
from minigpt.errors import MiniGPTError
from minigpt.infer.answers import answer_batch, load_chat_model
from minigpt.infer.sampling import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="model sources (run dir, model dir, .gguf, .bin)")
    parser.add_argument("--prompts", default="data/poetry/eval_prompts.jsonl")
    parser.add_argument("--limit", type=int, default=100, help="first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=120)
    parser.add_argument("--answers", help="also write every answer and its verdict here (JSONL)")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per forward pass")
    args = parser.parse_args(argv)
    try:
        path = Path(args.prompts)
        if not path.is_file():
            raise MiniGPTError(f"{path} does not exist; run scripts/build_poetry_sets.py first")
        prompts = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()][: args.limit]
        rows, records = [], []
        for source in args.models:
            checks = []
            answers = answer_batch(load_chat_model(source), [p["messages"] for p in prompts],
                                   SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0), args.batch_size)
            for p, answer in zip(prompts, answers):
                check = check_form(answer, p["form"])
                checks.append(check)
                records.append({"model": source, "id": p["id"], "form": p["form"], "answer": answer, "ok": check.ok})
            shares = {key: sum(getattr(c, key) for c in checks) / len(checks)
                      for key in ("ok", "verses_ok", "chars_ok", "clean")}
            rows.append(f"| {source} | {len(checks)} | " + " | ".join(f"{v:.0%}" for v in shares.values()) + " |")
    except MiniGPTError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("| model | prompts | form right | verse count | verse length | nothing else |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    if args.answers:
        Path(args.answers).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                                      encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
