"""Supervised fine-tuning (SFT) on chat data, full or LoRA: a small loop, readable top to bottom.

model + tokenizer -> chat template (the model's own, else ChatML, adding ``<|im_start|>``/``<|im_end|>`` when the
tokenizer lacks them) -> conversations with assistant-only labels (:mod:`minigpt.data.chat`) -> packed or padded
batches -> AdamW over the trainable parameters (all of them, or only the LoRA adapters), warmup + cosine learning
rate, gradient clipping -> validation loss on assistant tokens -> one atomic model directory.

The loss is the mean cross-entropy over the assistant tokens of the batch (the convention of ``transformers``'
``ForCausalLMLoss`` and TRL's ``SFTTrainer`` with ``assistant_only_loss``), so a conversation counts in proportion to
the length of its answers.

Output ``out_dir`` (written atomically at the end, or when interrupted with Ctrl-C): a MiniGPT model directory
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``chat_template.jinja``; LoRA adapters merged in)
that every command reads, ``metrics.jsonl`` (one row per logged step: ``loss``, ``val_loss``, ``lr``,
``grad_norm``, ``tokens_per_s`` counting real tokens, ``padding_fraction``), ``sft_config.json``, and with LoRA
``adapter/``, the unmerged adapters in PEFT's format (:mod:`minigpt.checkpoint.adapter`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from minigpt.checkpoint.adapter import save_adapter
from minigpt.checkpoint.atomic import atomic_dir
from minigpt.checkpoint.native import (
    load_chat_template,
    load_model,
    load_tokenizer,
    resolve_checkpoint,
    write_model_files,
)
from minigpt.data.chat import (
    Batch,
    ChatExample,
    SkipReport,
    iterate_batches,
    load_chat_dataset,
    masked_lm_loss,
    pack_examples,
    pad_batch,
)
from minigpt.errors import MiniGPTError
from minigpt.model.lora import apply_lora, merge_lora, trainable_parameters
from minigpt.model.quant import is_quantized
from minigpt.posttrain.packing import packed_forward
from minigpt.posttrain.vocab import add_chat_tokens
from minigpt.runtime import DTYPES, pick_device
from minigpt.tokenizer.chat_template import CHATML_TEMPLATE, CHATML_TRAINING_TEMPLATE, ChatTemplate
from minigpt.train.mixed import autocast
from minigpt.train.schedule import decay_progress, warmup_cosine_lr


@dataclass
class SFTConfig:
    """Options of :func:`sft`; ``lora_rank = None`` is full fine-tuning. ``lr`` defaults to 2e-5 (full) or 2e-4
    (LoRA), the usual orders of magnitude (Hu et al. 2021 table 11 use 2e-4 for GPT-2 LoRA). Without
    ``max_steps`` / ``max_time`` the run lasts ``epochs`` epochs. ``warmup_steps`` defaults to 3% of the steps."""

    model: str
    data: str
    out_dir: str
    val_data: Optional[str] = None
    lora_rank: Optional[int] = None
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    lora_targets: str = "all-linear"
    max_steps: Optional[int] = None
    max_time: Optional[float] = None
    epochs: int = 1
    lr: Optional[float] = None
    min_lr_ratio: float = 0.1
    warmup_steps: Optional[int] = None
    batch_size: int = 8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    pack: bool = True
    seq_len: Optional[int] = None  # default: the model's max_seq_len
    train_on_prompt: bool = False
    strict: bool = False
    template: Optional[str] = None  # a Jinja file; default: the model's own template, else ChatML
    log_interval: int = 10
    eval_interval: int = 100
    max_val_conversations: int = 500
    device: str = "auto"
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or self.epochs <= 0:
            raise MiniGPTError("--batch-size and --epochs must be positive")
        if self.max_steps is not None and self.max_steps <= 0:
            raise MiniGPTError(f"--max-steps must be positive, got {self.max_steps}")
        if self.dtype not in DTYPES:
            raise MiniGPTError(f"--dtype {self.dtype!r}: choose one of {sorted(DTYPES)}")
        if self.lr is None:
            self.lr = 2e-4 if self.lora_rank else 2e-5

    @property
    def lora(self) -> bool:
        return self.lora_rank is not None


def prepare_chat(model, tokenizer, template_source: Optional[str], model_template: Optional[str]):
    """``(tokenizer, training template, template to save, new token ids)``: an explicit template, else the
    model's own, else ChatML (adding its tokens to the tokenizer and the model when missing)."""
    if template_source and not Path(template_source).is_file():
        raise MiniGPTError(f"chat template file {template_source} does not exist")
    if template_source or model_template:
        text = Path(template_source).read_text(encoding="utf-8") if template_source else model_template
        return tokenizer, ChatTemplate(tokenizer, text), text, []
    tokenizer, new_ids = add_chat_tokens(model, tokenizer)
    return tokenizer, ChatTemplate(tokenizer, CHATML_TRAINING_TEMPLATE), CHATML_TEMPLATE, new_ids


