"""Direct Preference Optimization (DPO), full or LoRA: a small loop, readable top to bottom.

DPO (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward Model", eq. 7)
trains a policy ``pi`` on pairs (prompt ``x``, preferred answer ``y_c``, dispreferred ``y_r``) against a frozen
reference ``ref`` (the starting model) with

    loss = -log sigmoid(beta * ((log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x))))

where ``log pi(y|x)`` is the sum of the answer's token log-probabilities (prompt tokens are not scored) and ``beta``
(default 0.1) sets how far the policy may drift from the reference. ``beta * (log pi - log ref)`` is the answer's
implicit reward. ``loss_type="ipo"`` is IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning
from Human Preferences", eq. 17), a squared loss that does not push the margin to infinity:

    loss = (h - 1 / (2 * beta))^2,   h = (log pi(y_c|x) - log ref(y_c|x)) / |y_c| - (log pi(y_r|x) - log ref(y_r|x)) / |y_r|

with the log-ratios averaged over each answer's tokens ``|y|``, TRL's convention for IPO (``DPOTrainer``, ``trl`` 1.16,
which states the IPO authors confirmed it; the paper does not normalise by length).

The reference is a frozen copy of the starting model; with LoRA it is the same model with its adapters disabled
(:func:`~minigpt.model.lora.adapters_disabled`, as TRL does with PEFT), so no second copy is held; with
``precompute_ref`` its log-probs for every pair are computed once before training (TRL's
``precompute_ref_log_probs``), and no reference is kept at all for full fine-tuning. It always runs in eval mode.
Dropout is disabled in the policy, as TRL's ``disable_dropout=True`` default does, so that the policy equals the
reference at step 0 and the implicit rewards start at exactly 0.

Logged per row (``metrics.jsonl``, means over the pairs of the logged steps; TRL's names): ``loss``,
``rewards/chosen``, ``rewards/rejected`` (``beta`` times the log-ratios), ``rewards/accuracies`` (fraction with
chosen reward > rejected reward), ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (summed answer
log-probs, nats), plus ``lr``, ``grad_norm``, ``tokens_per_s`` and, with validation pairs, the same metrics prefixed
``val_`` (TRL: ``eval_``).

Output ``out_dir`` (atomic): a MiniGPT model directory (LoRA merged in), its chat template, ``metrics.jsonl``,
``dpo_config.json`` and, with LoRA, ``adapter/`` in PEFT's format.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from minigpt.checkpoint.native import load_chat_template, load_model, load_tokenizer, resolve_checkpoint
from minigpt.data.chat import SkipReport, token_losses
from minigpt.data.preference import PairBatch, PreferencePair, load_preference_dataset, pad_pairs, read_preferences
from minigpt.errors import MiniGPTError
from minigpt.model.lora import adapters_disabled, apply_lora, lora_layers, trainable_parameters
from minigpt.model.quant import is_quantized
from minigpt.posttrain.sft import check_out_dir, prepare_chat, save_sft_output
from minigpt.runtime import DTYPES, pick_device
from minigpt.tokenizer.chat_template import ChatTemplate
from minigpt.train.mixed import autocast
from minigpt.train.schedule import decay_progress, warmup_cosine_lr

LOSS_TYPES = ("sigmoid", "ipo")
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclass
class DPOConfig:
    """Options of :func:`dpo`; ``lora_rank = None`` is full fine-tuning. ``lr`` defaults to 1e-6 (full; the DPO
    paper's and TRL's default) or 5e-6 (LoRA; the alignment-handbook Zephyr QLoRA recipe). Without ``max_steps`` /
    ``max_time`` the run lasts ``epochs`` epochs; ``warmup_steps`` defaults to 3% of the steps (cosine decay after)."""

    model: str
    data: str
    out_dir: str
    val_data: Optional[str] = None
    beta: float = 0.1
    loss: str = "sigmoid"
    precompute_ref: bool = False
    lora_rank: Optional[int] = None
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05  # kept in the adapter's config; switched off during DPO like all dropout
    lora_targets: str = "all-linear"
    max_steps: Optional[int] = None
    max_time: Optional[float] = None
    epochs: int = 1
    lr: Optional[float] = None
    min_lr_ratio: float = 0.1
    warmup_steps: Optional[int] = None
    batch_size: int = 8  # pairs per step (2x sequences)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seq_len: Optional[int] = None  # default: the model's max_seq_len; longer pairs are skipped
    strict: bool = False
    template: Optional[str] = None
    log_interval: int = 10
    eval_interval: int = 100
    max_val_pairs: int = 500
    device: str = "auto"
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise MiniGPTError(f"--beta must be positive, got {self.beta}")
        if self.loss not in LOSS_TYPES:
            raise MiniGPTError(f"--loss {self.loss!r}: choose one of {', '.join(LOSS_TYPES)}")
        if self.batch_size <= 0 or self.epochs <= 0:
            raise MiniGPTError("--batch-size and --epochs must be positive")
        if self.max_steps is not None and self.max_steps <= 0:
            raise MiniGPTError(f"--max-steps must be positive, got {self.max_steps}")
        if self.dtype not in DTYPES:
            raise MiniGPTError(f"--dtype {self.dtype!r}: choose one of {sorted(DTYPES)}")
        if self.lr is None:
            self.lr = 5e-6 if self.lora_rank else 1e-6

    @property
    def lora(self) -> bool:
        return self.lora_rank is not None


# ------------------------------------------------------------------------------------------------ the loss
def sequence_logps(model, batch: PairBatch) -> torch.Tensor:
    """Summed log-probabilities of each row's completion tokens ``[2 * batch]`` (float32, nats): the chosen rows
    then the rejected rows of ``batch`` (prompt and padding are not scored)."""
    return -token_losses(model(batch.tokens), batch.labels).sum(-1)


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float, loss_type: str = "sigmoid",
             chosen_lengths: Optional[torch.Tensor] = None, rejected_lengths: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses, chosen rewards and rejected rewards, each ``[batch]``, from summed answer log-probs
    ``[batch]`` of the policy and the reference (formulas and sources in the module docstring). The rewards are
    ``beta * (logp - ref_logp)``, detached. ``loss_type="ipo"`` needs the answers' token counts
    (``chosen_lengths`` / ``rejected_lengths``, clamped to >= 1 as TRL does). Raises :class:`MiniGPTError` for an
    unknown loss type."""
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))
    elif loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise MiniGPTError("the IPO loss needs the answers' token counts")
        h = chosen_logratios / chosen_lengths.clamp(min=1) - rejected_logratios / rejected_lengths.clamp(min=1)
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise MiniGPTError(f"unknown DPO loss type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def pair_metrics(losses: torch.Tensor, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                 chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-pair values ``[batch]`` (detached, float32, on the CPU) of the logged :data:`METRICS`."""
    values = {"loss": losses, "rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
              "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
              "rewards/margins": chosen_rewards - rejected_rewards, "logps/chosen": chosen_logps,
              "logps/rejected": rejected_logps}
    return {k: v.detach().float().cpu() for k, v in values.items()}


# ------------------------------------------------------------------------------------------------ the reference
def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability of ``model`` to 0 (``nn.Dropout`` layers, LoRA's included, and attention
    dropout), in place: TRL's ``disable_dropout_in_model``."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class Reference:
    """Reference log-probs for pair batches: a frozen ``ref_model``, else ``policy`` with its LoRA adapters
    disabled, or (after :meth:`precompute`) a table looked up by pair index."""

    def __init__(self, policy: nn.Module, ref_model: Optional[nn.Module] = None) -> None:
        self.policy, self.ref_model = policy, ref_model
        self.tables: dict[str, torch.Tensor] = {}  # dataset name -> [n_pairs, 2] (chosen, rejected)

    @torch.no_grad()
    def live(self, batch: PairBatch, ctx) -> torch.Tensor:
        """``[2 * batch]`` reference log-probs computed now (eval mode, no gradient)."""
        model = self.ref_model if self.ref_model is not None else self.policy
        disabled = adapters_disabled(model) if self.ref_model is None else contextlib.nullcontext()
        with _eval_mode(model), disabled, ctx():
            logps = sequence_logps(model, batch)
        model.pop_aux_loss()  # the reference's router losses train nothing
        return logps

    def precompute(self, name: str, pairs: list[PreferencePair], batch_size: int, pad_id: int, device, ctx) -> None:
        """Compute and keep the reference log-probs of every pair of dataset ``name`` (one pass, in order)."""
        from tqdm import tqdm

        rows = []
        for i in tqdm(range(0, len(pairs), batch_size), desc=f"reference log-probs ({name})", leave=False,
                      disable=None):
            batch = pad_pairs(pairs[i : i + batch_size], pad_id).to(device)
            rows.append(self.live(batch, ctx).float().cpu().view(2, -1).T)
        self.tables[name] = torch.cat(rows)

    def __call__(self, batch: PairBatch, name: str, ctx) -> torch.Tensor:
        if name in self.tables:
            table = self.tables[name][batch.index]  # [batch, 2]
            return torch.cat([table[:, 0], table[:, 1]]).to(batch.tokens.device)
        return self.live(batch, ctx)


def batch_loss(model, reference: Reference, batch: PairBatch, name: str, beta: float, loss_type: str, ctx
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean DPO loss of a pair batch (plus MoE router losses) and its per-pair metrics: one forward of the policy
    over chosen and rejected rows together, one of the reference (or a table lookup)."""
    with ctx():
        logps = sequence_logps(model, batch)
    aux = model.pop_aux_loss()
    ref = reference(batch, name, ctx)
    n = logps.shape[0] // 2
    lengths = batch.completion_lengths
    losses, chosen_rewards, rejected_rewards = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], beta, loss_type,
                                                        lengths[:n], lengths[n:])
    return losses.mean() + aux, pair_metrics(losses, chosen_rewards, rejected_rewards, logps[:n], logps[n:])


@torch.no_grad()
def evaluate(model, reference: Reference, pairs: list[PreferencePair], cfg: DPOConfig, pad_id: int, device, ctx,
             name: str = "val") -> dict[str, float]:
    """Means over ``pairs`` of the logged :data:`METRICS`, in eval mode."""
    totals: dict[str, list[torch.Tensor]] = {k: [] for k in METRICS}
    with _eval_mode(model):
        for i in range(0, len(pairs), cfg.batch_size):
            batch = pad_pairs(pairs[i : i + cfg.batch_size], pad_id, range(i, min(i + cfg.batch_size, len(pairs))))
            _, values = batch_loss(model, reference, batch.to(device), name, cfg.beta, cfg.loss, ctx)
            for k, v in values.items():
                totals[k].append(v)
    return {k: torch.cat(v).mean().item() for k, v in totals.items()}


# ------------------------------------------------------------------------------------------------ training
def _batches(pairs: list[PreferencePair], batch_size: int, pad_id: int, seed: int) -> Iterator[tuple[int, PairBatch]]:
    """``(epoch, batch)`` forever, reshuffling every epoch (``seed + epoch``)."""
    epoch = 0
    while True:
        order = list(range(len(pairs)))
        random.Random(seed + epoch).shuffle(order)
        for i in range(0, len(order), batch_size):
            index = order[i : i + batch_size]
            yield epoch, pad_pairs([pairs[j] for j in index], pad_id, index)
        epoch += 1


def train_dpo(model, train_pairs: list[PreferencePair], cfg: DPOConfig, pad_id: int, device,
              val_pairs: Optional[list[PreferencePair]] = None, metrics_path: Optional[Path] = None,
              ref_model=None) -> dict[str, Any]:
    """Run DPO on ``model`` in place (all its trainable parameters: the whole model, or the LoRA adapters) and
    return the last logged row. The reference is ``ref_model`` if given, else the adapters-disabled model (LoRA),
    else a frozen copy of ``model``; with ``cfg.precompute_ref`` its log-probs are computed once up front."""
    val_pairs = val_pairs or []
    ctx_dtype = DTYPES[cfg.dtype]
    ctx = lambda: autocast(device.type, ctx_dtype)  # noqa: E731
    disable_dropout(model)
    lora = bool(lora_layers(model))
    if ref_model is None and not lora and not cfg.precompute_ref:
        ref_model = copy.deepcopy(model).requires_grad_(False)
    reference = Reference(model, ref_model)
    if cfg.precompute_ref:
        reference.precompute("train", train_pairs, cfg.batch_size, pad_id, device, ctx)
        if val_pairs:
            reference.precompute("val", val_pairs, cfg.batch_size, pad_id, device, ctx)
    params = trainable_parameters(model)
    if not params:
        raise MiniGPTError("the model has no trainable parameters")
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))
    per_epoch = math.ceil(len(train_pairs) / cfg.batch_size)
    max_steps = cfg.max_steps or (None if cfg.max_time else cfg.epochs * per_epoch)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, round(0.03 * (max_steps or 1000)))
    from tqdm import tqdm

    bar = tqdm(total=max_steps, unit="step", dynamic_ncols=True, disable=None)
    batches = _batches(train_pairs, cfg.batch_size, pad_id, cfg.seed)
    step, train_time, warmup_end, last = 0, 0.0, None, {}
    window: dict[str, list[torch.Tensor]] = {k: [] for k in METRICS}
    window_tokens, window_time = 0, 0.0
    model.train()
    try:
        while (max_steps is None or step < max_steps) and (cfg.max_time is None or train_time < cfg.max_time):
            t0 = time.perf_counter()
            epoch, batch = next(batches)
            batch = batch.to(device)
            progress = decay_progress(step, warmup, max_steps, train_time, warmup_end, cfg.max_time)
            lr = warmup_cosine_lr(step, lr=cfg.lr, min_lr=cfg.lr * cfg.min_lr_ratio, warmup_steps=warmup,
                                  progress=progress)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss, values = batch_loss(model, reference, batch, "train", cfg.beta, cfg.loss, ctx)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            dt = time.perf_counter() - t0
            train_time += dt
            if warmup_end is None and step >= warmup:
                warmup_end = train_time
            for k, v in values.items():
                window[k].append(v)
            window_tokens += batch.tokens.numel() - batch.n_pad
            window_time += dt
            bar.update(1)
            done = (max_steps is not None and step >= max_steps) or (cfg.max_time is not None
                                                                      and train_time >= cfg.max_time)
            if step % cfg.log_interval == 0 or step == 1 or done:
                row = {"step": step, "epoch": epoch, **{k: torch.cat(v).mean().item() for k, v in window.items()},
                       "lr": lr, "grad_norm": float(grad_norm), "tokens_per_s": window_tokens / max(window_time, 1e-9),
                       "train_time": train_time}
                if val_pairs and (step % cfg.eval_interval == 0 or done):
                    row.update({f"val_{k}": v for k, v in evaluate(model, reference, val_pairs, cfg, pad_id, device,
                                                                    ctx).items()})
                _append(metrics_path, row)
                last = row
                msg = (f"step {step}: loss {row['loss']:.4f} margin {row['rewards/margins']:.3f} "
                       f"acc {row['rewards/accuracies']:.2f}" + (f" | val acc {row['val_rewards/accuracies']:.2f}"
                                                                  if "val_loss" in row else ""))
                if bar.disable:
                    print(msg, flush=True)
                else:
                    bar.set_postfix_str(msg, refresh=False)
                window = {k: [] for k in METRICS}
                window_tokens, window_time = 0, 0.0
    except KeyboardInterrupt:
        print(f"\ninterrupted at step {step}: saving", file=sys.stderr, flush=True)
    finally:
        bar.close()
    if val_pairs and "val_loss" not in last:
        last = {**last, "step": step, **{f"val_{k}": v for k, v in evaluate(model, reference, val_pairs, cfg, pad_id,
                                                                             device, ctx).items()}}
        _append(metrics_path, last)
    return last


def _append(path: Optional[Path], row: dict[str, Any]) -> None:
    if path is not None:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def dpo(cfg: DPOConfig) -> dict[str, Any]:
    """Train as ``cfg`` says and write ``cfg.out_dir`` (see the module docstring); returns the last metrics row.

    Raises :class:`MiniGPTError` for an unreadable model or data file, bad options, or no usable pair.
    """
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.device)
    source = resolve_checkpoint(cfg.model)
    out_dir = Path(cfg.out_dir)
    check_out_dir(out_dir, source, "dpo_config.json", "DPO")
    report = SkipReport()
    records = read_preferences(cfg.data, cfg.strict, report)
    val_report = SkipReport()
    val_records = read_preferences(cfg.val_data, cfg.strict, val_report) if cfg.val_data else []
    model = load_model(source, device=device)
    if is_quantized(model):
        raise MiniGPTError(f"{source} is int8-quantized; train the float model it was quantized from")
    tokenizer, model_template = load_tokenizer(source), load_chat_template(source)
    new_ids: list[int] = []
    saved_template = model_template
    if cfg.template or any(r.conversational for r in records + val_records):
        tokenizer, template, saved_template, new_ids = prepare_chat(model, tokenizer, cfg.template, model_template)
    else:  # standard (string) pairs: the template object only tokenizes
        template = ChatTemplate(tokenizer)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else (tokenizer.eos_id or 0)
    eos_text = tokenizer.decode([tokenizer.eos_id]) if tokenizer.eos_id is not None else None
    seq_len = min(cfg.seq_len or model.config.max_seq_len, model.config.max_seq_len)
    train_pairs = load_preference_dataset(cfg.data, template, seq_len, eos_text, cfg.strict, report, records)
    print(report.summary(cfg.data, "pairs"), flush=True)
    val_pairs: list[PreferencePair] = []
    if cfg.val_data:
        val_pairs = load_preference_dataset(cfg.val_data, template, seq_len, eos_text, cfg.strict, val_report,
                                            val_records)[: cfg.max_val_pairs]
        print(val_report.summary(cfg.val_data, "pairs"), flush=True)

    modules_to_save: list[str] = []
    if cfg.lora:
        apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
        if new_ids:  # frozen here (the reference shares them), but saved: the adapter's base has the grown vocabulary
            modules_to_save = ["embed_tokens"] if model.config.tie_embeddings else ["embed_tokens", "lm_head"]
    n_trainable = sum(p.numel() for p in trainable_parameters(model))
    print(f"{'LoRA' if cfg.lora else 'full'} DPO ({cfg.loss}, beta {cfg.beta}) of {source}: {n_trainable:,} of "
          f"{sum(p.numel() for p in model.parameters()):,} parameters train | {len(train_pairs)} pairs, "
          f"{math.ceil(len(train_pairs) / cfg.batch_size)} batches/epoch of {cfg.batch_size} | reference: "
          f"{'precomputed' if cfg.precompute_ref else 'adapters disabled' if cfg.lora else 'frozen copy'} | "
          f"device {device}", flush=True)

    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / "metrics.jsonl"
    metrics_path.write_text("")
    last = train_dpo(model, train_pairs, cfg, pad_id, device, val_pairs, metrics_path)
    save_sft_output(model, tokenizer, saved_template, out_dir, cfg, str(source), modules_to_save,
                    config_file="dpo_config.json")
    print(f"wrote {out_dir}" + (f" (adapter in {out_dir / 'adapter'})" if cfg.lora else ""), flush=True)
    return last
