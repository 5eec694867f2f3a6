"""The trainer every recipe shares: set-up (device, dtype, ranks, model, AdamW, warmup/cosine schedule, resume) and
fit (the step loop: gradient accumulation, clipping, autocast, skipped non-finite steps, evaluation, metrics.jsonl,
progress, checkpoints, a clean stop on SIGINT/SIGTERM).

Run directory layout (``out_dir``)::

    config.yaml          resolved training config (written at start)
    metrics.jsonl        one JSON object per logged step / evaluation
    loss_curve.png       train and validation loss against tokens (written at the end)
    checkpoints/step_N/  a model directory plus optimizer/batch-source/RNG state (see minigpt.train.state)
    latest               the name of the newest complete checkpoint (replaced atomically)

Under ``torchrun`` the same loop runs on every rank with DDP or FSDP2 (minigpt.train.distributed); only rank 0 prints,
logs and writes the run files.

A recipe plugs in by subclassing :class:`Trainer` and saying what it trains on and what it minimises; everything
else (the optimizer and its schedule, mixed precision, data parallelism, exact resume, metrics and checkpoints) is
shared. Pretraining (:class:`minigpt.train.loop.Pretraining`) is the reference. The hooks, in the order they run:

* ``prepare_data()``: load the data and set ``self.tokenizer`` (saved with every checkpoint). Runs on every rank
  once the process group is up; files that must be created once are created by rank 0 (``self.info.is_main``)
  before a :func:`~minigpt.train.distributed.barrier`.
* ``build_model()``: the :class:`~minigpt.model.transformer.Transformer` to train, on the CPU; built after the
  global RNGs are seeded with ``cfg.seed``, so it is identical on every rank. SFT loads a pretrained checkpoint
  here (``minigpt.checkpoint.native.load_model``); DPO also loads its frozen reference model and keeps it on
  ``self``, out of the optimizer's reach.
* ``make_batches()``: the micro-batch source, an object with ``next()`` (one rank's micro-batch: a tensor, or a
  tuple / list / dict of tensors, moved to the device by the trainer), ``state_dict()`` and ``load_state_dict()``
  (saved with each checkpoint and restored on resume, so a resumed run draws the batches the uninterrupted run
  would have drawn), like :class:`~minigpt.data.loader.BatchSampler`. Also the place for fixed evaluation data.
* ``batch_loss(forward, batch)``: the scalar loss of one micro-batch, the mean over its tokens (or pairs), under
  autocast; ``forward`` is the wrapped (DDP / FSDP) and possibly compiled model, the one to differentiate through.
  Pretraining and SFT: next-token cross-entropy (SFT masks the prompt tokens); DPO: the DPO loss of chosen and
  rejected log-probabilities against the reference model's (Rafailov et al. 2023, eq. 7).
* ``evaluate()``: validation metrics, a dict of floats whose keys start with ``val_`` (at least ``val_loss``);
  ``self.model``, ``self.autocast`` and ``self.info`` are set. :func:`evaluate` computes a loss over fixed
  windows, sharded over ranks.
* ``self.seq_len`` (tokens per sequence, set by ``build_model()`` at the latest) gives the throughput and MFU
  columns (``tokens_per_micro_batch()``: ``batch_size * seq_len``; ``flops_per_token(n_params)``:
  :func:`~minigpt.model.accounting.flops_per_token`); a recipe whose batches are shaped otherwise overrides them,
  and one whose batches vary (padding, ragged last batches) overrides ``batch_tokens(batch)``, the tokens one
  micro-batch counts for (summed over the ranks every step).
* optional: ``resolved_config()`` (more fields for config.yaml), ``log_fields(row)`` (more fields for a metrics
  row; runs on every rank, so it may all-reduce), ``progress_note(row)`` and ``final_note(result)`` (how
  evaluations read on the console), ``finish(result)`` (final artefacts, after the last checkpoint and before the
  ranks leave: SFT and DPO write their model directory and adapter there).

``Recipe(cfg).run()`` then sets up, fits and returns the final metrics. ``cfg`` is a :class:`TrainerConfig`; a
recipe extends it with its own fields (as :class:`minigpt.train.loop.TrainConfig` adds data, preset and model).
"""
from __future__ import annotations

