"""The measurements of ``minigpt ablate`` besides training: attention time and memory against sequence length,
the norm layers alone, and training throughput timed round-robin. Each heavy one runs in a spawned process (see
:func:`minigpt.runtime.run_in_child`) and is cached in the ablation's ``out_dir``."""
from __future__ import annotations

import json
import resource
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from minigpt.model.attention import causal_mask, naive_attention
from minigpt.model.config import ModelConfig, preset
from minigpt.model.flash_reference import flash_attention
from minigpt.model.norm import LayerNorm, RMSNorm
from minigpt.model.transformer import Transformer, lm_loss
from minigpt.paths import write_text_atomic
from minigpt.runtime import rss_bytes, run_in_child
from minigpt.train.config import TrainerConfig
from minigpt.train.optim import build_optimizer

ATTENTION_SEQ_LENS = (128, 256, 512, 1024)


def _best_time(fn: Callable[[], Any], reps: int) -> float:
    """Fastest of ``reps`` timed calls after a warm-up: on a machine shared with other jobs the minimum is the
    least disturbed estimate of the cost itself."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _attention_child(impl: str, seq_lens: list[int], heads: int, head_dim: int, threads: int, path: str) -> None:
    """Time forward + backward of one attention implementation at increasing lengths, in a fresh process.

    Memory: bytes of the tensors autograd keeps for the backward pass (saved-tensor hooks), and the growth of the
    process's peak resident set over its idle value (lengths run in increasing order, so each peak is its own)."""


    torch.set_num_threads(threads)
    torch.manual_seed(0)
    fns = {"sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
           "naive": lambda q, k, v: naive_attention(q, k, v, causal_mask(q.shape[2], k.shape[2], q.device)),
           "flash_reference": lambda q, k, v: flash_attention(q, k, v, block_size=64)}
    attend = fns[impl]
    idle = rss_bytes()
    rows = []
    for n in seq_lens:
        q, k, v = (torch.randn(1, heads, n, head_dim, requires_grad=True) for _ in range(3))

        def step(q=q, k=k, v=v):
            attend(q, k, v).sum().backward()

        saved: dict[int, int] = {}

        def pack(t, saved=saved):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = attend(q, k, v)
        inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
        del out
        seconds = _best_time(step, 3)
        rows.append({"seq_len": n, "seconds": seconds,
                     "saved_mb": sum(b for p, b in saved.items() if p not in inputs) / 2**20,
                     "peak_above_idle_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - idle) / 2**20})
    write_text_atomic(path, json.dumps(rows))


def attention_benchmark(settings, seq_lens=ATTENTION_SEQ_LENS) -> dict[str, Any]:
    """``{impl: [{"seq_len", "seconds", "saved_mb", "peak_above_idle_mb"}...]}`` for a batch of 1 with the scale's
    head count and head size (one spawned process per implementation)."""

    cfg = preset(settings.budget()["preset"])
    out = {"heads": cfg.n_heads, "head_dim": cfg.head_dim, "batch": 1, "block_size": 64, "seq_lens": list(seq_lens),
           "threads": settings.threads, "results": {}}
    cache = settings.out_dir / settings.scale / "attention_bench.json"
    if cache.is_file() and not settings.force:
        previous = json.loads(cache.read_text())
        if {k: v for k, v in previous.items() if k != "results"} == {k: v for k, v in out.items() if k != "results"}:
            return previous
    path = settings.out_dir / "attention_bench.json"
    for impl in ("sdpa", "flash_reference", "naive"):
        run_in_child(_attention_child, impl, list(seq_lens), cfg.n_heads, cfg.head_dim, settings.threads, str(path))
        out["results"][impl] = json.loads(path.read_text())
    write_text_atomic(cache, json.dumps(out))
    return out


def _throughput_child(configs: dict[str, dict], batch: int, seq_len: int, threads: int, rounds: int, steps: int,
                      path: str, optimizers: dict[str, str]) -> None:
    """Training tokens/s of several models measured round-robin in one process: every variant is timed in each
    round, so load from other jobs on a shared machine falls on all of them alike. Best round per variant. Each
    model steps the optimizer its run used (``optimizers``: name -> adamw | muon)."""


    torch.set_num_threads(threads)
    torch.manual_seed(0)
    setups = {}
    for name, cfg in configs.items():
        model = Transformer(ModelConfig.from_dict(cfg)).train()
        opt_cfg = TrainerConfig(max_steps=1, lr=1e-4, optimizer=optimizers.get(name, "adamw"))
        setups[name] = (model, build_optimizer(model, opt_cfg))
    x = torch.randint(0, next(iter(configs.values()))["vocab_size"], (batch, seq_len + 1))

    def train_steps(name: str, n: int) -> float:
        model, opt = setups[name]
        t0 = time.perf_counter()
        for _ in range(n):
            loss = lm_loss(model(x[:, :-1]), x[:, 1:]) + model.pop_aux_loss()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) / n

    for name in setups:
        train_steps(name, 2)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(rounds):
        for name in setups:
            times[name].append(train_steps(name, steps))
    write_text_atomic(path, json.dumps({name: batch * seq_len / min(t) for name, t in times.items()}))


SPEED_TWIN = "baseline-again"  # the baseline timed a second time in the same rounds: the speed noise


def throughput_benchmark(settings, configs: dict[str, dict], key: str, rounds: int = 4, steps: int = 2,
                         optimizers: dict[str, str] | None = None) -> dict[str, float]:
    """``{variant: training tokens/s}`` (forward, backward, optimizer step -- AdamW unless ``optimizers`` names
    another for a variant -- at the run's batch x context), round-robin in one spawned process, plus
    ``baseline-again``: an identical second baseline whose gap to the first measures the timing noise. Cached in
    ``out_dir`` unless ``settings.force``."""
    configs = {**configs, SPEED_TWIN: configs["baseline"]}
    optimizers = {k: v for k, v in (optimizers or {}).items() if v != "adamw"}

    b = settings.budget()
    cache = settings.out_dir / settings.scale / f"throughput-{key}.json"
    spec = {"configs": configs, "batch": b["batch_size"], "seq_len": b["seq_len"], "threads": settings.threads,
            "rounds": rounds, "steps": steps, **({"optimizers": optimizers} if optimizers else {})}
    if cache.is_file() and not settings.force:
        previous = json.loads(cache.read_text())
        if previous.get("spec") == spec:
            return previous["tokens_per_s"]
    tmp = settings.out_dir / "throughput.json"
    run_in_child(_throughput_child, configs, b["batch_size"], b["seq_len"], settings.threads, rounds, steps, str(tmp),
                 optimizers)
    result = json.loads(tmp.read_text())
    write_text_atomic(cache, json.dumps({"spec": spec, "tokens_per_s": result}))
    return result


def norm_benchmark(settings, config) -> dict[str, Any]:
    """Forward + backward seconds of each norm alone on ``[batch * seq_len, dim]`` activations (this process)."""


    b = settings.budget()
    torch.set_num_threads(settings.threads)
    x = torch.randn(b["batch_size"] * b["seq_len"], config.dim, requires_grad=True)
    rms, ln = RMSNorm(config.dim), LayerNorm(config.dim)
    w, bias = torch.ones(config.dim, requires_grad=True), torch.zeros(config.dim, requires_grad=True)
    cases = {"RMSNorm (ours: float32 ops, as Llama/HF)": lambda: rms(x),
             "LayerNorm (ours: F.layer_norm + affine)": lambda: ln(x),
             "F.rms_norm (fused)": lambda: F.rms_norm(x, (config.dim,), w, 1e-5),
             "F.layer_norm (fused)": lambda: F.layer_norm(x, (config.dim,), w, bias, 1e-5)}
    return {name: _best_time(lambda f=f: f().sum().backward(), 50) for name, f in cases.items()}
