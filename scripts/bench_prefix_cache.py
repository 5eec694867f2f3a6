"""Time to first token of a conversation's second turn after a long system prompt, prefix cache on vs off.

A random-init model of preset ``small`` (12 layers, dim 384, 12 query / 3 key-value heads) with
``max_seq_len`` 2048 (random weights: the cost of a forward does not depend on them) in a one-slot
:class:`~minigpt.infer.engine.Engine`, as ``minigpt chat`` runs. Each round, on a fresh engine (so nothing is
cached from an earlier round):

1. turn 1: a ``--system``-token system prompt (1,500 by default) + a 20-token user message, 16 tokens answered
   greedily (not timed);
2. turn 2: the same system prompt, user message and answer + a new 20-token user message, submitted and timed
   until its first token arrives (time to first token: admission, the prefill of what is not cached, the first
   sample).

With the cache on, turn 2 copies the blocks of turn 1's prompt and answer and prefills only the new message (and
the last partial block); with it off it prefills all of turn 2's ~1,560 tokens. The first token of both runs is
checked to be the same. Printed: the medians (with min-max) over ``--rounds`` rounds of each, the speed-up
(issue 20's goal: >= 3x), the CPU model and load.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_prefix_cache.py --threads 2 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from minigpt.infer.engine import Engine
from minigpt.infer.sampling import SamplingParams
from minigpt.model.config import preset
from minigpt.model.transformer import Transformer
from minigpt.paths import write_output
from minigpt.runtime import loadavg, machine_info


def conversation(engine: Engine, system: list[int], user1: list[int], user2: list[int]) -> tuple[float, int]:
    """Run turn 1, then time turn 2's first token; returns (seconds, that token)."""
    greedy = SamplingParams(max_tokens=16, temperature=0)
    first = system + user1
    answer = [t for ev in engine.generate(first, greedy) for t in ev.token_ids]
    second = first + answer + user2
    t0 = time.perf_counter()
    events = engine.generate(second, SamplingParams(max_tokens=1, temperature=0))
    token = next(iter(events)).token_ids[0]
    seconds = time.perf_counter() - t0
    events.close()
    return seconds, token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--system", type=int, default=1500, help="system prompt tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer(preset("small", max_seq_len=2048)).to(args.device).eval()
    vocab = model.config.vocab_size
    rng = random.Random(0)
    system = [rng.randrange(3, vocab) for _ in range(args.system)]
    user1 = [rng.randrange(3, vocab) for _ in range(20)]
    user2 = [rng.randrange(3, vocab) for _ in range(20)]
    info = machine_info(args.threads)
    if model.tok_embeddings.weight.is_cuda:
        info["gpu"] = torch.cuda.get_device_name()
    times: dict[str, list[float]] = {"on": [], "off": []}
    tokens: dict[str, set[int]] = {"on": set(), "off": set()}
    for _ in range(args.rounds):
        for mode in ("on", "off"):
            engine = Engine(model, max_batch_size=1, stop_ids=[], context=2048,
                            prefix_cache_bytes=None if mode == "on" else 0).start()
            try:
                seconds, token = conversation(engine, system, user1, user2)
            finally:
                engine.close()
            times[mode].append(seconds)
            tokens[mode].add(token)
            hits = engine.metrics.prefix_cache_hit_tokens.value()
            print(f"cache {mode:>3}: turn 2 TTFT {seconds * 1000:8.1f} ms ({hits:.0f} prompt tokens from the cache)",
                  flush=True)
    assert tokens["on"] == tokens["off"] and len(tokens["on"]) == 1, tokens
    med = {m: statistics.median(t) for m, t in times.items()}
    result = {"system_tokens": args.system, "rounds": args.rounds,
              "ttft_ms": {m: {"median": med[m] * 1000, "min": min(t) * 1000, "max": max(t) * 1000}
                          for m, t in times.items()},
              "speedup": med["off"] / med["on"], "machine": {**info, "load_after": loadavg()}}
    print(f"\n{model.config.n_layers}-layer dim-{model.config.dim} model ('small', max_seq_len 2048), system prompt "
          f"{args.system} tokens, {args.rounds} rounds, {torch.get_num_threads()} threads")
    for m in ("off", "on"):
        r = result["ttft_ms"][m]
        print(f"  cache {m:>3}: median {r['median']:8.1f} ms  [{r['min']:.1f} - {r['max']:.1f}]")
    print(f"  speed-up (median off / median on): {result['speedup']:.1f}x")
    print(f"  CPU: {info['cpu']} ({info['cores']} cores); load before {info['load_before']}, after {loadavg()}"
          + (f"; GPU: {info['gpu']}" if "gpu" in info else ""))
    if args.json:
        write_output(args.json, json.dumps(result, indent=2) + "\n", "--json")


if __name__ == "__main__":
    main()