import json
import random
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from minigpt.errors import MiniGPTError
from minigpt.eval.loss import loss_sum
from minigpt.model.accounting import flops_per_token
from minigpt.model.transformer import Transformer
from minigpt.paths import write_text_atomic
from minigpt.runtime import measure_peak_flops, memory_stats, pick_device
from minigpt.train import distributed as dist_mod
from minigpt.train import state as train_state
from minigpt.train.config import TrainerConfig
from minigpt.train.mixed import autocast, compute_dtype, training_dtype
from minigpt.train.optim import build_optimizer, set_lr
from minigpt.train.optim import param_groups as param_groups  # re-exported: its home was here
from minigpt.train.schedule import decay_progress, warmup_cosine_lr
from minigpt.train.state import rng_state, set_rng_state


def autocast_context(device: torch.device, dtype: torch.dtype):
    """bf16/fp16 autocast where the device supports it; fp32 runs without autocast. bf16 on a CPU without native
    bf16 GEMMs keeps bf16 numerics with fp32 kernels (minigpt.train.mixed), ~3x faster than oneDNN's emulation there."""
    if dtype == torch.float32:
        return nullcontext()
    return autocast(device.type, dtype)


def evaluate(model: Transformer, x: torch.Tensor, y: torch.Tensor, batch_size: int, ctx,
             info: dist_mod.DistInfo = dist_mod.DistInfo()) -> float:
    """Mean next-token loss (nats/token) over fixed windows ``x``/``y`` ``[n_windows, seq_len]``
    (:func:`minigpt.eval.loss.loss_sum`), ``ctx`` the autocast context.

    With several ranks each evaluates every ``world_size``-th window and the sums are all-reduced; the window
    count is cut to a multiple of the world size so every rank runs the same number of forwards (FSDP needs it).
    """
    n = x.shape[0] - x.shape[0] % info.world_size
    x, y = x[info.rank:n:info.world_size], y[info.rank:n:info.world_size]
    total, count = loss_sum(model, x, y, batch_size, ctx, info.device)
    total, count = dist_mod.all_reduce_sum([total, float(count)], info)
    return total / count


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


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if callable(getattr(batch, "to", None)):  # a recipe's batch type (e.g. a dataclass of tensors) moves itself
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class Trainer:
    """Set-up and fit for one recipe; subclass it and implement the hooks (see the module docstring)."""

    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.out_dir = Path(cfg.out_dir)
        self.tokenizer = None  # set by prepare_data(); saved with every checkpoint
        self.seq_len = 0  # tokens per sequence, set by the recipe before make_batches()
        self.last_eval: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------ hooks
    def prepare_data(self) -> None:
        """Load the data (every rank; rank 0 creates shared files first) and set ``self.tokenizer``."""
        raise NotImplementedError

    def build_model(self) -> Transformer:
        """The model to train, on the CPU (the global RNGs are already seeded); set ``self.seq_len`` by now."""
        raise NotImplementedError

    def make_batches(self):
        """The micro-batch source: ``next()``, ``state_dict()``, ``load_state_dict()``."""
        raise NotImplementedError

    def batch_loss(self, forward: Callable, batch: Any) -> torch.Tensor:
        """Scalar loss of one micro-batch (already on the device), computed through ``forward``."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """Validation metrics ``{"val_loss": ..., "val_...": ...}``, the same on every rank."""
        raise NotImplementedError

    def tokens_per_micro_batch(self) -> int:
        """Tokens one rank trains on per micro-batch (throughput, MFU)."""
        return self.cfg.batch_size * self.seq_len

    def batch_tokens(self, batch: Any) -> int:
        """Tokens one (device) micro-batch counts for in ``tokens`` and ``tokens_per_s``; default
        :meth:`tokens_per_micro_batch` (every batch is full)."""
        return self.tokens_per_micro_batch()

    def flops_per_token(self, n_params: int) -> float:
        """Training FLOPs per token (forward and backward) of the model at ``self.seq_len``, for MFU."""
        return flops_per_token(self.model.config, n_params, self.seq_len)

    def resolved_config(self) -> dict[str, Any]:
        """Fields that config.yaml adds to (or replaces in) the options: what the run resolved them to."""
        return {}

    def log_fields(self, row: dict[str, Any]) -> None:
        """Add recipe fields to a metrics row in place (after its evaluation, if any)."""

    def progress_note(self, row: dict[str, Any]) -> str:
        """What a progress line adds after the loss, throughput and ETA: here every ``val_*`` of ``row``."""
        return "".join(f" | {k} {v:.3f}" for k, v in row.items() if k.startswith("val_"))

    def final_note(self, result: dict[str, Any]) -> str:
        """The evaluation part of the final line: here every ``val_*`` of ``result``."""
        return " | ".join(f"{k} {v:.4f}" for k, v in result.items() if k.startswith("val_"))

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """After the final checkpoint, on every rank with the process group still up: write the recipe's own
        artefacts; returns the run's result (here unchanged)."""
        return result

    # ------------------------------------------------------------------------------------------------ driver
    def run(self) -> dict[str, Any]:
        """Join the ranks, set up and fit; returns the final metrics (``step``, ``tokens``, ``train_time``,
        ``checkpoint``, the last evaluation's ``val_*``, ``tokens_per_s``, ``interrupted``)."""
        self.info = dist_mod.setup(pick_device(self.cfg.device), self.cfg.threads)
        try:
            self.setup()
            return self.finish(self.fit())
        finally:
            dist_mod.teardown(self.info)

    def setup(self) -> None:
        """Data, model, optimizer, batch source, resume, config.yaml: everything before the first step."""
        cfg, info, out_dir = self.cfg, self.info, self.out_dir
        self.device, self.main = info.device, info.is_main
        self.dtype = training_dtype(cfg.dtype, info.device.type)
        self.say = print if self.main else (lambda *a, **k: None)
        self.parallel = cfg.parallel if cfg.parallel != "none" or not info.enabled else "ddp"
        device, dtype, main, say = self.device, self.dtype, self.main, self.say

        if main:
            out_dir.mkdir(parents=True, exist_ok=True)
        self.prepare_data()

        # ---- model and optimizer
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        model = self.build_model().to(device)  # identical initial weights on every rank
        if info.rank:
            torch.manual_seed(cfg.seed + info.rank)  # but independent dropout masks
        self.n_params = model.num_parameters()
        if main:
            train_state.check_writable(out_dir, self.n_params)
            train_state.remove_stale_temporaries(out_dir)
        model = dist_mod.wrap_model(model, self.parallel, info, param_dtype=dtype if dtype != torch.float32 else None,
                                    activation_checkpointing=cfg.activation_checkpointing)
        self.wrapped = model  # what the training forward goes through
        if self.parallel == "ddp" and info.enabled:
            model = self.wrapped.module
        self.model = model
        self.optimizer = build_optimizer(model, cfg)  # AdamW, or Muon + AdamW (minigpt.train.optim)
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        self.batches = self.make_batches()
        self.autocast = autocast_context(device, dtype)
        self.sharded = self.parallel == "fsdp" and info.enabled

        # ---- resume
        self.step, self.tokens_seen, self.train_time, self.warmup_end_time = 0, 0, 0.0, None
        self.metrics_path = out_dir / "metrics.jsonl"
        resume_from = None
        if cfg.resume:
            found = train_state.find_latest(out_dir) if main else None
            resume_from = dist_mod.broadcast_object(str(found) if found else None, info)
            if resume_from is None:
                say(f"no checkpoint in {out_dir}/checkpoints to resume from; starting fresh", flush=True)
        if resume_from is not None:
            state = train_state.load(Path(resume_from), model, self.optimizer)
            ranks = state["ranks"]
            self.batches.load_state_dict(ranks[0]["sampler"])  # the data stream is the same on every rank
            if state["world_size"] == info.world_size:
                set_rng_state(ranks[info.rank]["rng"])
            else:
                say(f"note: checkpoint written by {state['world_size']} rank(s), resuming on {info.world_size}: "
                    "weights, optimizer and data order continue; dropout RNG streams restart", flush=True)
            self.step, self.tokens_seen, self.train_time = state["step"], state["tokens"], state["train_time"]
            self.warmup_end_time = state.get("warmup_end_time")
            if main and self.metrics_path.is_file():  # drop rows logged after the checkpoint: no step appears twice
                train_state.truncate_metrics(self.metrics_path, self.step)
            say(f"resumed from {resume_from} at step {self.step}", flush=True)
        elif main and self.metrics_path.exists():
            self.metrics_path.unlink()

        # Only the training forward is compiled: evaluation (other mode, ragged last batch) stays eager instead of
        # paying for recompilations.
        self.train_forward = torch.compile(self.wrapped) if cfg.compile else self.wrapped
        self.fpt = self.flops_per_token(self.n_params)
        self.peak = measure_peak_flops(device.type, compute_dtype(device.type, dtype))  # the arithmetic actually used
        self.tokens_per_step = self.tokens_per_micro_batch() * cfg.grad_accum * info.world_size
        resolved = {**cfg.to_dict(), **self.resolved_config(), "parallel": self.parallel,
                    "world_size": info.world_size}
        import yaml

        if main:
            write_text_atomic(out_dir / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))
        say(yaml.safe_dump(resolved, sort_keys=False), end="", flush=True)
        say(f"parameters: {self.n_params:,} | global batch: {cfg.batch_size} x {cfg.grad_accum} accum x "
            f"{info.world_size} rank(s) x {self.seq_len} = {self.tokens_per_step:,} tokens/step | device: {device} "
            f"{str(self.dtype).removeprefix('torch.')}{' (auto)' if cfg.dtype == 'auto' else ''} | threads/rank: "
            f"{torch.get_num_threads()} | measured peak {self.peak / 1e9:.0f} GFLOP/s",
            flush=True)

    def log(self, row: dict[str, Any]) -> None:
        """Append ``row`` to metrics.jsonl (rank 0)."""
        if self.main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def checkpoint(self) -> Path:
        """Save model, optimizer, batch source and RNG states at the current step (see minigpt.train.state)."""
        state = {"step": self.step, "tokens": self.tokens_seen, "train_time": self.train_time,
                 "warmup_end_time": self.warmup_end_time}
        return train_state.save(self.out_dir, self.model, self.optimizer, self.tokenizer, state,
                                {"sampler": self.batches.state_dict(), "rng": rng_state()}, self.info,
                                self.cfg.keep_checkpoints, self.sharded)

    def _run_eval(self) -> dict[str, float]:
        self.last_eval = self.evaluate()
        return self.last_eval

    def fit(self) -> dict[str, Any]:
        """The step loop, until the step or time budget is spent or a signal arrives; then a final evaluation (if
        the last step had none) and checkpoint."""
        cfg, info, device, main, say = self.cfg, self.info, self.device, self.main, self.say
        model, optimizer, scaler = self.model, self.optimizer, self.scaler
        min_lr = cfg.lr * cfg.min_lr_ratio
        bad_steps = 0
        bar = None
        if main and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=cfg.max_steps, initial=self.step, unit="step", dynamic_ncols=True)

        counted = type(self).batch_tokens is not Trainer.batch_tokens  # the recipe counts its batches' tokens
        model.train()
        last: dict[str, Any] = {}
        evaluated_at = None
        window_tokens, window_time = 0, 0.0
        with _StopFlag() as stop:
            while True:
                # Every rank must take the same decision (a rank that stops alone hangs the others' collectives),
                # so signals and the clock are agreed on with one small all-reduce per step.
                signalled, clock = float(stop.signal is not None), self.train_time
                if info.enabled:
                    signalled, clock = dist_mod.all_reduce_max([signalled, self.train_time], info)
                if cfg.max_steps is not None and self.step >= cfg.max_steps:
                    break
                if cfg.max_time is not None and clock >= cfg.max_time:
                    break
                if signalled:
                    say(f"\nsignal received at step {self.step}: saving a checkpoint", flush=True)
                    break

                t0 = time.perf_counter()
                progress = decay_progress(self.step, cfg.warmup_steps, cfg.max_steps, clock, self.warmup_end_time,
                                          cfg.max_time)
                lr = warmup_cosine_lr(self.step, lr=cfg.lr, min_lr=min_lr, warmup_steps=cfg.warmup_steps,
                                      progress=progress)
                set_lr(optimizer, lr, cfg)  # Muon's groups at their own peak, same schedule shape
                step_loss = torch.zeros((), device=device)
                step_tokens = 0
                for micro in range(cfg.grad_accum):
                    batch = _to_device(self.batches.next(), device)
                    step_tokens += self.batch_tokens(batch)
                    with dist_mod.gradient_sync(self.wrapped, sync=micro == cfg.grad_accum - 1), self.autocast:
                        lm = self.batch_loss(self.train_forward, batch) / cfg.grad_accum
                        loss = lm + model.pop_aux_loss() / cfg.grad_accum  # MoE router losses (0.0 for dense models)
                        scaler.scale(loss).backward()
                    step_loss += lm.detach()  # stays on the device: no host sync per micro-step
                if counted:  # the ranks' batches may differ: add them up (every rank takes this branch or none)
                    step_tokens = int(dist_mod.all_reduce_sum([float(step_tokens)], info)[0])
                else:
                    step_tokens *= info.world_size
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                if hasattr(grad_norm, "full_tensor"):  # FSDP2 returns a DTensor
                    grad_norm = grad_norm.full_tensor()
                # One host sync per optimizer step: a NaN/inf update would poison the weights for good.
                finite = scaler.is_enabled() or bool(torch.isfinite(grad_norm) and torch.isfinite(step_loss))
                if finite:
                    scaler.step(optimizer)  # (the fp16 scaler skips non-finite steps itself)
                    bad_steps = 0
                else:
                    bad_steps += 1
                    self.log({"step": self.step + 1, "tokens": self.tokens_seen + step_tokens,
                              "skipped": "non-finite", "loss": step_loss.item(), "grad_norm": grad_norm.item()})
                    if main:
                        print(f"step {self.step + 1}: non-finite loss or gradient, update skipped "
                              f"({bad_steps}/{cfg.max_bad_steps} in a row)", file=sys.stderr, flush=True)
                    if bad_steps >= cfg.max_bad_steps:
                        optimizer.zero_grad(set_to_none=True)
                        raise MiniGPTError(
                            f"training diverged: {bad_steps} consecutive steps with a non-finite loss or gradient at "
                            f"step {self.step + 1}; the last good checkpoint is kept (lower --lr, or resume with "
                            f"--resume)")
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                self.step += 1
                self.tokens_seen += step_tokens
                step = self.step

                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                self.train_time += dt
                window_tokens += step_tokens
                window_time += dt
                if self.warmup_end_time is None and step >= cfg.warmup_steps:
                    self.warmup_end_time = self.train_time

                is_last = (cfg.max_steps is not None and step >= cfg.max_steps) or (
                    cfg.max_time is not None and self.train_time >= cfg.max_time)
                if step % cfg.log_interval == 0 or is_last or step == 1:
                    tps = window_tokens / max(window_time, 1e-9)
                    # The logged loss is the global batch's mean: every rank reaches this line at the same steps.
                    loss_val = dist_mod.all_reduce_sum([step_loss.item()], info)[0] / info.world_size
                    row = {"step": step, "tokens": self.tokens_seen, "loss": loss_val, "lr": lr,
                           "grad_norm": grad_norm.item(), "tokens_per_s": tps,
                           "mfu": tps * self.fpt / (self.peak * info.world_size),
                           "memory": memory_stats(device), "train_time": self.train_time}
                    row.update(model.moe_metrics())  # MoE only: router aux/z losses and per-expert load
                    window_tokens, window_time = 0, 0.0
                    if step % cfg.eval_interval == 0 or is_last:
                        row.update(self._run_eval())
                        evaluated_at = step
                    self.log_fields(row)
                    self.log(row)
                    last = row
                    msg = (f"loss {row['loss']:.3f} | {tps:,.0f} tok/s | lr {lr:.2e} | "
                           f"eta {_eta(cfg, step, self.train_time)}{self.progress_note(row)}")
                    if bar is not None:
                        bar.set_postfix_str(msg, refresh=False)
                    else:
                        say(f"step {step}: {msg}", flush=True)
                if bar is not None:
                    bar.update(1)
                if step % cfg.ckpt_interval == 0 and not is_last:
                    self.checkpoint()

            if bar is not None:
                bar.close()
            if evaluated_at != self.step:
                last = {**last, "step": self.step, **self._run_eval()}
            final_ckpt = self.checkpoint()

        if main and self.metrics_path.is_file():
            plot_losses(self.metrics_path, self.out_dir / "loss_curve.png")
        step, tokens_seen, train_time = self.step, self.tokens_seen, self.train_time
        result = {"step": step, "tokens": tokens_seen, "train_time": train_time, "checkpoint": str(final_ckpt),
                  **{k: last[k] for k in self.last_eval},
                  "tokens_per_s": tokens_seen / max(train_time, 1e-9) if step else 0.0,
                  "interrupted": stop.signal is not None}
        say(f"final: step {step} | {self.final_note(result)} | {result['tokens_per_s']:,.0f} tok/s over "
            f"{train_time:.0f}s | checkpoint {final_ckpt}", flush=True)
        return result


def _eta(cfg: TrainerConfig, step: int, train_time: float) -> str:
    left = []
    if cfg.max_time:
        left.append(cfg.max_time - train_time)
    if cfg.max_steps and step:
        left.append((cfg.max_steps - step) * train_time / step)
    return f"{max(0.0, min(left)):.0f}s" if left else "?"
