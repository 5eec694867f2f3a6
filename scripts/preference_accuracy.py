"""Held-out preference accuracy of one or more models on a preference file (TRL's layout, as `minigpt dpo` reads it).

For each pair, the model scores the chosen and the rejected answer by the sum of their token log-probabilities
given the prompt (nats; the quantity DPO's implicit reward is built from, Rafailov et al. 2023, eq. 5), rendered
with the model's chat template. Printed per model:

- ``acc``: the fraction of pairs where the chosen answer gets the higher summed log-probability;
- ``acc_norm``: the same with the log-probability divided by the answer's token count (answers differ in length,
  and a sum favours the shorter one);
- the mean summed log-probabilities of chosen and rejected answers.

Pairs longer than the model's context are skipped and counted, as in `minigpt dpo`. This is the model's own
preference, so it is defined before preference tuning too (DPO's ``rewards/accuracies`` is 0 at the start, where
policy and reference coincide).

    python scripts/preference_accuracy.py --data prefs_val.jsonl runs/sft runs/dpo
"""
from __future__ import annotations

import argparse
import sys

import torch

from minigpt.checkpoint.native import load_chat_template, load_model, load_tokenizer
from minigpt.data.chat import SkipReport
from minigpt.data.preference import load_preference_dataset, pad_pairs, read_preferences
from minigpt.errors import MiniGPTError
from minigpt.posttrain.dpo import sequence_logps
from minigpt.tokenizer.chat_template import CHATML_TEMPLATE, ChatTemplate


def score(path: str, data: str, batch_size: int, limit: int) -> dict[str, float]:
    model = load_model(path).eval()
    tokenizer = load_tokenizer(path)
    template = ChatTemplate(tokenizer, load_chat_template(path) or CHATML_TEMPLATE)
    report = SkipReport()
    records = read_preferences(data, False, report)
    eos_text = tokenizer.decode([tokenizer.eos_id]) if tokenizer.eos_id is not None else None
    pairs = load_preference_dataset(data, template, model.config.max_seq_len, eos_text, False, report,
                                    records, tokenizer.eos_id)[:limit]
    print(report.summary(data, "pairs"), file=sys.stderr)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else (tokenizer.eos_id or 0)
    chosen, rejected, n_chosen, n_rejected = [], [], [], []
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            batch = pad_pairs(pairs[start:start + batch_size], pad_id)
            logps = sequence_logps(model, batch)
            half = logps.shape[0] // 2
            chosen.append(logps[:half])
            rejected.append(logps[half:])
            n_chosen.append(batch.completion_lengths[:half].float())
            n_rejected.append(batch.completion_lengths[half:].float())
    c, r = torch.cat(chosen), torch.cat(rejected)
    nc, nr = torch.cat(n_chosen).clamp(min=1), torch.cat(n_rejected).clamp(min=1)
    return {"pairs": len(pairs), "acc": (c > r).float().mean().item(),
            "acc_norm": (c / nc > r / nr).float().mean().item(),
            "logps_chosen": c.mean().item(), "logps_rejected": r.mean().item()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="model directories (e.g. the SFT and the DPO output)")
    ap.add_argument("--data", required=True, help="held-out preference pairs, JSONL")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--limit", type=int, default=500, help="at most this many pairs")
    args = ap.parse_args()
    torch.manual_seed(0)
    try:
        print("| model | pairs | acc | acc_norm | mean logp chosen | mean logp rejected |\n|---|---|---|---|---|---|")
        for path in args.models:
            s = score(path, args.data, args.batch_size, args.limit)
            print(f"| {path} | {s['pairs']} | {s['acc']:.3f} | {s['acc_norm']:.3f} | {s['logps_chosen']:.2f} "
                  f"| {s['logps_rejected']:.2f} |", flush=True)
    except MiniGPTError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
