"""The options every training recipe has (:class:`TrainerConfig`), read by :class:`minigpt.train.trainer.Trainer`.

A recipe subclasses it with its own fields, as :class:`minigpt.train.loop.TrainConfig` adds the data, the model
preset and the context length of pretraining; ``from_dict`` then accepts the union.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from minigpt.model.config import dataclass_from_dict
from minigpt.runtime import DTYPES


@dataclass
class TrainerConfig:
    """The options every recipe has: run directory, optimizer, schedule, budget, intervals, device and precision,
    data parallelism. Recipes subclass it with their own fields."""

    out_dir: str = "runs/train"
    batch_size: int = 16  # sequences (or examples) per micro-batch per rank
    grad_accum: int = 1
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    # adamw | muon: Muon for the hidden matrices and AdamW (lr, betas, weight_decay above) for the rest
    # (minigpt.train.optim). Muon's peak learning rate follows the same warmup/cosine schedule as lr.
    optimizer: str = "adamw"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95  # Nesterov momentum of Muon
    muon_weight_decay: float = 0.0  # decoupled, applied as p *= 1 - lr * muon_weight_decay
    max_steps: Optional[int] = None
    max_time: Optional[float] = None  # seconds of training (evaluation and checkpointing excluded)
    eval_interval: int = 200
    log_interval: int = 10
    ckpt_interval: int = 500
    keep_checkpoints: int = 2  # the newest N stay after each save; 0 keeps all
    device: str = "auto"
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto (bf16 where the device runs it natively)
    seed: int = 1337
    threads: Optional[int] = None
    compile: bool = False  # torch.compile the model; the compile time is part of the first step's time
    resume: bool = False
    max_bad_steps: int = 5  # abort after this many consecutive non-finite steps (each one is skipped)
    parallel: str = "none"  # none | ddp | fsdp (under torchrun; ddp is used if a multi-rank run says none)
    activation_checkpointing: bool = False

    # False: the recipe sets max_steps itself before training when neither budget is given (SFT / DPO: --epochs).
    budget_required: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.max_steps is None and self.max_time is None and self.budget_required:
            raise ValueError("set --max-steps and/or --max-time: the schedule needs a budget")
        self._check_optimizer()
        if self.parallel not in ("none", "ddp", "fsdp"):
            raise ValueError(f"parallel must be none, ddp or fsdp, got {self.parallel!r}")
        if self.dtype not in DTYPES and self.dtype != "auto":
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("batch_size", "grad_accum", "eval_interval", "log_interval", "ckpt_interval", "max_bad_steps"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"lr must be positive and min_lr_ratio in [0, 1], got lr={self.lr!r}, "
                             f"min_lr_ratio={self.min_lr_ratio!r}")
        if self.keep_checkpoints < 0:
            raise ValueError(f"keep_checkpoints must be 0 (keep all) or more, got {self.keep_checkpoints}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(f"max_steps must be positive, got {self.max_steps}")
        if self.max_time is not None and self.max_time <= 0:
            raise ValueError(f"max_time must be positive, got {self.max_time}")

    def _check_optimizer(self) -> None:
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer must be adamw or muon, got {self.optimizer!r}")
        if not self.muon_lr > 0 or not 0 <= self.muon_momentum < 1 or not self.muon_weight_decay >= 0:
            raise ValueError(f"muon_lr must be positive, muon_momentum in [0, 1) and muon_weight_decay >= 0, got "
                             f"{self.muon_lr!r}, {self.muon_momentum!r}, {self.muon_weight_decay!r}")
        if self.optimizer == "muon" and self.parallel == "fsdp":
            raise ValueError("optimizer muon needs whole matrices and does not work with parallel=fsdp (sharded "
                             "weights); use parallel=ddp or optimizer=adamw")

    def to_dict(self) -> dict[str, Any]:
        """The options as a dict, in the order config.yaml lists them (the fields' order unless a recipe says)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """Build from a dict; unknown keys raise ``ValueError`` listing them."""
        return dataclass_from_dict(cls, d, "training option")
