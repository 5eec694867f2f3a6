"""The training loop, readable top to bottom: data -> model -> AdamW + warmup/cosine -> steps -> eval -> checkpoints.

Run directory layout (``out_dir``)::

    config.yaml          resolved training config (written at start)
    metrics.jsonl        one JSON object per logged step / evaluation
    loss_curve.png       train and validation loss against tokens (written at the end)
    checkpoints/step_N/  a model directory plus optimizer/sampler/RNG state (see minigpt.train.state)
    latest               the name of the newest complete checkpoint (replaced atomically)

Under ``torchrun`` the same loop runs on every rank with DDP or FSDP2 (minigpt.train.distributed); only rank 0 prints,
logs and writes the run files.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from minigpt.data import prepare as data_mod
from minigpt.errors import MiniGPTError
from minigpt.model.accounting import flops_per_token
from minigpt.model.config import dataclass_from_dict, preset
from minigpt.model.transformer import Transformer, lm_loss
from minigpt.runtime import DTYPES, measure_peak_flops, memory_stats, pick_device
from minigpt.tokenizer.tokenizer import Tokenizer
from minigpt.train import distributed as dist_mod
from minigpt.train import state as train_state
from minigpt.train.schedule import decay_progress, warmup_cosine_lr
from minigpt.train.state import rng_state, set_rng_state


@dataclass
class TrainConfig:
    """Everything a training run needs; set from a YAML file, flags and ``--set key=value`` overrides."""

    data: str = "shakespeare"  # prepared directory, bundled corpus name, or text/jsonl/parquet path
    out_dir: str = "runs/tiny"
    preset: str = "tiny"
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig overrides on top of the preset
    vocab_size: int = 4096  # used only when the data still has to be prepared (tokenizer trained here)
    seq_len: Optional[int] = None  # training window; default: the model's max_seq_len
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    max_steps: Optional[int] = None
    max_time: Optional[float] = None  # seconds of training (evaluation and checkpointing excluded)
    eval_interval: int = 200
    eval_windows: int = 200
    log_interval: int = 10
    ckpt_interval: int = 500
    keep_checkpoints: int = 2
    device: str = "auto"
    dtype: str = "float32"
    seed: int = 1337
    threads: Optional[int] = None
    compile: bool = False  # torch.compile the model; the compile time is part of the first step's time
    resume: bool = False
    max_bad_steps: int = 5  # abort after this many consecutive non-finite steps (each one is skipped)
    parallel: str = "none"  # none | ddp | fsdp (under torchrun; ddp is used if a multi-rank run says none)
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.max_steps is None and self.max_time is None:
            raise ValueError("set --max-steps and/or --max-time: the schedule needs a budget")
        if self.parallel not in ("none", "ddp", "fsdp"):
            raise ValueError(f"parallel must be none, ddp or fsdp, got {self.parallel!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("batch_size", "grad_accum", "eval_interval", "eval_windows", "log_interval", "ckpt_interval",
                     "max_bad_steps"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("lr must be positive and min_lr_ratio in [0, 1]")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(f"max_steps must be positive, got {self.max_steps}")
        if self.max_time is not None and self.max_time <= 0:
            raise ValueError(f"max_time must be positive, got {self.max_time}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        """Build from a dict; unknown keys raise ``ValueError`` listing them."""
        return dataclass_from_dict(cls, d, "training option")


def autocast_context(device: torch.device, dtype: torch.dtype):
    """bf16/fp16 autocast where the device supports it; fp32 runs without autocast. bf16 on a CPU without native
    bf16 GEMMs keeps bf16 numerics with fp32 kernels (minigpt.train.mixed), ~3x faster than oneDNN's emulation there."""
    if dtype == torch.float32:
        return nullcontext()
    from minigpt.train.mixed import autocast

    return autocast(device.type, dtype)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay only tensors with >= 2 dims (matrices, embeddings), never norms or biases (nanoGPT)."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a tied matrix once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def ensure_data(cfg: TrainConfig) -> Path:
    """A prepared data directory: ``cfg.data`` itself, or ``out_dir/data`` prepared from the named source."""
    given = Path(cfg.data)
    if (given / "meta.json").is_file():
        return given
    data_dir = Path(cfg.out_dir) / "data"
    if not (data_dir / "meta.json").is_file():
        print(f"preparing {cfg.data} into {data_dir} (vocab {cfg.vocab_size})", flush=True)
        data_mod.prepare(cfg.data, data_dir, vocab_size=cfg.vocab_size)
    return data_dir


