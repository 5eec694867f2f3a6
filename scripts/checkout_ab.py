"""Decode speed of two source trees of MiniGPT side by side: `minigpt bench` rows run alternately (A B A B ...) in
fresh processes, each tree on its own PYTHONPATH, and the per-round ratios B/A reported as medians.

Used for "no regression" claims after a refactoring: check out the old commit somewhere (``git worktree add
/tmp/before HEAD~N``) and run

    python scripts/checkout_ab.py /tmp/before . --rounds 3 -- --presets tiny,small --dtypes float32 \
        --rows decode-b1,decode-b8 --compile --warm-compile-cache --repeats 3 --threads 2

Everything after ``--`` goes to ``minigpt bench`` (both trees must accept those flags). tokens/s per cell is the
median of each run's ``--repeats``; the table shows, per cell and implementation, the median over rounds for each
tree and the median of the per-round ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path


def run_bench(tree: Path, bench_args: list[str]) -> dict[tuple, float]:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    proc = subprocess.run([sys.executable, "-m", "minigpt", "bench", *bench_args, "--no-transformers", "--json", "-"],
                          cwd=tree, env=env, capture_output=True, text=True, check=True)
    data = json.loads(proc.stdout[proc.stdout.index("{"):])
    return {(m["preset"], m["dtype"], m["row"], m["impl"]): statistics.median(m["samples"])
            for m in data["measurements"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tree_a", type=Path, help="the reference source tree (e.g. the commit before the change)")
    p.add_argument("tree_b", type=Path, help="the tree under test")
    p.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    bench_args = argv[cut + 1:]  # everything after "--" goes to minigpt bench
    rounds = []
    for r in range(args.rounds):
        a = run_bench(args.tree_a, bench_args)
        b = run_bench(args.tree_b, bench_args)
        rounds.append((a, b))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"CPU: {cpu}; {args.rounds} alternating rounds; bench {' '.join(bench_args)}")
    print("| preset | dtype | row | impl | A tokens/s | B tokens/s | B/A (median of rounds) |")
    print("|---|---|---|---|---|---|---|")
    for key in rounds[0][0]:
        if not all(key in a and key in b for a, b in rounds):
            continue
        va = statistics.median(a[key] for a, _ in rounds)
        vb = statistics.median(b[key] for _, b in rounds)
        ratio = statistics.median(b[key] / a[key] for a, b in rounds)
        print(f"| {' | '.join(key)} | {va:.1f} | {vb:.1f} | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
