"""The training loop, readable top to bottom: data -> model -> AdamW + warmup/cosine -> steps -> eval -> checkpoints.

Run directory layout (``out_dir``)::

    config.yaml          resolved training config (written at start)
    metrics.jsonl        one JSON object per logged step / evaluation
    loss_curve.png       train and validation loss against tokens (written at the end)
    checkpoints/step_N/  config.json, model.safetensors, tokenizer.json, trainer_state.pt, manifest.json
    latest               the name of the newest complete checkpoint (replaced atomically)
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from . import data as data_mod
from .checkpoint import atomic_dir, load_state_into, read_weights, verify_manifest, write_model_files
from .config import ModelConfig, preset
from .errors import MiniGPTError
from .perf import flops_per_token, measure_peak_flops, memory_stats
from .schedule import decay_progress, warmup_cosine_lr
from .tokenizer import Tokenizer
from .transformer import Transformer, lm_loss

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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

    def __post_init__(self) -> None:
        if self.max_steps is None and self.max_time is None:
            raise ValueError("set --max-steps and/or --max-time: the schedule needs a budget")
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
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown training option(s) {unknown}; valid: {sorted(known)}")
        return cls(**d)


def pick_device(name: str) -> torch.device:
    """``auto`` picks cuda, then mps, then cpu."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise MiniGPTError(f"--device {name} requested but CUDA is not available; use --device cpu")
    return torch.device(name)


def autocast_context(device: torch.device, dtype: torch.dtype):
    """bf16/fp16 autocast where the device supports it; fp32 runs without autocast."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


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
def evaluate(model: Transformer, x: torch.Tensor, y: torch.Tensor, batch_size: int, ctx) -> float:
    """Mean next-token loss (nats/token) over fixed windows ``x``/``y`` ``[n_windows, seq_len]``."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    device = model.tok_embeddings.weight.device
    for i in range(0, x.shape[0], batch_size):
        xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
        with ctx:
            total += model.loss(xb, yb).item() * yb.numel()
        count += yb.numel()
    model.train(was_training)
    return total / count


# --------------------------------------------------------------------------------------------- checkpoints