@torch.no_grad()
def evaluate(model: Transformer, x: torch.Tensor, y: torch.Tensor, batch_size: int, ctx,
             info: dist_mod.DistInfo = dist_mod.DistInfo()) -> float:
    """Mean next-token loss (nats/token) over fixed windows ``x``/``y`` ``[n_windows, seq_len]``.

    With several ranks each evaluates every ``world_size``-th window and the sums are all-reduced; the window
    count is cut to a multiple of the world size so every rank runs the same number of forwards (FSDP needs it).
    """
    was_training = model.training
    model.eval()
    n = x.shape[0] - x.shape[0] % info.world_size
    x, y = x[info.rank:n:info.world_size], y[info.rank:n:info.world_size]
    total, count = 0.0, 0
    device = info.device
    for i in range(0, x.shape[0], batch_size):
        xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
        with ctx:
            total += lm_loss(model(xb), yb).item() * yb.numel()
        count += yb.numel()
    model.train(was_training)
    total, count = dist_mod.all_reduce_sum([total, float(count)], info)
    return total / count


# --------------------------------------------------------------------------------------------- run files

def plot_losses(metrics_path: Path, png_path: Path) -> None:
    """Train and validation loss (nats/token) against tokens seen, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [(r["tokens"], r["loss"]) for r in rows if r.get("loss") is not None]
    val = [(r["tokens"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train", alpha=0.7)
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ training

class _StopFlag:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint at the next step boundary and exits cleanly."""

    def __init__(self) -> None:
        self.signal: Optional[int] = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:  # second Ctrl-C: give up immediately
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train a model as ``cfg`` says; returns the final metrics (``val_loss``, ``val_ppl``, ``val_bpb``...)."""
    out_dir = Path(cfg.out_dir)
    info = dist_mod.setup(pick_device(cfg.device), cfg.threads)
    try:
        return _train(cfg, out_dir, info)
    finally:
        dist_mod.teardown(info)


def _train(cfg: TrainConfig, out_dir: Path, info: dist_mod.DistInfo) -> dict[str, Any]:
    device, dtype, main = info.device, DTYPES[cfg.dtype], info.is_main
    say = print if main else (lambda *a, **k: None)
    parallel = cfg.parallel if cfg.parallel != "none" or not info.enabled else "ddp"

    # ---- data and tokenizer (rank 0 prepares; the others wait and read)
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        data_dir = ensure_data(cfg)
    dist_mod.barrier(info)
    data_dir = ensure_data(cfg) if not main else data_dir
    meta = data_mod.load_meta(data_dir)
    tokenizer = Tokenizer.from_dir(data_dir)
    train_tokens = data_mod.load_split(data_dir, "train")
    val_tokens = data_mod.load_split(data_dir, "val")

    # ---- model and optimizer
    try:
        model_cfg = preset(cfg.preset, **{"vocab_size": tokenizer.vocab_size, **cfg.model})
    except ValueError as e:
        raise MiniGPTError(f"invalid model config: {e}") from None
    seq_len = cfg.seq_len or model_cfg.max_seq_len
    if seq_len > model_cfg.max_seq_len:
        raise MiniGPTError(f"seq_len {seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}")
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    model = Transformer(model_cfg).to(device)  # identical initial weights on every rank
    if info.rank:
        torch.manual_seed(cfg.seed + info.rank)  # but independent dropout masks
    n_params = model.num_parameters()
    if main:
        train_state.check_writable(out_dir, n_params)
        train_state.remove_stale_temporaries(out_dir)
    model = dist_mod.wrap_model(model, parallel, info, param_dtype=dtype if dtype != torch.float32 else None,
                                activation_checkpointing=cfg.activation_checkpointing)
    wrapped = model  # what the training forward goes through
    if parallel == "ddp" and info.enabled:
        model = wrapped.module
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
        fused=device.type == "cuda",
    )
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    sampler = data_mod.BatchSampler(train_tokens, cfg.batch_size, seq_len, seed=cfg.seed, rank=info.rank,
                                    world_size=info.world_size)
    eval_x, eval_y = data_mod.eval_windows(val_tokens, seq_len, cfg.eval_windows)
    ctx = autocast_context(device, dtype)
    sharded = parallel == "fsdp" and info.enabled

    # ---- resume
    step, tokens_seen, train_time, warmup_end_time, bad_steps = 0, 0, 0.0, None, 0
    metrics_path = out_dir / "metrics.jsonl"
    resume_from = None
    if cfg.resume:
        found = train_state.find_latest(out_dir) if main else None
        resume_from = dist_mod.broadcast_object(str(found) if found else None, info)
        if resume_from is None:
            say(f"no checkpoint in {out_dir}/checkpoints to resume from; starting fresh", flush=True)
    if resume_from is not None:
        state = train_state.load(Path(resume_from), model, optimizer)
        ranks = state["ranks"]
        sampler.load_state_dict(ranks[0]["sampler"])  # the data stream is the same on every rank
        if state["world_size"] == info.world_size:
            set_rng_state(ranks[info.rank]["rng"])
        else:
            say(f"note: checkpoint written by {state['world_size']} rank(s), resuming on {info.world_size}: "
                "weights, optimizer and data order continue; dropout RNG streams restart", flush=True)
        step, tokens_seen, train_time = state["step"], state["tokens"], state["train_time"]
        warmup_end_time = state.get("warmup_end_time")
        if main and metrics_path.is_file():  # drop rows logged after the checkpoint so no step appears twice
            rows = [r for r in metrics_path.read_text().splitlines() if r.strip() and json.loads(r)["step"] <= step]
            metrics_path.write_text("".join(r + "\n" for r in rows))
        say(f"resumed from {resume_from} at step {step}", flush=True)
    elif main and metrics_path.exists():
        metrics_path.unlink()

    # Only the training forward is compiled: evaluation (other mode, ragged last batch) stays eager instead of
    # paying for recompilations.
    train_forward = torch.compile(wrapped) if cfg.compile else wrapped
    fpt = flops_per_token(model_cfg, n_params, seq_len)
    from minigpt.train.mixed import compute_dtype

    peak = measure_peak_flops(device.type, compute_dtype(device.type, dtype))  # the arithmetic actually used
    tokens_per_step = cfg.batch_size * cfg.grad_accum * seq_len * info.world_size
    resolved = {**dataclasses.asdict(cfg), "model": model_cfg.to_dict(), "seq_len": seq_len, "data_dir": str(data_dir),
                "parallel": parallel, "world_size": info.world_size}
    import yaml

    if main:
        (out_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    say(yaml.safe_dump(resolved, sort_keys=False), end="", flush=True)
    say(f"parameters: {n_params:,} | global batch: {cfg.batch_size} x {cfg.grad_accum} accum x {info.world_size} "
        f"rank(s) x {seq_len} = {tokens_per_step:,} tokens/step | device: {device} {cfg.dtype} "
        f"| threads/rank: {torch.get_num_threads()} | measured peak {peak / 1e9:.0f} GFLOP/s", flush=True)

    min_lr = cfg.lr * cfg.min_lr_ratio
    val_stats = {"tokens": meta["val"]["tokens"], "bytes": meta["val"]["bytes"]}

    def run_eval() -> dict[str, float]:
        val_loss = evaluate(model, eval_x, eval_y, cfg.batch_size, ctx, info)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)),
                "val_bpb": data_mod.bits_per_byte(val_loss, val_stats["tokens"], val_stats["bytes"])}

    def log(row: dict[str, Any]) -> None:
        if main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def checkpoint() -> Path:
        state = {"step": step, "tokens": tokens_seen, "train_time": train_time, "warmup_end_time": warmup_end_time}
        return train_state.save(out_dir, model, optimizer, tokenizer, state,
                                {"sampler": sampler.state_dict(), "rng": rng_state()}, info,
                                cfg.keep_checkpoints, sharded)

    bar = None
    if main and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=cfg.max_steps, initial=step, unit="step", dynamic_ncols=True)

    model.train()
    last: dict[str, Any] = {}
    window_tokens, window_time = 0, 0.0
    with _StopFlag() as stop:
        while True:
            # Every rank must take the same decision (a rank that stops alone hangs the others' collectives),
            # so signals and the clock are agreed on with one small all-reduce per step.
            signalled, clock = float(stop.signal is not None), train_time
            if info.enabled:
                signalled, clock = dist_mod.all_reduce_max([signalled, train_time], info)
            if cfg.max_steps is not None and step >= cfg.max_steps:
                break
            if cfg.max_time is not None and clock >= cfg.max_time:
                break
            if signalled:
                say(f"\nsignal received at step {step}: saving a checkpoint", flush=True)
                break

            t0 = time.perf_counter()
            progress = decay_progress(step, cfg.warmup_steps, cfg.max_steps, clock, warmup_end_time, cfg.max_time)
            lr = warmup_cosine_lr(step, lr=cfg.lr, min_lr=min_lr, warmup_steps=cfg.warmup_steps, progress=progress)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                x, y = sampler.next()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with dist_mod.gradient_sync(wrapped, sync=micro == cfg.grad_accum - 1), ctx:
                    lm = lm_loss(train_forward(x), y) / cfg.grad_accum
                    loss = lm + model.pop_aux_loss() / cfg.grad_accum  # MoE router losses (0.0 for dense models)
                    scaler.scale(loss).backward()
                loss_sum += lm.detach()  # stays on the device: no host sync per micro-step
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if hasattr(grad_norm, "full_tensor"):  # FSDP2 returns a DTensor
                grad_norm = grad_norm.full_tensor()
            # One host sync per optimizer step: a NaN/inf update would poison the weights for good.
            finite = scaler.is_enabled() or bool(torch.isfinite(grad_norm) and torch.isfinite(loss_sum))
            if finite:
                scaler.step(optimizer)  # (the fp16 scaler skips non-finite steps itself)
                bad_steps = 0
            else:
                bad_steps += 1
                log({"step": step + 1, "tokens": tokens_seen + tokens_per_step, "skipped": "non-finite",
                     "loss": loss_sum.item(), "grad_norm": grad_norm.item()})
                if main:
                    print(f"step {step + 1}: non-finite loss or gradient, update skipped "
                          f"({bad_steps}/{cfg.max_bad_steps} in a row)", file=sys.stderr, flush=True)
                if bad_steps >= cfg.max_bad_steps:
                    optimizer.zero_grad(set_to_none=True)
                    raise MiniGPTError(
                        f"training diverged: {bad_steps} consecutive steps with a non-finite loss or gradient at "
                        f"step {step + 1}; the last good checkpoint is kept (lower --lr, or resume with --resume)")
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += tokens_per_step

            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            train_time += dt
            window_tokens += tokens_per_step
            window_time += dt
            if warmup_end_time is None and step >= cfg.warmup_steps:
                warmup_end_time = train_time

            is_last = (cfg.max_steps is not None and step >= cfg.max_steps) or (
                cfg.max_time is not None and train_time >= cfg.max_time)
            if step % cfg.log_interval == 0 or is_last or step == 1:
                tps = window_tokens / max(window_time, 1e-9)
                # The logged loss is the global batch's mean: every rank reaches this line at the same steps.
                loss_val = dist_mod.all_reduce_sum([loss_sum.item()], info)[0] / info.world_size
                row = {"step": step, "tokens": tokens_seen, "loss": loss_val, "lr": lr,
                       "grad_norm": grad_norm.item(), "tokens_per_s": tps,
                       "mfu": tps * fpt / (peak * info.world_size),
                       "memory": memory_stats(device), "train_time": train_time}
                row.update(model.moe_metrics())  # MoE only: router aux/z losses and per-expert load
                window_tokens, window_time = 0, 0.0
                if step % cfg.eval_interval == 0 or is_last:
                    row.update(run_eval())
                row["ppl"] = math.exp(min(row["loss"], 50.0))
                row["bpb"] = row.get("val_bpb")
                log(row)
                last = row
                msg = f"loss {row['loss']:.3f} | {tps:,.0f} tok/s | lr {lr:.2e} | eta {_eta(cfg, step, train_time)}"
                if "val_loss" in row:
                    msg += f" | val_loss {row['val_loss']:.3f} val_bpb {row['val_bpb']:.3f}"
                if bar is not None:
                    bar.set_postfix_str(msg, refresh=False)
                else:
                    say(f"step {step}: {msg}", flush=True)
            if bar is not None:
                bar.update(1)
            if step % cfg.ckpt_interval == 0 and not is_last:
                checkpoint()

        if bar is not None:
            bar.close()
        if last.get("step") != step or "val_loss" not in last:
            last = {**last, "step": step, **run_eval()}
        final_ckpt = checkpoint()

    if main and metrics_path.is_file():
        plot_losses(metrics_path, out_dir / "loss_curve.png")
    result = {"step": step, "tokens": tokens_seen, "train_time": train_time, "checkpoint": str(final_ckpt),
              "val_loss": last["val_loss"], "val_ppl": last["val_ppl"], "val_bpb": last["val_bpb"],
              "tokens_per_s": tokens_seen / max(train_time, 1e-9) if step else 0.0,
              "interrupted": stop.signal is not None}
    say(f"final: step {step} | val_loss {result['val_loss']:.4f} | val_ppl {result['val_ppl']:.2f} | "
        f"val_bpb {result['val_bpb']:.4f} | {result['tokens_per_s']:,.0f} tok/s over {train_time:.0f}s "
        f"| checkpoint {final_ckpt}", flush=True)
    return result


def _eta(cfg: TrainConfig, step: int, train_time: float) -> str:
    left = []
    if cfg.max_time:
        left.append(cfg.max_time - train_time)
    if cfg.max_steps and step:
        left.append((cfg.max_steps - step) * train_time / step)
    return f"{max(0.0, min(left)):.0f}s" if left else "?"
