"""Direct Preference Optimization (DPO), full or LoRA: a recipe of the shared trainer.

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

``sft_weight`` ``w`` > 0 adds an SFT term, the chosen answers' negative log-likelihood per token over the batch:

    loss += w * (-sum over chosen answers of log pi(y_c|x)) / (their total tokens)

TRL's ``loss_type=[..., "sft"]`` with ``loss_weights=[1, w]`` (``trl`` 1.16); RPO (Pang et al. 2024, "Iterative
Reasoning Preference Optimization", eq. 3) adds the same term with each answer normalised by its own length. It keeps
the policy's probability of the chosen answers up while DPO widens the margin, which DPO alone may reach by lowering
both.

The reference is a frozen copy of the starting model; with LoRA it is the same model with its adapters disabled
(:func:`~minigpt.model.lora.adapters_disabled`, as TRL does with PEFT), so no second copy is held; with
``precompute_ref`` its log-probs for every pair are computed once before training (TRL's
``precompute_ref_log_probs``), and no reference is kept at all for full fine-tuning. It always runs in eval mode.
Dropout is disabled in the policy, as TRL's ``disable_dropout=True`` default does, so that the policy equals the
reference at step 0 and the implicit rewards start at exactly 0.

Logged per row (``metrics.jsonl``, means over the pairs of the logged steps; TRL's names): ``loss``,
``rewards/chosen``, ``rewards/rejected`` (``beta`` times the log-ratios), ``rewards/accuracies`` (fraction with
chosen reward > rejected reward), ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (summed answer
log-probs, nats), plus the trainer's ``lr``, ``grad_norm``, ``tokens_per_s`` (real tokens) and, with validation
pairs, the same metrics prefixed ``val_`` (TRL: ``eval_``).

The trainer (:class:`minigpt.train.trainer.Trainer`) runs the steps: exact resume, DDP / FSDP, checkpoints, loss
plot. Output ``out_dir``: the layout of :mod:`minigpt.posttrain.recipe`, options in ``dpo_config.json``.
"""
from __future__ import annotations

import contextlib
import copy
import random
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from minigpt.checkpoint.native import load_chat_template, load_tokenizer
from minigpt.checkpoint.tokenizer_bos import adds_bos
from minigpt.data.chat import SkipReport
from minigpt.data.chat_batches import token_losses
from minigpt.data.preference import PairBatch, PreferencePair, load_preference_dataset, pad_pairs, read_preferences
from minigpt.errors import MiniGPTError
from minigpt.model.lora import adapters_disabled
from minigpt.posttrain.recipe import EpochBatches, PostTrainConfig, PostTraining, pad_to
from minigpt.posttrain.sft import prepare_chat
from minigpt.tokenizer.chat_template import ChatTemplate
from minigpt.train.trainer import autocast_context

LOSS_TYPES = ("sigmoid", "ipo")
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclass
class DPOConfig(PostTrainConfig):
    """Options of :func:`dpo` (and :class:`~minigpt.posttrain.recipe.PostTrainConfig`'s). ``lr`` defaults to 1e-6
    (full; the DPO paper's and TRL's default) or 5e-6 (LoRA; the alignment-handbook Zephyr QLoRA recipe).
    ``batch_size`` counts pairs (2x sequences); ``lora_dropout`` is kept in the adapter's config but switched off
    during DPO like all dropout."""

    beta: float = 0.1
    loss: str = "sigmoid"
    sft_weight: float = 0.0
    precompute_ref: bool = False
    max_val_pairs: int = 500

    default_lr = (1e-6, 5e-6)

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise MiniGPTError(f"--beta must be positive, got {self.beta}")
        if self.loss not in LOSS_TYPES:
            raise MiniGPTError(f"--loss {self.loss!r}: choose one of {', '.join(LOSS_TYPES)}")
        if not 0 <= self.sft_weight < float("inf"):
            raise MiniGPTError(f"--sft-weight must be a finite number >= 0, got {self.sft_weight}")
        super().__post_init__()


