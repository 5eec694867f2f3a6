"""Speed of ``minigpt eval`` against lm-evaluation-harness's ``hf`` backend on the same items, side by side.

Two models, each loaded once per backend (load time not counted): a random-init MiniGPT of about 30 M parameters
(8 layers, dim 512, 8 query / 2 key-value heads, SwiGLU 2048, byte-level BPE of 512 tokens learned on
``tinystories_train_head.txt``), exported with :func:`minigpt.checkpoint.convert.export_hf`, and Karpathy's
stories260K (``shared/data/models/stories260K/hf``, exported the same way so that ``transformers`` reads its
tokenizer without protobuf). Both backends read that HF directory.

Workloads, the same first N items of each for both backends (``--limit``; default 32 for the 30 M model, 160 for
stories260K, which keeps a run on 2 threads near 6 minutes): ARC-Easy 0-shot and 3-shot, HellaSwag 0-shot, PIQA
0-shot.
Backend A is ``lm_eval.simple_evaluate`` on an ``HFLM`` (``hf`` backend) with our task YAMLs
(``minigpt/eval/lm_eval_tasks``, written with absolute data paths by :func:`minigpt.eval.harness.write_task_dir`);
backend B is :func:`minigpt.eval.runner.evaluate` in-process (fast path, KV reuse of the shared context). Both use
the same batch size; both calls are timed whole (task set-up, reading the data, building requests, scoring,
metrics). One untimed warm-up call per workload and backend (2 items) fills ``datasets``' Arrow cache first; one
timed 1-item call shows the fixed cost of a call (task set-up, reading the file), which favours whichever backend
has the smaller one at small N. lm-eval runs with ``bootstrap_iters=0`` (no stderrs; ours computes them). Then
``--rounds`` rounds, each running every workload A then B (A B A B A B). Printed: items/s median [min-max] per
backend, the ratio of the median times (lm-eval / minigpt; the goal in issue 18 is >= 2x) and whether acc and
acc_norm are identical (per-request parity is what tests/eval/test_eval_parity.py holds).

Run from the repo root (offline: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set here)::

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_eval.py --threads 2 --json /tmp/bench_eval.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

# Before transformers / datasets / tqdm are imported: they read these once, at import.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TQDM_DISABLE"):
    os.environ[_var] = "1"

import torch

from minigpt.checkpoint.convert import export_hf
from minigpt.checkpoint.native import load_tokenizer, save_pretrained
from minigpt.checkpoint.tokenizer_bos import adds_bos
from minigpt.eval.harness import LM_EVAL_NAMES, write_task_dir
from minigpt.eval.runner import evaluate
from minigpt.infer.fastpath import load_for_inference
from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer
from minigpt.paths import write_output
from minigpt.runtime import loadavg, machine_info
from minigpt.tokenizer.tokenizer import train_tokenizer

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DATA_DIR = SHARED / "eval"
# (task, num_fewshot)
WORKLOADS = [("arc_easy", 0), ("arc_easy", 3), ("hellaswag", 0), ("piqa", 0)]
METRICS = ("acc", "acc_norm")


def random_30m(root: Path) -> Path:
    """The random-init GQA model (30.7 M parameters) as a HF directory under ``root``."""
    text = (SHARED / "tinystories_train_head.txt").read_text(encoding="utf-8")
    tokenizer = train_tokenizer(text.split("\n\n"), 512)
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=tokenizer.vocab_size, dim=512, n_layers=8, n_heads=8, n_kv_heads=2,
                         hidden_dim=2048, max_seq_len=1024)
    model = Transformer(config).eval()
    save_pretrained(model, root / "random30m-native", tokenizer)
    return export_hf(root / "random30m-native", root / "random30m-hf")


def stories260k(root: Path) -> Path:
    return export_hf(SHARED / "models" / "stories260K" / "hf", root / "stories260K-hf")


# name -> (HF directory builder, default items per workload): lm-eval's 3-shot ARC on the 30 M model takes about
# 0.6 s an item on 2 threads, so that model gets fewer items to keep a whole run near 6 minutes.
MODELS = {"random-30M-GQA": (random_30m, 32), "stories260K": (stories260k, 160)}


class LmEvalBackend:
    """lm-eval's ``hf`` model on our task YAMLs."""

    name = "lm-eval hf"

    def __init__(self, hf_dir: Path, batch_size: int, task_dir: Path):
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager

        self.simple_evaluate = lm_eval.simple_evaluate
        self.model = HFLM(pretrained=str(hf_dir), batch_size=batch_size, device="cpu")
        self.manager = TaskManager(include_path=str(task_dir), include_defaults=False)

    def run(self, task: str, shots: int, limit: int) -> dict:
        name = LM_EVAL_NAMES[task]
        out = self.simple_evaluate(model=self.model, tasks=[name], task_manager=self.manager, num_fewshot=shots,
                                   limit=limit, log_samples=False, bootstrap_iters=0)
        return {m: out["results"][name][f"{m},none"] for m in METRICS}