def forward_loss(model, batch: Batch, pack: bool) -> torch.Tensor:
    """Masked next-token loss of ``batch`` (see :func:`minigpt.data.chat.masked_lm_loss`) plus MoE router losses."""
    if pack:
        logits = packed_forward(model, batch.tokens, batch.position_ids, batch.doc_ids)
    else:
        logits = model(batch.tokens)
    return masked_lm_loss(logits, batch.labels) + model.pop_aux_loss()


@torch.no_grad()
def evaluate(model, examples: list[ChatExample], batch_size: int, pad_id: int, device, ctx_dtype) -> float:
    """Mean loss over every assistant token of ``examples`` (nats/token), in padded batches, eval mode."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        batch = pad_batch(examples[i : i + batch_size], pad_id).to(device)
        n = int((batch.labels[:, 1:] != -100).sum())
        with autocast(device.type, ctx_dtype):
            total += masked_lm_loss(model(batch.tokens), batch.labels).item() * n
        count += n
    model.train(was_training)
    return total / max(count, 1)


def _batches(examples, cfg: SFTConfig, pad_id: int, seq_len: int) -> Iterator[tuple[int, Batch]]:
    """``(epoch, batch)`` forever, reshuffling every epoch."""
    epoch = 0
    while True:
        for batch in iterate_batches(examples, cfg.batch_size, pad_id, cfg.pack, seq_len, cfg.seed, epoch):
            yield epoch, batch
        epoch += 1


def sft(cfg: SFTConfig) -> dict[str, Any]:
    """Fine-tune as ``cfg`` says and write ``cfg.out_dir`` (see the module docstring); returns the last metrics row.

    Raises :class:`MiniGPTError` for an unreadable model or data file, bad LoRA options, or no usable
    conversation.
    """
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.device)
    source = resolve_checkpoint(cfg.model)
    check_out_dir(Path(cfg.out_dir), source)
    model = load_model(source, device=device)
    if is_quantized(model):
        raise MiniGPTError(f"{source} is int8-quantized; fine-tune the float model it was quantized from")
    tokenizer, template, saved_template, new_ids = prepare_chat(model, load_tokenizer(source), cfg.template,
                                                                load_chat_template(source))
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else (tokenizer.eos_id or 0)
    seq_len = min(cfg.seq_len or model.config.max_seq_len, model.config.max_seq_len)

    report = SkipReport()
    train_examples = load_chat_dataset(cfg.data, template, seq_len, cfg.train_on_prompt, cfg.strict, report)
    print(report.summary(cfg.data), flush=True)
    val_examples: list[ChatExample] = []
    if cfg.val_data:
        val_report = SkipReport()
        val_examples = load_chat_dataset(cfg.val_data, template, seq_len, cfg.train_on_prompt, cfg.strict,
                                         val_report)[: cfg.max_val_conversations]
        print(val_report.summary(cfg.val_data), flush=True)

    modules_to_save: list[str] = []
    if cfg.lora:
        apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
        if new_ids:  # the new tokens' rows must learn, or <|im_start|> and <|im_end|> stay indistinguishable
            model.tok_embeddings.weight.requires_grad_(True)
            model.output.weight.requires_grad_(True)
            modules_to_save = ["embed_tokens"] if model.config.tie_embeddings else ["embed_tokens", "lm_head"]
    params = trainable_parameters(model)
    n_trainable, n_total = sum(p.numel() for p in params), sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))

    rows = len(pack_examples(train_examples, seq_len)) if cfg.pack else len(train_examples)
    per_epoch = math.ceil(rows / cfg.batch_size)  # packed: the first epoch's order; later orders differ by a row or so
    max_steps = cfg.max_steps or (None if cfg.max_time else cfg.epochs * per_epoch)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, round(0.03 * (max_steps or 1000)))
    print(f"{'LoRA' if cfg.lora else 'full'} SFT of {source}: {n_trainable:,} of {n_total:,} parameters train | "
          f"{len(train_examples)} conversations, {per_epoch} batches/epoch of {cfg.batch_size} "
          f"{'packed rows' if cfg.pack else 'conversations'} (<= {seq_len} tokens) | device {device}", flush=True)

    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / "metrics.jsonl"
    metrics_path.write_text("")
    from tqdm import tqdm

    bar = tqdm(total=max_steps, unit="step", dynamic_ncols=True, disable=None)
    ctx_dtype = DTYPES[cfg.dtype]
    batches = _batches(train_examples, cfg, pad_id, seq_len)
    step, train_time, warmup_end, last = 0, 0.0, None, {}
    window_tokens, window_pad, window_time, window_loss, window_steps = 0, 0, 0.0, 0.0, 0
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
            with autocast(device.type, ctx_dtype):
                loss = forward_loss(model, batch, cfg.pack)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            dt = time.perf_counter() - t0
            train_time += dt
            if warmup_end is None and step >= warmup:
                warmup_end = train_time
            window_tokens += batch.tokens.numel() - batch.n_pad
            window_pad += batch.n_pad
            window_time += dt
            window_loss += loss.item()
            window_steps += 1
            bar.update(1)
            done = (max_steps is not None and step >= max_steps) or (cfg.max_time is not None
                                                                      and train_time >= cfg.max_time)
            if step % cfg.log_interval == 0 or step == 1 or done:
                row = {"step": step, "epoch": epoch, "loss": window_loss / window_steps, "lr": lr,
                       "grad_norm": float(grad_norm), "tokens_per_s": window_tokens / max(window_time, 1e-9),
                       "padding_fraction": window_pad / max(window_pad + window_tokens, 1), "train_time": train_time}
                if val_examples and (step % cfg.eval_interval == 0 or done):
                    row["val_loss"] = evaluate(model, val_examples, cfg.batch_size, pad_id, device, ctx_dtype)
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                last = row
                msg = (f"step {step}: loss {row['loss']:.4f}" + (f" val_loss {row['val_loss']:.4f}" if "val_loss"
                       in row else "") + f" | {row['tokens_per_s']:,.0f} tok/s | pad {row['padding_fraction']:.1%}")
                if bar.disable:
                    print(msg, flush=True)
                else:
                    bar.set_postfix_str(msg, refresh=False)
                window_tokens, window_pad, window_time, window_loss, window_steps = 0, 0, 0.0, 0.0, 0
    except KeyboardInterrupt:
        print(f"\ninterrupted at step {step}: saving", file=sys.stderr, flush=True)
    finally:
        bar.close()
    if val_examples and "val_loss" not in last:
        last = {**last, "step": step, "val_loss": evaluate(model, val_examples, cfg.batch_size, pad_id, device,
                                                           ctx_dtype)}
        with open(metrics_path, "a") as f:
            f.write(json.dumps(last) + "\n")
    save_sft_output(model, tokenizer, saved_template, out_dir, cfg, str(source), modules_to_save)
    print(f"wrote {out_dir}" + (f" (adapter in {out_dir / 'adapter'})" if cfg.lora else ""), flush=True)
    return last


def check_out_dir(out_dir: Path, source: Path, config_file: str = "sft_config.json", kind: str = "SFT") -> None:
    """Refuse an ``out_dir`` that is the model being tuned or a non-empty directory that is not an earlier output
    of the same kind (one holding ``config_file``): the final atomic write replaces the whole directory."""
    if out_dir.exists() and out_dir.resolve() == Path(source).resolve():
        raise MiniGPTError(f"--out-dir {out_dir} is the model being fine-tuned; choose another directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / config_file).is_file() \
            and [p.name for p in out_dir.iterdir()] != ["metrics.jsonl"]:
        raise MiniGPTError(f"--out-dir {out_dir} is a non-empty directory that is not an {kind} output; it would be "
                           "replaced: choose a new or empty directory")


def save_sft_output(model, tokenizer, template: Optional[str], out_dir: Path, cfg, base: str,
                    modules_to_save: list[str], config_file: str = "sft_config.json") -> None:
    """Atomically replace ``out_dir`` by the model directory (adapters merged), its chat template (if any), the
    PEFT adapter folder (LoRA, when ``cfg.lora``), ``config_file`` (``cfg`` as JSON) and the ``metrics.jsonl``
    written so far."""
    metrics = (out_dir / "metrics.jsonl").read_text() if (out_dir / "metrics.jsonl").is_file() else ""
    model.eval()
    with atomic_dir(out_dir) as tmp:
        if cfg.lora:
            save_adapter(model, tmp / "adapter", base_model_name_or_path=base, modules_to_save=modules_to_save)
            merge_lora(model)
        write_model_files(model, tmp, tokenizer)
        if template is not None:
            (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
        (tmp / config_file).write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
        (tmp / "metrics.jsonl").write_text(metrics)
