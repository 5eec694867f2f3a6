"""Supervised fine-tuning (SFT) on chat data, full or LoRA: a recipe of the shared trainer.

model + tokenizer -> chat template (the model's own, else ChatML, adding ``<|im_start|>``/``<|im_end|>`` when the
tokenizer lacks them) -> conversations with assistant-only labels (:mod:`minigpt.data.chat`) -> packed or padded
batches -> the trainer (:class:`minigpt.train.trainer.Trainer`: AdamW over the trainable parameters, all of them or
only the LoRA adapters, warmup + cosine learning rate, clipping, exact resume, DDP / FSDP, checkpoints, loss plot)
-> validation loss on assistant tokens -> a model directory (:mod:`minigpt.posttrain.recipe` has the layout).

The loss is the mean cross-entropy over the assistant tokens of the batch (the convention of ``transformers``'
``ForCausalLMLoss`` and TRL's ``SFTTrainer`` with ``assistant_only_loss``), so a conversation counts in proportion to
the length of its answers.

``metrics.jsonl`` rows: the trainer's (``step``, ``tokens``, ``lr``, ``grad_norm``, ``tokens_per_s``, ...) with
``tokens`` counting real (non-padding) tokens, ``loss`` the mean of the micro-batch losses since the previous row,
``padding_fraction`` of the rows drawn since then, ``epoch``, and ``val_loss`` at evaluations.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from minigpt.checkpoint.native import load_chat_template, load_tokenizer
from minigpt.checkpoint.tokenizer_bos import adds_bos
from minigpt.data.chat import ChatExample, SkipReport, is_plain, load_chat_dataset, read_conversations
from minigpt.data.chat_batches import Batch, iterate_batches, masked_lm_loss, pack_examples, pad_batch
from minigpt.errors import MiniGPTError
from minigpt.posttrain.packing import packed_forward, with_packed_forward
from minigpt.posttrain.recipe import EpochBatches, PostTrainConfig, PostTraining, pad_to
from minigpt.posttrain.vocab import add_chat_tokens
from minigpt.tokenizer.chat_template import CHATML_TEMPLATE, CHATML_TRAINING_TEMPLATE, ChatTemplate
from minigpt.train import distributed as dist_mod
from minigpt.train.trainer import autocast_context

BUILTIN_CHATML = "chatml"  # --template's name for the built-in ChatML


@dataclass
class SFTConfig(PostTrainConfig):
    """Options of :func:`sft` (and :class:`~minigpt.posttrain.recipe.PostTrainConfig`'s). ``lr`` defaults to
    2e-5 (full) or 2e-4 (LoRA), the usual orders of magnitude (Hu et al. 2021 table 11 use 2e-4 for GPT-2 LoRA)."""

    pack: bool = True
    train_on_prompt: bool = False
    max_val_conversations: int = 500


def prepare_chat(model, tokenizer, template_source: Optional[str], model_template: Optional[str]):
    """``(tokenizer, training template, template to save, new token ids)``: an explicit template file, else the
    model's own, else ChatML (adding its tokens to the tokenizer and the model when missing). ``"chatml"`` names
    the built-in ChatML whatever the model ships, e.g. to train tool rows on a model whose template has no tools
    section (one saved here before ChatML wrote tools)."""
    if template_source == BUILTIN_CHATML:
        template_source = model_template = None
    elif template_source and not Path(template_source).is_file():
        raise MiniGPTError(f"chat template file {template_source} does not exist")
    if template_source or model_template:
        text = Path(template_source).read_text(encoding="utf-8") if template_source else model_template
        return tokenizer, ChatTemplate(tokenizer, text), text, []
    tokenizer, new_ids = add_chat_tokens(model, tokenizer)
    return tokenizer, ChatTemplate(tokenizer, CHATML_TRAINING_TEMPLATE), CHATML_TEMPLATE, new_ids


def forward_loss(model, batch: Batch, pack: bool) -> torch.Tensor:
    """Masked next-token loss of ``batch`` (see :func:`minigpt.data.chat_batches.masked_lm_loss`) plus MoE router losses."""
    if pack:
        logits = packed_forward(model, batch.tokens, batch.position_ids, batch.doc_ids)
    else:
        logits = model(batch.tokens)
    return masked_lm_loss(logits, batch.labels) + model.pop_aux_loss()


class SFT(PostTraining):
    """The SFT recipe (see the module docstring)."""

    cfg: SFTConfig

    def load_data(self) -> int:
        cfg, model = self.cfg, self.loaded
        report, val_report = SkipReport(), SkipReport()
        records = read_conversations(cfg.data, cfg.strict, report)
        val_records = read_conversations(cfg.val_data, cfg.strict, val_report) if cfg.val_data else []
        tokenizer, model_template = load_tokenizer(self.source), load_chat_template(self.source)
        if cfg.template or not all(is_plain(r) for _, r in records + val_records):
            self.tokenizer, self.template, self.saved_template, self.new_ids = prepare_chat(
                model, tokenizer, cfg.template, model_template)
        else:  # only standard (string) rows: no chat template is used, and none is added to the model
            self.tokenizer, self.template, self.saved_template = tokenizer, ChatTemplate(tokenizer), model_template
        self.pad_id = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else (self.tokenizer.eos_id or 0)
        self.seq_len = min(cfg.seq_len or model.config.max_seq_len, model.config.max_seq_len)
        # Standard (string) rows are encoded as transformers' tokenizer(text) encodes them, as TRL does.
        bos_id = self.tokenizer.bos_id if adds_bos(self.source, self.tokenizer) else None
        self.train_examples = load_chat_dataset(cfg.data, self.template, self.seq_len, cfg.train_on_prompt,
                                                cfg.strict, report, bos_id, records)
        self.say(report.summary(cfg.data), flush=True)
        self.val_examples: list[ChatExample] = []
        if cfg.val_data:
            self.val_examples = load_chat_dataset(cfg.val_data, self.template, self.seq_len, cfg.train_on_prompt,
                                                  cfg.strict, val_report, bos_id, val_records
                                                  )[: cfg.max_val_conversations]
            self.say(val_report.summary(cfg.val_data), flush=True)
        return len(pack_examples(self.train_examples, self.seq_len)) if cfg.pack else len(self.train_examples)

    def train_new_rows(self, model) -> None:
        # The new tokens' rows must learn, or <|im_start|> and <|im_end|> stay indistinguishable.
        model.tok_embeddings.weight.requires_grad_(True)
        model.output.weight.requires_grad_(True)

    def adapt(self, model):
        model = super().adapt(model)
        return with_packed_forward(model) if self.cfg.pack else model

    def describe(self, model) -> str:
        cfg = self.cfg
        return (f"{super().describe(model)} | {len(self.train_examples)} conversations, {self.steps_per_epoch} "
                f"steps/epoch of {cfg.batch_size} {'packed rows' if cfg.pack else 'conversations'} (<= "
                f"{self.seq_len} tokens) | device {self.device}")

    def make_batches(self) -> EpochBatches:
        cfg = self.cfg
        width = self.seq_len if cfg.compile else 0  # compiled: one shape for every step

        def epoch_batches(epoch: int) -> list[Batch]:
            return [pad_to(b, width, self.pad_id, cfg.batch_size if cfg.compile else 0) for b in iterate_batches(
                self.train_examples, cfg.batch_size, self.pad_id, cfg.pack, self.seq_len, cfg.seed, epoch)]

        return EpochBatches(epoch_batches, self.info.rank, self.info.world_size)

    def batch_tokens(self, batch: Batch) -> int:
        real = batch.tokens.numel() - batch.n_pad
        self.record("padding_fraction", float(batch.n_pad), batch.tokens.numel())
        return real

    def batch_loss(self, forward, batch: Batch) -> torch.Tensor:
        if self.cfg.pack:
            logits = forward(batch.tokens, position_ids=batch.position_ids, doc_ids=batch.doc_ids)
        else:
            logits = forward(batch.tokens)
        loss = masked_lm_loss(logits, batch.labels)
        self.record("loss", loss)
        return loss

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over every assistant token of the validation conversations (nats/token), in padded batches,
        eval mode; the conversations are split over the ranks."""
        if not self.val_examples:
            return {}
        info, model = self.info, self.model
        n = len(self.val_examples)
        n -= n % info.world_size if n >= info.world_size else 0
        mine = self.val_examples[info.rank:n:info.world_size] if info.world_size <= n else self.val_examples
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        for i in range(0, len(mine), self.cfg.batch_size):
            batch = pad_batch(mine[i : i + self.cfg.batch_size], self.pad_id).to(self.device)
            scored = int((batch.labels[:, 1:] != -100).sum())
            with autocast_context(self.device, self.dtype):
                total += masked_lm_loss(model(batch.tokens), batch.labels).item() * scored
            model.pop_aux_loss()
            count += scored
        model.train(was_training)
        if info.world_size <= len(self.val_examples):
            total, count = dist_mod.all_reduce_sum([total, float(count)], info)
        return {"val_loss": total / max(count, 1)}

    def progress_note(self, row: dict[str, Any]) -> str:
        note = f" | pad {row['padding_fraction']:.1%}" if "padding_fraction" in row else ""
        return note + (f" | val_loss {row['val_loss']:.4f}" if "val_loss" in row else "")


def sft(cfg: SFTConfig) -> dict[str, Any]:
    """Fine-tune as ``cfg`` says and write ``cfg.out_dir`` (see :mod:`minigpt.posttrain.recipe`); returns the last
    metrics row with the trainer's result (``checkpoint``, ``interrupted``, the final ``val_loss``...).

    Raises :class:`MiniGPTError` for an unreadable model or data file, bad LoRA options, or no usable
    conversation.
    """
    recipe = SFT(cfg)
    result = recipe.run()
    return {**result, **recipe.last_row, **{k: v for k, v in result.items() if k.startswith("val_")}}