class MiniGPTBackend:
    """``minigpt eval`` in-process: :func:`minigpt.eval.runner.evaluate` on the loaded fast path."""

    name = "minigpt eval"

    def __init__(self, hf_dir: Path, batch_size: int):
        self.model = load_for_inference(hf_dir, device="cpu", dtype=torch.float32, fast=True)
        self.tokenizer = load_tokenizer(hf_dir)
        self.add_bos = adds_bos(hf_dir, self.tokenizer)
        self.batch_size = batch_size

    def run(self, task: str, shots: int, limit: int) -> dict:
        out = evaluate(self.model, self.tokenizer, [task], num_fewshot=shots, limit=limit,
                       batch_size=self.batch_size, data_dir=DATA_DIR, add_bos=self.add_bos)
        return {m: out["results"][task][f"{m},none"] for m in METRICS}


def timed(backend, task: str, shots: int, limit: int) -> tuple[float, dict]:
    t0 = time.perf_counter()
    accs = backend.run(task, shots, limit)
    return time.perf_counter() - t0, accs


def rate(limit: int, seconds: list[float]) -> str:
    """items/s: median [min-max] (the fastest run gives the max)."""
    rates = sorted(limit / s for s in seconds)
    return f"{statistics.median(rates):.1f} [{rates[0]:.1f}–{rates[-1]:.1f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--limit", type=int, help="items per workload for every model (default: 32 for the 30 M "
                   "model, 160 for stories260K)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--json", help="also write every timing and accuracy to this file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)  # lm-eval logs every task build and its fallbacks at INFO/WARNING
    import lm_eval
    import transformers

    started = time.perf_counter()
    info = machine_info(args.threads, lm_eval=lm_eval.__version__, transformers=transformers.__version__,
                        flags=cpu_flags(), rounds=args.rounds, batch_size=args.batch_size)
    print(json.dumps(info), flush=True)
    rows, record = [], {"machine": info, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        task_dir = write_task_dir(DATA_DIR, root / "tasks", cache_dir=root / "datasets_cache")
        for model_name in args.models.split(","):
            build, default_limit = MODELS[model_name]
            limit = args.limit or default_limit
            rows += bench_model(model_name, build(root), limit, args, task_dir, record["runs"])
    info.update(load_after=loadavg(), wall_s=round(time.perf_counter() - started, 1))
    print(json.dumps({k: info[k] for k in ("load_before", "load_after", "wall_s")}))
    print("| model | task | shots | items | lm-eval hf items/s | minigpt eval items/s | lm-eval / minigpt "
          "| 1-item call s (lm-eval / minigpt) | acc / acc_norm | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        write_output(args.json, json.dumps(record, indent=1) + "\n", "--json")


def bench_model(model_name: str, hf_dir: Path, limit: int, args, task_dir: Path, log: list) -> list[str]:
    """Warm-up, one 1-item call each (the fixed cost of a call), then the timed rounds; returns table rows."""
    backends = [LmEvalBackend(hf_dir, args.batch_size, task_dir), MiniGPTBackend(hf_dir, args.batch_size)]
    fixed = {}
    for w in WORKLOADS:
        for backend in backends:
            backend.run(*w, 2)  # datasets' Arrow cache, first-call allocations
            fixed[w, backend.name] = timed(backend, *w, 1)[0]
    times = {(w, b.name): [] for w in WORKLOADS for b in backends}
    accs = {(w, b.name): [] for w in WORKLOADS for b in backends}
    for r in range(args.rounds):
        for w in WORKLOADS:
            for backend in backends:  # A B, A B, ...
                seconds, acc = timed(backend, *w, limit)
                times[w, backend.name].append(seconds)
                accs[w, backend.name].append(acc)
                log.append({"model": model_name, "task": w[0], "shots": w[1], "items": limit, "round": r,
                            "backend": backend.name, "seconds": seconds, **acc})
                print(f"{model_name} {w[0]} {w[1]}-shot round {r} {backend.name}: {seconds:.2f} s {acc}", flush=True)
    rows = []
    a, b = (backend.name for backend in backends)
    for w in WORKLOADS:
        runs = accs[w, a] + accs[w, b]
        same = all(acc == runs[0] for acc in runs)
        ratio = statistics.median(times[w, a]) / statistics.median(times[w, b])
        rows.append(f"| {model_name} | {w[0]} | {w[1]} | {limit} | {rate(limit, times[w, a])} | "
                    f"{rate(limit, times[w, b])} | **{ratio:.2f}×** | {fixed[w, a]:.2f} / {fixed[w, b]:.2f} | "
                    f"{runs[0]['acc']:.3f} / {runs[0]['acc_norm']:.3f} | {'yes' if same else 'NO'} |")
    total = {name: [sum(times[w, name][r] for w in WORKLOADS) for r in range(args.rounds)] for name in (a, b)}
    n = limit * len(WORKLOADS)
    ratio = statistics.median(total[a]) / statistics.median(total[b])
    rows.append(f"| {model_name} | all four | | {n} | {rate(n, total[a])} | {rate(n, total[b])} | **{ratio:.2f}×** "
                "| | | |")
    return rows


def cpu_flags() -> str:
    """The SIMD flags of the CPU that matter to the GEMMs (from /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    wanted = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")
    return " ".join(f for f in wanted if f in flags)


if __name__ == "__main__":
    main()
