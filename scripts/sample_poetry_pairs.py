"""On-policy DPO pairs for the poetry demo: the model answers form requests, the form checker judges the answers.

    python scripts/sample_poetry_pairs.py MODEL --pairs data/poetry/dpo_train.jsonl --out data/poetry/dpo_judged.jsonl
        [--limit 2000] [--samples 4] [--temperature 1.0] [--max-new-tokens 120] [--batch-size 64] [--seed 0]

The requests are those of ``--pairs`` (``scripts/build_poetry_sets.py``'s ``dpo_train.jsonl``: the form request,
with a poem of that form as chosen). For each of the first ``--limit`` the model (usually the SFT model that DPO
starts from) samples ``--samples`` answers with its chat template; ``minigpt.data.poetry.check_form`` judges them,
and ``minigpt.data.poetry.judged_pairs`` keeps a pair where an answer fails: chosen = an answer that passes (the
corpus poem when none does), rejected = one that fails. Unlike the built pairs, whose rejected poem is another form
written by a poet, these pairs hold the mistakes this model makes. Same model, file and seed: the same pairs.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from minigpt.data.poetry import form_requests, judged_pairs
from minigpt.errors import MiniGPTError
from minigpt.infer.answers import answer_batch, load_chat_model
from minigpt.infer.sampling import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the model that answers (run dir, model dir, .gguf, .bin)")
    parser.add_argument("--pairs", default="data/poetry/dpo_train.jsonl", help="form requests (the built pairs)")
    parser.add_argument("--out", required=True, help="where to write the judged pairs (JSONL)")
    parser.add_argument("--limit", type=int, default=2000, help="first N requests")
    parser.add_argument("--samples", type=int, default=4, help="answers per request")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per forward pass")
    parser.add_argument("--seed", type=int, default=0, help="seeds the sampling and the choice within a request")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.samples < 2 or args.limit < 1 or args.batch_size < 1:
            raise MiniGPTError("--samples must be at least 2, --limit and --batch-size at least 1")
        path = Path(args.pairs)
        if not path.is_file():
            raise MiniGPTError(f"{path} does not exist; run scripts/build_poetry_sets.py first")
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        requests = form_requests(rows[: args.limit])
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                seed=args.seed)
        texts = answer_batch(load_chat_model(args.model), [r["prompt"] for r in requests for _ in range(args.samples)],
                             params, args.batch_size, progress=True)
        answers = [texts[i:i + args.samples] for i in range(0, len(texts), args.samples)]
        pairs, counts = judged_pairs(requests, answers, random.Random(args.seed))
    except (MiniGPTError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs), encoding="utf-8")
    tmp.replace(out)
    print(f"{counts['rows']} requests x {args.samples} answers: {counts['answers_ok'] / counts['answers']:.1%} in "
          f"form; {counts['pairs']} pairs ({counts['reference_chosen']} with the corpus poem as chosen), "
          f"{counts['all_ok']} requests answered right every time -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
