"""Model configuration: one typed dataclass, validated on construction, plus named presets.

The field names follow the Llama reference code (Touvron et al. 2023, ``llama/model.py``'s ``ModelArgs``);
Hugging Face names appear only in :mod:`minigpt.hf`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


def swiglu_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float] = None) -> int:
    """SwiGLU hidden width: ``int(2 * 4 * dim / 3)``, optionally scaled, rounded up to ``multiple_of``.

    Source: Shazeer 2020 ("GLU Variants Improve Transformer") keeps the parameter count of a ``4 * dim`` MLP by
    using 2/3 of its width for the three SwiGLU matrices; the rounding rule is Llama's ``FeedForward``.
    """
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass
class ModelConfig:
    """Shape and hyper-parameters of a decoder-only Llama-style Transformer.

    Derived fields: ``head_dim`` defaults to ``dim // n_heads``; ``hidden_dim`` defaults to
    :func:`swiglu_hidden_dim`. Raises ``ValueError`` naming the bad field and the fix.
    """

    vocab_size: int = 4096
    dim: int = 128
    n_layers: int = 8
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # None = n_heads (plain multi-head attention)
    head_dim: Optional[int] = None
    hidden_dim: Optional[int] = None
    multiple_of: int = 64
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    tie_embeddings: bool = True
    dropout: float = 0.0  # on the embedding and on each residual branch
    attention_dropout: float = 0.0  # on attention probabilities; forces SDPA's slow math path on CPU
    bias: bool = False  # biases on every linear layer except the LM head (attention and FFN)
    # Biases on the q/k/v/o projections only, as Hugging Face Llama's `attention_bias`. Qwen2 has q/k/v biases but
    # none on o: minigpt.hf loads those models with a zero o bias, which computes exactly the same function.
    attention_bias: bool = False
    # RoPE context extension, e.g. {"type": "yarn", "factor": 4.0, "original_max_seq_len": 2048}; None = plain
    # RoPE. Keys and formulas: minigpt.rope.ROPE_SCALING_KEYS.
    rope_scaling: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len", "multiple_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(
                    f"ModelConfig.dim ({self.dim}) is not divisible by n_heads ({self.n_heads}): "
                    "choose n_heads dividing dim, or set head_dim explicitly"
                )
            self.head_dim = self.dim // self.n_heads
        if not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ValueError(f"ModelConfig.head_dim must be a positive integer, got {self.head_dim!r}")
        if self.head_dim % 2:
            raise ValueError(
                f"ModelConfig.head_dim ({self.head_dim}) must be even: RoPE rotates pairs of channels"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}): "
                "each key/value head serves a whole group of query heads"
            )
        if self.hidden_dim is None:
            self.hidden_dim = swiglu_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)
        if not isinstance(self.hidden_dim, int) or self.hidden_dim <= 0:
            raise ValueError(f"ModelConfig.hidden_dim must be a positive integer, got {self.hidden_dim!r}")
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"ModelConfig.{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.norm_eps <= 0:
            raise ValueError(f"ModelConfig.norm_eps must be positive, got {self.norm_eps!r}")
        if self.rope_theta <= 0:
            raise ValueError(f"ModelConfig.rope_theta must be positive, got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            from .rope import validate_rope_scaling

            validate_rope_scaling(self.rope_scaling)

    @property
    def has_attention_bias(self) -> bool:
        """True when the attention projections carry biases (``bias`` or ``attention_bias``)."""
        return self.bias or self.attention_bias

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head (1 = MHA, ``n_heads`` = MQA)."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a dict; unknown keys raise ``ValueError`` listing them (typos must not pass silently)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; valid fields: {sorted(known)}")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))


# Presets from the seed design. vocab_size is a placeholder: it is replaced by the tokenizer's size.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(dim=128, n_layers=8, n_heads=4, n_kv_heads=1, max_seq_len=256),
    "small": dict(dim=384, n_layers=12, n_heads=12, n_kv_heads=3, max_seq_len=512),
    "medium": dict(dim=640, n_layers=20, n_heads=16, n_kv_heads=4, hidden_dim=2048, max_seq_len=1024),
    # Llama 2 7B shape (Touvron et al. 2023, table 1): for estimates and tests only.
    "llama2-7b": dict(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, hidden_dim=11008,
        max_seq_len=4096, tie_embeddings=False,
    ),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """Return the named preset's :class:`ModelConfig` with ``overrides`` applied.

    Raises ``ValueError`` for an unknown name, listing the known ones.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides})