# ------------------------------------------------------------------------------------------------ the loss
def sequence_logps(model, batch: PairBatch) -> torch.Tensor:
    """Summed log-probabilities of each row's completion tokens ``[2 * batch]`` (float32, nats): the chosen rows
    then the rejected rows of ``batch`` (prompt and padding are not scored)."""
    return -token_losses(model(batch.tokens), batch.labels).sum(-1)


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float, loss_type: str = "sigmoid",
             chosen_lengths: Optional[torch.Tensor] = None, rejected_lengths: Optional[torch.Tensor] = None,
             sft_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses, chosen rewards and rejected rewards, each ``[batch]``, from summed answer log-probs
    ``[batch]`` of the policy and the reference (formulas and sources in the module docstring). The rewards are
    ``beta * (logp - ref_logp)``, detached. ``loss_type="ipo"`` and ``sft_weight`` > 0 need the answers' token
    counts (``chosen_lengths`` / ``rejected_lengths``, clamped to >= 1 as TRL does); ``sft_weight`` times
    :func:`chosen_nll` is added to every pair's loss, as TRL spreads its batch-level SFT term. Raises :class:`MiniGPTError` for an
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
    if sft_weight:
        losses = losses + sft_weight * chosen_nll(chosen_logps, chosen_lengths)
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def chosen_nll(chosen_logps: torch.Tensor, chosen_lengths: torch.Tensor) -> torch.Tensor:
    """The SFT term (module docstring): the chosen answers' summed log-probs ``[batch]`` over their total tokens
    ``[batch]``, negated; a scalar in nats per token."""
    return -chosen_logps.sum() / chosen_lengths.sum().clamp(min=1)


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


