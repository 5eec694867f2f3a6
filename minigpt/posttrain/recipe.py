"""What SFT and DPO share on top of the trainer (:class:`minigpt.train.trainer.Trainer`): the options, loading the
model to tune (chat tokens added, optionally an int8-quantized frozen base, LoRA), an epoch-wise resumable batch
source, windowed metrics, and the final model directory written next to the run files.

Run directory ``out_dir`` (the trainer's files, see :mod:`minigpt.train.trainer`, plus the output)::

    config.yaml, metrics.jsonl, loss_curve.png, checkpoints/step_N/, latest     the trainer's run files
    config.json, model.safetensors, tokenizer.json, chat_template.jinja        the tuned model (LoRA merged in)
    adapter/                                                                   with LoRA: the PEFT adapter folder
    sft_config.json | dpo_config.json, manifest.json                           the options; SHA-256 of the output

So ``out_dir`` is a model directory that every command reads (``config.json`` wins over ``latest`` in
:func:`~minigpt.checkpoint.native.resolve_checkpoint`) and a run directory that ``--resume`` continues. The output
files are written into a temporary directory, fsynced, then renamed into place one by one, ``config.json`` and the
manifest last; a fresh run (no ``--resume``) removes an earlier run's checkpoints first, so ``--resume`` never
continues a different run.

``--quantize int8`` (LoRA only) freezes the base as :class:`~minigpt.model.quant.Int8Linear` layers (per-channel
absmax, :mod:`minigpt.model.quant`) under float32 adapters, the QLoRA recipe (Dettmers et al. 2023) with int8
instead of NF4. Like bitsandbytes (``llm_int8_skip_modules``), the embedding and the LM head stay float, so new chat
tokens' rows can train and be saved as PEFT ``modules_to_save``. The final model directory is then the float base
with the adapter merged in (what PEFT's ``merge_and_unload`` on the float base gives).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from minigpt.checkpoint.adapter import load_adapter, save_adapter
from minigpt.checkpoint.atomic import MANIFEST, begin_atomic_dir, commit_atomic_dir
from minigpt.checkpoint.native import load_model, resolve_checkpoint, write_model_files
from minigpt.errors import MiniGPTError
from minigpt.model.lora import apply_lora, merge_lora, trainable_parameters
from minigpt.model.quant import Int8Linear, is_quantized
from minigpt.model.transformer import resize_token_embeddings
from minigpt.train import distributed as dist_mod
from minigpt.train.config import TrainerConfig
from minigpt.train.trainer import Trainer

QUANTIZE = ("int8",)


@dataclass
class PostTrainConfig(TrainerConfig):
    """Options SFT and DPO share, on top of the trainer's. ``lora_rank = None`` is full fine-tuning; ``lr``
    defaults to the recipe's ``default_lr`` (full, LoRA). Without ``max_steps`` / ``max_time`` the run lasts
    ``epochs`` epochs; ``warmup_steps`` defaults to 3% of the steps. AdamW uses ``betas = (0.9, 0.999)`` and no
    weight decay, ``transformers``' defaults."""

    out_dir: str = ""
    model: str = ""
    data: str = ""
    val_data: Optional[str] = None
    lora_rank: Optional[int] = None
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    lora_targets: str = "all-linear"
    quantize: Optional[str] = None  # int8: a frozen int8 base under the LoRA adapters
    epochs: int = 1
    lr: Optional[float] = None
    warmup_steps: Optional[int] = None
    batch_size: int = 8
    weight_decay: float = 0.0
    beta2: float = 0.999
    seq_len: Optional[int] = None  # default: the model's max_seq_len; longer examples are skipped
    strict: bool = False
    template: Optional[str] = None  # a Jinja file or "chatml"; default: the model's own template, else ChatML
    log_interval: int = 10
    eval_interval: int = 100
    seed: int = 0

    budget_required: ClassVar[bool] = False  # --epochs decides when no budget is given
    default_lr: ClassVar[tuple[float, float]] = (2e-5, 2e-4)

    def __post_init__(self) -> None:
        for name in ("model", "data", "out_dir"):
            if not getattr(self, name):
                raise MiniGPTError(f"--{name.replace('_', '-')} is required (as a flag or in the --config file)")
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise MiniGPTError(f"--quantize {self.quantize!r}: choose one of {', '.join(QUANTIZE)}")
        if self.quantize is not None and self.lora_rank is None:
            raise MiniGPTError(f"--quantize {self.quantize} needs --lora-rank: an int8 base is frozen, only LoRA "
                               "adapters train over it")
        if int(self.epochs) <= 0:
            raise MiniGPTError(f"--epochs must be positive, got {self.epochs}")
        if self.lr is None:
            self.lr = self.default_lr[self.lora_rank is not None]
        # Checked here, before the data loads: NaN reached AdamW's own check only then, 0 meant "the context".
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not 0 < self.lr < math.inf:
            raise MiniGPTError(f"--lr must be a positive number, got {self.lr!r}")
        if self.seq_len is not None and (isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int)
                                         or self.seq_len <= 0):
            raise MiniGPTError(f"--seq-len must be a positive integer (omit it for the model's context), "
                               f"got {self.seq_len!r}")
        if self.warmup_steps is not None and (isinstance(self.warmup_steps, bool)
                                              or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0):
            raise MiniGPTError(f"--warmup-steps must be an integer >= 0, got {self.warmup_steps!r}")
        try:
            super().__post_init__()
        except ValueError as e:
            raise MiniGPTError(f"invalid option: {e}") from None

    @property
    def lora(self) -> bool:
        return self.lora_rank is not None