def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states as plain containers of tensors/ints (loadable with weights_only)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: Path, model: Transformer, tokenizer: Tokenizer, state: dict[str, Any],
                    keep: int) -> Path:
    """Write ``checkpoints/step_N`` atomically, then point ``latest`` at it, then prune to ``keep`` newest."""
    ckpt_root = out_dir / "checkpoints"
    final = ckpt_root / f"step_{state['step']:07d}"
    with atomic_dir(final) as tmp:
        write_model_files(model, tmp, tokenizer)
        torch.save(state, tmp / "trainer_state.pt")
    latest_tmp = out_dir / ".latest.tmp"
    latest_tmp.write_text(str(final.relative_to(out_dir)) + "\n")
    os.replace(latest_tmp, out_dir / "latest")
    done = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def find_resume_checkpoint(out_dir: Path) -> Optional[Path]:
    """Newest checkpoint that passes its manifest check; a corrupt one is reported and skipped."""
    candidates = sorted((p for p in (out_dir / "checkpoints").glob("step_*") if p.is_dir()), reverse=True)
    for ckpt in candidates:
        try:
            verify_manifest(ckpt)
            if not (ckpt / "trainer_state.pt").is_file():
                raise MiniGPTError(f"checkpoint {ckpt} has no trainer_state.pt")
            return ckpt
        except MiniGPTError as e:
            print(f"warning: skipping checkpoint: {e}", file=sys.stderr)
    return None


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
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = pick_device(cfg.device)
    dtype = DTYPES[cfg.dtype]

    # ---- data and tokenizer
    data_dir = ensure_data(cfg)
    meta = data_mod.load_meta(data_dir)
    tokenizer = Tokenizer.from_dir(data_dir)
    train_tokens = data_mod.load_split(data_dir, "train")
    val_tokens = data_mod.load_split(data_dir, "val")

    # ---- model
    try:
        model_cfg = preset(cfg.preset, **{"vocab_size": tokenizer.vocab_size, **cfg.model})
    except ValueError as e:
        raise MiniGPTError(f"invalid model config: {e}") from None
    seq_len = cfg.seq_len or model_cfg.max_seq_len
    if seq_len > model_cfg.max_seq_len:
        raise MiniGPTError(f"seq_len {seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}")
    resume_from = find_resume_checkpoint(out_dir) if cfg.resume else None
    if cfg.resume and resume_from is None:
        print(f"no checkpoint in {out_dir}/checkpoints to resume from; starting fresh", flush=True)

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    model = Transformer(model_cfg).to(device)
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
        fused=device.type == "cuda",
    )
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    sampler = data_mod.BatchSampler(train_tokens, cfg.batch_size, seq_len, seed=cfg.seed)
    eval_x, eval_y = data_mod.eval_windows(val_tokens, seq_len, cfg.eval_windows)
    ctx = autocast_context(device, dtype)

    step, tokens_seen, train_time, warmup_end_time, bad_steps = 0, 0, 0.0, None, 0
    metrics_path = out_dir / "metrics.jsonl"
    if resume_from is not None:
        state = torch.load(resume_from / "trainer_state.pt", map_location=device, weights_only=True)
        load_state_into(model, read_weights(resume_from), str(resume_from))
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        step, tokens_seen, train_time = state["step"], state["tokens"], state["train_time"]
        warmup_end_time = state.get("warmup_end_time")
        if metrics_path.is_file():  # drop rows logged after the checkpoint so no step appears twice
            rows = [r for r in metrics_path.read_text().splitlines() if r.strip() and json.loads(r)["step"] <= step]
            metrics_path.write_text("".join(r + "\n" for r in rows))
        print(f"resumed from {resume_from} at step {step}", flush=True)
    elif metrics_path.exists():
        metrics_path.unlink()

    # Only the training forward is compiled: evaluation (other mode, ragged last batch) stays eager instead of
    # paying for recompilations.
    train_forward = torch.compile(model) if cfg.compile else model
    n_params = model.num_parameters()
    fpt = flops_per_token(model_cfg, n_params, seq_len)
    peak = measure_peak_flops(device.type, dtype)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * seq_len
    resolved = {**dataclasses.asdict(cfg), "model": model_cfg.to_dict(), "seq_len": seq_len, "data_dir": str(data_dir)}
    import yaml

    (out_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    print(yaml.safe_dump(resolved, sort_keys=False), end="", flush=True)
    print(f"parameters: {n_params:,} | tokens/step: {tokens_per_step:,} | device: {device} {cfg.dtype} "
          f"| threads: {torch.get_num_threads()} | measured peak {peak / 1e9:.0f} GFLOP/s", flush=True)

    min_lr = cfg.lr * cfg.min_lr_ratio
    val_stats = {"tokens": meta["val"]["tokens"], "bytes": meta["val"]["bytes"]}

    def run_eval() -> dict[str, float]:
        val_loss = evaluate(model, eval_x, eval_y, cfg.batch_size, ctx)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)),
                "val_bpb": data_mod.bits_per_byte(val_loss, val_stats["tokens"], val_stats["bytes"])}

    def log(row: dict[str, Any]) -> None:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def checkpoint() -> Path:
        state = {"step": step, "tokens": tokens_seen, "train_time": train_time, "warmup_end_time": warmup_end_time,
                 "optimizer": optimizer.state_dict(), "sampler": sampler.state_dict(), "rng": rng_state()}
        return save_checkpoint(out_dir, model, tokenizer, state, cfg.keep_checkpoints)

    interactive = sys.stderr.isatty()
    bar = None
    if interactive:
        from tqdm import tqdm

        bar = tqdm(total=cfg.max_steps, initial=step, unit="step", dynamic_ncols=True)

    model.train()
    last = {}
    window_tokens, window_time = 0, 0.0
    with _StopFlag() as stop:
        while True:
            if cfg.max_steps is not None and step >= cfg.max_steps:
                break
            if cfg.max_time is not None and train_time >= cfg.max_time:
                break
            if stop.signal is not None:
                print(f"\nsignal {stop.signal} received at step {step}: saving a checkpoint", flush=True)
                break

            t0 = time.perf_counter()
            progress = decay_progress(step, cfg.warmup_steps, cfg.max_steps, train_time, warmup_end_time,
                                      cfg.max_time)
            lr = warmup_cosine_lr(step, lr=cfg.lr, min_lr=min_lr, warmup_steps=cfg.warmup_steps,
                                  progress=progress)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for _ in range(cfg.grad_accum):
                x, y = sampler.next()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with ctx:
                    loss = lm_loss(train_forward(x), y) / cfg.grad_accum
                scaler.scale(loss).backward()
                loss_sum += loss.detach()  # stays on the device: no host sync per micro-step
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            # One host sync per optimizer step: a NaN/inf update would poison the weights for good.
            finite = scaler.is_enabled() or bool(torch.isfinite(grad_norm) and torch.isfinite(loss_sum))
            if finite:
                scaler.step(optimizer)  # (the fp16 scaler skips non-finite steps itself)
                bad_steps = 0
            else:
                bad_steps += 1
                log({"step": step + 1, "tokens": tokens_seen + tokens_per_step, "skipped": "non-finite",
                     "loss": loss_sum.item(), "grad_norm": grad_norm.item()})
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
                row = {"step": step, "tokens": tokens_seen, "loss": loss_sum.item(), "lr": lr,
                       "grad_norm": grad_norm.item(), "tokens_per_s": tps, "mfu": tps * fpt / peak,
                       "memory": memory_stats(device), "train_time": train_time}
                window_tokens, window_time = 0, 0.0
                if step % cfg.eval_interval == 0 or is_last:
                    row.update(run_eval())
                row["ppl"] = math.exp(min(row["loss"], 50.0))
                row["bpb"] = row.get("val_bpb")
                log(row)
                last = row
                eta = _eta(cfg, step, train_time)
                msg = f"loss {row['loss']:.3f} | {tps:,.0f} tok/s | lr {lr:.2e} | eta {eta}"
                if "val_loss" in row:
                    msg += f" | val_loss {row['val_loss']:.3f} val_bpb {row['val_bpb']:.3f}"
                if bar is not None:
                    bar.set_postfix_str(msg, refresh=False)
                else:
                    print(f"step {step}: {msg}", flush=True)
            if bar is not None:
                bar.update(1)
            if step % cfg.ckpt_interval == 0 and not is_last:
                checkpoint()

        if bar is not None:
            bar.close()
        if last.get("step") != step or "val_loss" not in last:
            last = {**last, "step": step, **run_eval()}
        final_ckpt = checkpoint()

    plot_losses(metrics_path, out_dir / "loss_curve.png") if metrics_path.is_file() else None
    result = {"step": step, "tokens": tokens_seen, "train_time": train_time, "checkpoint": str(final_ckpt),
              "val_loss": last["val_loss"], "val_ppl": last["val_ppl"], "val_bpb": last["val_bpb"],
              "tokens_per_s": tokens_seen / max(train_time, 1e-9) if step else 0.0,
              "interrupted": stop.signal is not None}
    print(f"final: step {step} | val_loss {result['val_loss']:.4f} | val_ppl {result['val_ppl']:.2f} | "
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