def batch_loss(model, reference: Reference, batch: PairBatch, name: str, beta: float, loss_type: str, ctx,
               sft_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean DPO loss of a pair batch (with ``sft_weight`` times :func:`chosen_nll`, plus MoE router losses) and its
    per-pair metrics: one forward of the policy over chosen and rejected rows together, one of the reference (or a
    table lookup)."""
    with ctx():
        logps = sequence_logps(model, batch)
    aux = model.pop_aux_loss()
    ref = reference(batch, name, ctx)
    n = logps.shape[0] // 2
    lengths = batch.completion_lengths
    losses, chosen_rewards, rejected_rewards = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], beta, loss_type,
                                                        lengths[:n], lengths[n:], sft_weight)
    return losses.mean() + aux, pair_metrics(losses, chosen_rewards, rejected_rewards, logps[:n], logps[n:])


@torch.no_grad()
def evaluate(model, reference: Reference, pairs: list[PreferencePair], cfg: DPOConfig, pad_id: int, device, ctx,
             name: str = "val") -> dict[str, float]:
    """Means over ``pairs`` of the logged :data:`METRICS`, in eval mode."""
    totals: dict[str, list[torch.Tensor]] = {k: [] for k in METRICS}
    with _eval_mode(model):
        for i in range(0, len(pairs), cfg.batch_size):
            batch = pad_pairs(pairs[i : i + cfg.batch_size], pad_id, range(i, min(i + cfg.batch_size, len(pairs))))
            _, values = batch_loss(model, reference, batch.to(device), name, cfg.beta, cfg.loss, ctx, cfg.sft_weight)
            for k, v in values.items():
                totals[k].append(v)
    return {k: torch.cat(v).mean().item() for k, v in totals.items()}


# ------------------------------------------------------------------------------------------------ training
class DPO(PostTraining):
    """The DPO recipe (see the module docstring)."""

    cfg: DPOConfig
    recipe, kind, config_file = "dpo", "DPO", "dpo_config.json"

    def load_data(self) -> int:
        cfg, model = self.cfg, self.loaded
        report, val_report = SkipReport(), SkipReport()
        records = read_preferences(cfg.data, cfg.strict, report)
        val_records = read_preferences(cfg.val_data, cfg.strict, val_report) if cfg.val_data else []
        self.tokenizer, model_template = load_tokenizer(self.source), load_chat_template(self.source)
        self.saved_template = model_template
        if cfg.template or any(r.conversational for r in records + val_records):
            self.tokenizer, template, self.saved_template, self.new_ids = prepare_chat(
                model, self.tokenizer, cfg.template, model_template)
        else:  # standard (string) pairs: the template object only tokenizes
            template = ChatTemplate(self.tokenizer)
        tok = self.tokenizer
        self.pad_id = tok.pad_id if tok.pad_id is not None else (tok.eos_id or 0)
        eos_text = tok.decode([tok.eos_id]) if tok.eos_id is not None else None
        self.seq_len = min(cfg.seq_len or model.config.max_seq_len, model.config.max_seq_len)
        bos_id = tok.bos_id if adds_bos(self.source, tok) else None  # standard text as tokenizer(text), as TRL
        self.train_pairs = load_preference_dataset(cfg.data, template, self.seq_len, eos_text, cfg.strict, report,
                                                   records, tok.eos_id, bos_id)
        self.say(report.summary(cfg.data, "pairs"), flush=True)
        self.val_pairs: list[PreferencePair] = []
        if cfg.val_data:
            self.val_pairs = load_preference_dataset(cfg.val_data, template, self.seq_len, eos_text, cfg.strict,
                                                     val_report, val_records, tok.eos_id, bos_id)[: cfg.max_val_pairs]
            self.say(val_report.summary(cfg.val_data, "pairs"), flush=True)
        return len(self.train_pairs)

    def adapt(self, model):
        model = super().adapt(model)  # with LoRA, new token rows stay frozen: the reference shares them
        disable_dropout(model)
        return model

    def build_model(self):
        model = super().build_model()
        cfg = self.cfg
        # The reference: the adapters-disabled policy (LoRA), a table (precompute_ref), else a frozen copy.
        self.ref_model = None if cfg.lora or cfg.precompute_ref else copy.deepcopy(model).requires_grad_(False)
        return model

    def describe(self, model) -> str:
        cfg = self.cfg
        reference = "precomputed" if cfg.precompute_ref else "adapters disabled" if cfg.lora else "frozen copy"
        sft = f", SFT term x {cfg.sft_weight:g}" if cfg.sft_weight else ""
        return (f"{super().describe(model).replace(' DPO of', f' DPO ({cfg.loss}, beta {cfg.beta}{sft}) of')} | "
                f"{len(self.train_pairs)} pairs, {self.steps_per_epoch} steps/epoch of {cfg.batch_size} | "
                f"reference: {reference} | device {self.device}")

    def tokens_per_micro_batch(self) -> int:
        return 2 * self.cfg.batch_size * self.seq_len

    def batch_tokens(self, batch: PairBatch) -> int:
        return batch.tokens.numel() - batch.n_pad

    def make_batches(self) -> EpochBatches:
        cfg = self.cfg
        if self.ref_model is not None:
            self.ref_model.to(self.device)
        self.reference = Reference(self.model, self.ref_model)
        if cfg.precompute_ref:  # before a resumed run loads its weights: the reference is the starting model
            ctx = lambda: autocast_context(self.device, self.dtype)  # noqa: E731
            self.reference.precompute("train", self.train_pairs, cfg.batch_size, self.pad_id, self.device, ctx)
            if self.val_pairs:
                self.reference.precompute("val", self.val_pairs, cfg.batch_size, self.pad_id, self.device, ctx)

        width = self.seq_len if cfg.compile else 0  # compiled: one shape for every step

        def epoch_batches(epoch: int) -> list[PairBatch]:
            order = list(range(len(self.train_pairs)))
            random.Random(cfg.seed + epoch).shuffle(order)
            return [pad_to(pad_pairs([self.train_pairs[j] for j in order[i : i + cfg.batch_size]], self.pad_id,
                                     order[i : i + cfg.batch_size]), width, self.pad_id)
                    for i in range(0, len(order), cfg.batch_size)]

        return EpochBatches(epoch_batches, self.info.rank, self.info.world_size)

    def batch_loss(self, forward, batch: PairBatch) -> torch.Tensor:
        # The reference first: its (discarded) router losses are popped before the policy's, which the trainer adds.
        ref = self.reference(batch, "train", contextlib.nullcontext)  # already under the trainer's autocast
        logps = -token_losses(forward(batch.tokens), batch.labels).sum(-1)
        n = logps.shape[0] // 2
        lengths = batch.completion_lengths
        losses, chosen_rewards, rejected_rewards = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], self.cfg.beta,
                                                            self.cfg.loss, lengths[:n], lengths[n:],
                                                            self.cfg.sft_weight)
        for k, v in pair_metrics(losses, chosen_rewards, rejected_rewards, logps[:n], logps[n:]).items():
            self.record(k, v)
        return losses.mean()

    def evaluate(self) -> dict[str, float]:
        """The logged metrics over the validation pairs (every rank scores all of them), prefixed ``val_``."""
        if not self.val_pairs:
            return {}
        values = evaluate(self.model, self.reference, self.val_pairs, self.cfg, self.pad_id, self.device,
                          lambda: autocast_context(self.device, self.dtype))
        return {f"val_{k}": v for k, v in values.items()}

    def progress_note(self, row: dict[str, Any]) -> str:
        note = f" | margin {row['rewards/margins']:.3f} acc {row['rewards/accuracies']:.2f}"
        return note + (f" | val acc {row['val_rewards/accuracies']:.2f}" if "val_loss" in row else "")


def dpo(cfg: DPOConfig) -> dict[str, Any]:
    """Train as ``cfg`` says and write ``cfg.out_dir`` (see the module docstring); returns the last metrics row
    with the trainer's result.

    Raises :class:`MiniGPTError` for an unreadable model or data file, bad options, or no usable pair.
    """
    recipe = DPO(cfg)
    result = recipe.run()
    return {**result, **recipe.last_row, **{k: v for k, v in result.items() if k.startswith("val_")}}