def quantize_blocks(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` inside ``model.layers`` (but MoE routers) by a frozen :class:`Int8Linear`, in
    place; the embedding and the LM head stay float (see the module docstring). Returns ``model``."""
    for module in list(model.layers.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and name != "router":
                setattr(module, name, Int8Linear.from_linear(child))
    return model


class EpochBatches:
    """An endless, resumable stream of micro-batches made an epoch at a time by ``make_epoch(epoch)`` (a list,
    shuffled from the seed and the epoch). Rank ``r`` of ``world_size`` takes every ``world_size``-th batch from the
    ``r``-th on, so the ranks of one step see different batches. The state (``epoch``, ``position`` of the next
    step's first batch) is the same on every rank."""

    def __init__(self, make_epoch: Callable[[int], list], rank: int = 0, world_size: int = 1) -> None:
        self.make_epoch, self.rank, self.world_size = make_epoch, rank, world_size
        self.epoch, self.position = 0, 0
        self._cache: dict[int, list] = {}

    def _batches(self, epoch: int) -> list:
        if epoch not in self._cache:
            self._cache = {e: b for e, b in self._cache.items() if e >= epoch - 1}
            self._cache[epoch] = self.make_epoch(epoch)
        return self._cache[epoch]

    def _locate(self, epoch: int, position: int) -> tuple[int, int]:
        while position >= len(self._batches(epoch)):
            position -= len(self._batches(epoch))
            epoch += 1
        return epoch, position

    def next(self) -> Any:
        epoch, position = self._locate(self.epoch, self.position + self.rank)
        batch = self._batches(epoch)[position]
        self.epoch, self.position = self._locate(self.epoch, self.position + self.world_size)
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def pad_to(batch: Any, width: int, pad_id: int, rows: int = 0) -> Any:
    """``batch`` (a :class:`~minigpt.data.chat_batches.Batch` or :class:`~minigpt.data.preference.PairBatch`) right-padded
    to ``width`` columns and, for a :class:`~minigpt.data.chat_batches.Batch`, to ``rows`` rows: ``pad_id`` tokens, ``-100``
    labels, position 0 and document ``-1`` (packed rows). With ``--compile`` every step then has one shape, and one
    compiled graph serves the whole run; the masked mean loss ignores the padding, so it is unchanged."""
    extra, more = max(0, width - batch.tokens.shape[1]), max(0, rows - batch.tokens.shape[0])
    if not extra and not more:
        return batch
    grow = lambda t, value: torch.nn.functional.pad(t, (0, extra, 0, more), value=value)  # noqa: E731
    changes = {"tokens": grow(batch.tokens, pad_id), "labels": grow(batch.labels, -100),
               "n_pad": batch.n_pad + (batch.tokens.shape[0] + more) * (batch.tokens.shape[1] + extra)
               - batch.tokens.numel()}
    if getattr(batch, "position_ids", None) is not None:
        changes.update(position_ids=grow(batch.position_ids, 0), doc_ids=grow(batch.doc_ids, -1))
    return dataclasses.replace(batch, **changes)


# ------------------------------------------------------------------------------------------------ the run directory
OUTPUT_FILES = ("model.safetensors", "tokenizer.json", "chat_template.jinja", "adapter")


def is_output_of(out_dir: Path, recipe: str, config_file: str) -> bool:
    """True when ``out_dir`` holds an earlier ``recipe`` run: its ``config_file``, or a config.yaml naming it."""
    if (out_dir / config_file).is_file():
        return True
    if (out_dir / "config.yaml").is_file():
        import yaml

        try:
            return (yaml.safe_load((out_dir / "config.yaml").read_text()) or {}).get("recipe") == recipe
        except (yaml.YAMLError, AttributeError):
            return False
    return False


def check_out_dir(out_dir: Path, source: Path, recipe: str = "sft", config_file: str = "sft_config.json",
                  kind: str = "SFT") -> None:
    """Refuse an ``out_dir`` that is the model being tuned, or a non-empty directory that is not an earlier run of
    the same recipe: a fresh run replaces its checkpoints and its model files."""
    if out_dir.exists() and out_dir.resolve() == Path(source).resolve():
        raise MiniGPTError(f"--out-dir {out_dir} is the model being fine-tuned; choose another directory")
    names = [p.name for p in out_dir.iterdir()] if out_dir.is_dir() else []
    if names and names != ["metrics.jsonl"] and not is_output_of(out_dir, recipe, config_file):
        raise MiniGPTError(f"--out-dir {out_dir} is a non-empty directory that is not an {kind} output; it would be "
                           "replaced: choose a new or empty directory")


def clear_run(out_dir: Path, resume: bool) -> None:
    """Remove what a killed output write left (``.output.*``) and, for a fresh run, an earlier run's checkpoints."""
    for stale in out_dir.glob(".output.*"):
        shutil.rmtree(stale, ignore_errors=True)
    if not resume:
        shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
        (out_dir / "latest").unlink(missing_ok=True)


def publish_output(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Write the output files with ``write(tmp)`` into a temporary directory, commit it (SHA-256 manifest, fsync)
    and move its entries into ``out_dir`` one by one: the old manifest goes first, ``config.json`` and the new
    manifest last, so a model directory is never listed by a manifest it does not match."""
    staged = commit_atomic_dir(_write_to(begin_atomic_dir(out_dir / "output"), write), out_dir / ".output.new")
    (out_dir / MANIFEST).unlink(missing_ok=True)
    names = sorted(p.name for p in staged.iterdir())
    for name in OUTPUT_FILES:  # what an earlier run wrote and this one does not (a full run after a LoRA run)
        if name not in names and (out_dir / name).is_dir():
            shutil.rmtree(out_dir / name)
        elif name not in names:
            (out_dir / name).unlink(missing_ok=True)
    for name in sorted(names, key=lambda n: (n == "config.json", n == MANIFEST)):
        target = out_dir / name
        if (staged / name).is_dir():
            aside = out_dir / f".output.old-{name}"
            if target.exists():
                target.rename(aside)
            (staged / name).rename(target)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(staged / name, target)
    staged.rmdir()


def _write_to(tmp: Path, write: Callable[[Path], None]) -> Path:
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


# ------------------------------------------------------------------------------------------------ the recipe
class PostTraining(Trainer):
    """The part of SFT and DPO that is the same. Subclasses load their data (``load_data``), may change the model
    further (``adapt``, ``train_new_rows``), and implement the trainer's ``make_batches`` (an
    :class:`EpochBatches`), ``batch_loss`` (calling :meth:`record` for what the metrics rows report) and
    ``evaluate``; see the module docstring."""

    cfg: PostTrainConfig
    recipe, kind, config_file = "sft", "SFT", "sft_config.json"

    # ---- data and model
    def prepare_data(self) -> None:
        cfg, info = self.cfg, self.info
        self.source = resolve_checkpoint(cfg.model)
        if info.is_main:
            check_out_dir(self.out_dir, self.source, self.recipe, self.config_file, self.kind)
            clear_run(self.out_dir, cfg.resume)
        dist_mod.barrier(info)
        self.loaded = load_model(self.source)
        if is_quantized(self.loaded):
            raise MiniGPTError(f"{self.source} is int8-quantized; fine-tune the float model it was quantized from "
                               "(--quantize int8 quantizes it for LoRA)")
        self.new_ids: list[int] = []
        self.window: dict[str, tuple[Any, int]] = {}
        self.last_row: dict[str, Any] = {}
        n_rows = self.load_data()  # sets tokenizer, template, datasets, seq_len, new_ids
        world = cfg.batch_size * cfg.grad_accum * info.world_size
        self.steps_per_epoch = max(1, math.ceil(n_rows / world))
        if cfg.max_steps is None and cfg.max_time is None:
            cfg.max_steps = cfg.epochs * self.steps_per_epoch
        if cfg.warmup_steps is None:
            cfg.warmup_steps = max(1, round(0.03 * (cfg.max_steps or 1000)))

    def load_data(self) -> int:
        """Load the data; set ``tokenizer``, ``saved_template``, ``seq_len``, ``new_ids``. Returns the number of
        rows (or pairs) of one epoch."""
        raise NotImplementedError

    def adapt(self, model: nn.Module) -> nn.Module:
        """``model`` (float, chat tokens added) as it trains: int8 base, LoRA adapters, trainable flags."""
        cfg = self.cfg
        if cfg.quantize:
            quantize_blocks(model)
        self.modules_to_save: list[str] = []
        if cfg.lora:
            apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
            if self.new_ids:  # the adapter's base has the grown vocabulary: PEFT needs its rows in the folder
                self.modules_to_save = ["embed_tokens"] if model.config.tie_embeddings else ["embed_tokens", "lm_head"]
                self.train_new_rows(model)
        return model

    def train_new_rows(self, model: nn.Module) -> None:
        """With LoRA and new chat tokens: make the embedding (and head) rows trainable (SFT) or not (DPO)."""

    def build_model(self) -> nn.Module:
        model = self.adapt(self.loaded)
        del self.loaded
        if not trainable_parameters(model):
            raise MiniGPTError("the model has no trainable parameters")
        self.say(self.describe(model), flush=True)
        return model

    def describe(self, model: nn.Module) -> str:
        """The console line about what trains on what."""
        n_trainable = sum(p.numel() for p in trainable_parameters(model))
        return (f"{'LoRA' if self.cfg.lora else 'full'} {self.kind} of {self.source}"
                f"{' (int8 base)' if self.cfg.quantize else ''}: {n_trainable:,} of "
                f"{sum(p.numel() for p in model.parameters()):,} float parameters train")

    # ---- metrics
    def record(self, name: str, values: torch.Tensor | float, count: Optional[int] = None) -> None:
        """Add ``values`` (a tensor, summed without a host sync; or a number) over ``count`` items (default: its
        number of elements) to the mean that the next metrics row reports as ``name``."""
        total, n = self.window.get(name, (0.0, 0))
        if isinstance(values, torch.Tensor):
            count = values.numel() if count is None else count
            values = values.detach().float().sum()
        self.window[name] = (total + values, n + count)

    def log_fields(self, row: dict[str, Any]) -> None:
        names = sorted(self.window)
        sums = [float(self.window[k][0]) for k in names] + [float(self.window[k][1]) for k in names]
        totals = dist_mod.all_reduce_sum(sums, self.info)  # every rank logs the same rows: the means of all ranks
        for i, k in enumerate(names):
            row[k] = totals[i] / max(totals[len(names) + i], 1.0)
        self.window = {}
        row["epoch"] = self.batches.epoch
        self.last_row = row

    def resolved_config(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "source": str(self.source), "seq_len": self.seq_len,
                "max_steps": self.cfg.max_steps, "warmup_steps": self.cfg.warmup_steps}

    # ---- output
    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        model = self.model
        if self.sharded:  # every rank takes part in gathering the full weights; rank 0 writes them
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if self.main:
                model = self.adapt(self.reload())
                model.load_state_dict(state)
        if self.main:
            publish_output(self.out_dir, lambda tmp: self.write_output(model, tmp))
            self.say(f"wrote {self.out_dir}" + (f" (adapter in {self.out_dir / 'adapter'})" if self.cfg.lora
                                                else ""), flush=True)
        dist_mod.barrier(self.info)
        return result

    def reload(self) -> nn.Module:
        """The float starting model again (vocabulary grown as in training), on the CPU."""
        model = load_model(self.source)
        if self.new_ids:
            resize_token_embeddings(model, max(model.config.vocab_size, self.tokenizer.vocab_size), self.new_ids)
        return model

    def write_output(self, model: nn.Module, tmp: Path) -> None:
        """Model files (adapters merged), chat template, PEFT adapter folder and options into ``tmp``."""
        cfg = self.cfg
        model.eval()
        if cfg.lora:
            save_adapter(model, tmp / "adapter", base_model_name_or_path=str(self.source),
                         modules_to_save=self.modules_to_save)
            if cfg.quantize:  # merge into the float base, not into the rounded int8 weights
                model = self.reload()
                load_adapter(model, tmp / "adapter")
            merge_lora(model)
        write_model_files(model, tmp, self.tokenizer, self.saved_template)
        (tmp / self.config_file).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
