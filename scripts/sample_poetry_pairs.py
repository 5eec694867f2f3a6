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

from minigpt.checkpoint.native import load_chat_template, load_model, load_tokenizer, resolve_checkpoint
from minigpt.data.poetry import form_requests, judged_pairs
from minigpt.errors import MiniGPTError
from minigpt.infer.generate import generate_batch
from minigpt.infer.sampling import SamplingParams
from minigpt.infer.stops import default_stop_ids
from minigpt.tokenizer.chat_template import ChatTemplate


def sample_answers(source: str, requests: list[dict], samples: int, params: SamplingParams,
                   batch_size: int) -> list[list[str]]:
    """``samples`` answers of the model at ``source`` to each request's ``prompt`` messages, sampled with
    ``params`` (its ``seed`` seeds each batch in turn), ``batch_size`` sequences per forward pass."""
    ckpt = resolve_checkpoint(source)
    model, tokenizer = load_model(ckpt), load_tokenizer(ckpt)
    formatter = ChatTemplate.for_model(tokenizer, load_chat_template(ckpt))
    stop_ids = default_stop_ids(tokenizer, formatter)
    prompts = [formatter.prompt(r["prompt"]) for r in requests for _ in range(samples)]
    texts = []
    for start in range(0, len(prompts), batch_size):
        seed = None if params.seed is None else params.seed + start
        batch = generate_batch(model, prompts[start:start + batch_size], SamplingParams(
            max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k, seed=seed),
            stop_ids=stop_ids, tokenizer=tokenizer)
        for c in batch:
            text = c.text
            for stop in formatter.stop:  # the plain template's implicit end of turn
                text = text.split(stop)[0]
            texts.append(text.strip())
        print(f"\r{len(texts)}/{len(prompts)} answers", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return [texts[i:i + samples] for i in range(0, len(texts), samples)]


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
        answers = sample_answers(args.model, requests, args.samples, params, args.batch_size)
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
