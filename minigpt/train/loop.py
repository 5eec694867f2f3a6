"""Pretraining: a model from a preset, trained on a prepared corpus with the next-token loss; ``minigpt train``.

The recipe on top of the shared trainer (:mod:`minigpt.train.trainer`, which also describes the run directory):

* data: ``cfg.data`` is a prepared directory, or a corpus that is prepared into ``out_dir/data`` first (by rank 0;
  the tokenizer is trained there, ``cfg.vocab_size`` tokens); batches are random packed windows of ``seq_len + 1``
  tokens of the train split (:class:`~minigpt.data.loader.BatchSampler`, resumable, independent of the world size);
* model: the ``cfg.preset`` :class:`~minigpt.model.transformer.Transformer` with ``cfg.model`` overrides and the
  tokenizer's vocabulary, randomly initialised from ``cfg.seed``;
* loss: mean next-token cross-entropy (:func:`~minigpt.model.transformer.lm_loss`), nats/token;
* evaluation: ``cfg.eval_windows`` fixed windows of the val split (:func:`~minigpt.data.loader.eval_windows`):
  ``val_loss``, ``val_ppl = exp(val_loss)`` and ``val_bpb`` (bits per UTF-8 byte, Gao et al. 2020).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from minigpt.data import loader
from minigpt.data import prepare as data_mod
from minigpt.errors import MiniGPTError
from minigpt.model.config import ModelConfig, preset
from minigpt.model.transformer import Transformer, lm_loss
from minigpt.tokenizer.tokenizer import Tokenizer, check_vocab_size
from minigpt.train import distributed as dist_mod
from minigpt.train.config import TrainerConfig
from minigpt.train.trainer import Trainer, evaluate


@dataclass
class TrainConfig(TrainerConfig):
    """Everything a pretraining run needs; set from a YAML file, flags and ``--set key=value`` overrides."""

    out_dir: str = "runs/tiny"
    data: str = "shakespeare"  # prepared directory, bundled corpus name, or text/jsonl/parquet path
    preset: str = "tiny"
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig overrides on top of the preset
    vocab_size: int = 4096  # used only when the data still has to be prepared (tokenizer trained here)
    seq_len: Optional[int] = None  # training window; default: the model's max_seq_len
    eval_windows: int = 200

    def __post_init__(self) -> None:
        super().__post_init__()
        if int(self.eval_windows) <= 0:
            raise ValueError(f"eval_windows must be a positive integer, got {self.eval_windows!r}")

    def to_dict(self) -> dict[str, Any]:
        # config.yaml keeps the order it had before the trainer's options moved to a base class: what is trained on
        # what first.
        d = super().to_dict()
        first = ("data", "out_dir", "preset", "model", "vocab_size", "seq_len", "batch_size", "grad_accum", "lr",
                 "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "eps", "grad_clip", "max_steps",
                 "max_time", "eval_interval", "eval_windows")
        return {**{k: d[k] for k in first}, **d}


def prepared_data(cfg: TrainConfig) -> Optional[Path]:
    """The prepared data directory ``cfg`` names (``cfg.data`` itself, else ``out_dir/data`` once made), or None
    while the source still has to be prepared."""
    for where in (Path(cfg.data), Path(cfg.out_dir) / "data"):
        if (where / loader.META_FILE).is_file():
            return where
    return None


def ensure_data(cfg: TrainConfig) -> Path:
    """A prepared data directory: ``cfg.data`` itself, or ``out_dir/data`` prepared from the named source."""
    data_dir = prepared_data(cfg)
    if data_dir is None:
        data_dir = Path(cfg.out_dir) / "data"
        print(f"preparing {cfg.data} into {data_dir} (vocab {cfg.vocab_size})", flush=True)
        data_mod.prepare(cfg.data, data_dir, vocab_size=cfg.vocab_size)
    return data_dir


def model_config(cfg: TrainConfig, vocab_size: int) -> tuple[ModelConfig, int]:
    """``(the model cfg describes over a vocab_size-token vocabulary, the training window seq_len)``.

    Raises :class:`MiniGPTError` for a preset, ``cfg.model`` override or ``seq_len`` that cannot make a model.
    """
    try:
        model_cfg = preset(cfg.preset, **{"vocab_size": vocab_size, **cfg.model})
    except (TypeError, ValueError) as e:
        raise MiniGPTError(f"invalid model config: {e}") from None
    seq_len = cfg.seq_len or model_cfg.max_seq_len
    if seq_len > model_cfg.max_seq_len:
        raise MiniGPTError(f"seq_len {seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}")
    return model_cfg, seq_len


class Pretraining(Trainer):
    """The pretraining recipe (see the module docstring)."""

    cfg: TrainConfig

    def prepare_data(self) -> None:
        # Options that cannot make a model fail before the data is prepared, which can take long; the tokenizer's
        # vocabulary is not known yet (4096 stands in). Every rank checks, so none waits at the barrier for one
        # that failed.
        cfg = self.cfg
        if prepared_data(cfg) is None:
            try:
                check_vocab_size(cfg.vocab_size)
            except ValueError as e:
                raise MiniGPTError(f"invalid training config: {e}") from None
        model_config(cfg, cfg.model.get("vocab_size", 4096))
        # Rank 0 prepares; the others wait, then read.
        if self.info.is_main:
            self.data_dir = ensure_data(self.cfg)
        dist_mod.barrier(self.info)
        if not self.info.is_main:
            self.data_dir = ensure_data(self.cfg)
        self.meta = loader.load_meta(self.data_dir)
        self.tokenizer = Tokenizer.from_dir(self.data_dir)
        self.train_tokens = loader.load_split(self.data_dir, "train")
        self.val_tokens = loader.load_split(self.data_dir, "val")

    def build_model(self) -> Transformer:
        self.model_cfg, self.seq_len = model_config(self.cfg, self.tokenizer.vocab_size)
        return Transformer(self.model_cfg)

    def make_batches(self) -> loader.BatchSampler:
        cfg, info = self.cfg, self.info
        self.eval_x, self.eval_y = loader.eval_windows(self.val_tokens, self.seq_len, cfg.eval_windows)
        return loader.BatchSampler(self.train_tokens, cfg.batch_size, self.seq_len, seed=cfg.seed, rank=info.rank,
                                   world_size=info.world_size)

    def batch_loss(self, forward, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return lm_loss(forward(x), y)

    def evaluate(self) -> dict[str, float]:
        val_loss = evaluate(self.model, self.eval_x, self.eval_y, self.cfg.batch_size, self.autocast, self.info)
        val = self.meta["val"]
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)),
                "val_bpb": loader.bits_per_byte(val_loss, val["tokens"], val["bytes"])}

    def resolved_config(self) -> dict[str, Any]:
        return {"model": self.model_cfg.to_dict(), "seq_len": self.seq_len, "data_dir": str(self.data_dir)}

    def log_fields(self, row: dict[str, Any]) -> None:
        row["ppl"] = math.exp(min(row["loss"], 50.0))
        row["bpb"] = row.get("val_bpb")

    def progress_note(self, row: dict[str, Any]) -> str:
        if "val_loss" not in row:
            return ""
        return f" | val_loss {row['val_loss']:.3f} val_bpb {row['val_bpb']:.3f}"

    def final_note(self, result: dict[str, Any]) -> str:
        return f"val_loss {result['val_loss']:.4f} | val_ppl {result['val_ppl']:.2f} | val_bpb {result['val_bpb']:.4f}"


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train a model as ``cfg`` says; returns the final metrics (``val_loss``, ``val_ppl``, ``val_bpb``...)."""
    return Pretraining(cfg).run()
