"""Model configuration: one typed dataclass, validated on construction, plus named presets.

The field names follow the Llama reference code (Touvron et al. 2023, ``llama/model.py``'s ``ModelArgs``);
Hugging Face names appear only in :mod:`minigpt.interop.hf`.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from minigpt.model.rope import validate_rope_scaling
from minigpt.paths import write_text_atomic


def swiglu_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float] = None) -> int:
    """SwiGLU hidden width: ``int(2 * 4 * dim / 3)``, optionally scaled, rounded up to ``multiple_of``.

    Source: Shazeer 2020 ("GLU Variants Improve Transformer") keeps the parameter count of a ``4 * dim`` MLP by
    using 2/3 of its width for the three SwiGLU matrices; the rounding rule is Llama's ``FeedForward``.
    """
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


# Choices of the architecture-variant fields; the first of each is the Llama default.
POS_ENCODINGS = ("rope", "alibi", "learned", "sinusoidal", "none")
NORMS = ("rmsnorm", "layernorm")
NORM_POSITIONS = ("pre", "post")
FFNS = ("swiglu", "geglu", "gelu", "relu", "relu2")
GATED_FFNS = ("swiglu", "geglu")
ATTENTION_IMPLS = ("sdpa", "naive", "flash_reference")


def ffn_hidden_dim(dim: int, ffn: str, multiple_of: int, ffn_dim_multiplier: Optional[float] = None) -> int:
    """Default FFN width for ``ffn``: gated FFNs (SwiGLU, GeGLU) use :func:`swiglu_hidden_dim`; plain MLPs
    (GELU, ReLU, ReLU²) use ``4 * dim`` (Vaswani et al. 2017; GPT-2), scaled and rounded up to ``multiple_of`` the
    same way.

    A gated FFN has three ``dim x hidden`` matrices and a plain one two, so the 2/3 rule keeps the two within a
    rounding step of the same parameter count (Shazeer 2020, section 2).
    """
    if ffn in GATED_FFNS:
        return swiglu_hidden_dim(dim, multiple_of, ffn_dim_multiplier)
    hidden = 4 * dim
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass
class ModelConfig:
    """Shape and hyper-parameters of a decoder-only Llama-style Transformer.

    Derived fields: ``head_dim`` defaults to ``dim // n_heads``; ``hidden_dim`` defaults to
    :func:`ffn_hidden_dim` (the SwiGLU rule for the default FFN); ``moe_hidden_dim`` to ``hidden_dim``.

    Architecture variants (the defaults are Llama's, and a default config builds exactly the model it always did):
    ``pos_encoding``, ``norm``, ``norm_position``, ``ffn``, ``attention_impl`` (all three implementations compute
    the same function), ``sliding_window`` (Mistral's local attention, :mod:`minigpt.model.attention`), and a
    mixture of experts when ``n_experts > 0`` (see :mod:`minigpt.model.moe`). Training-recipe options, all off by
    default: ``qk_norm`` (RMSNorm of each query and key head before RoPE), ``ffn="relu2"`` (squared ReLU) and
    ``logit_softcap`` (``cap * tanh(logits / cap)`` on the LM head's output); an untied head is
    ``tie_embeddings=False``.
    Raises ``ValueError`` naming the bad field and the fix.
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
    # none on o: minigpt.interop.hf loads those models with a zero o bias, which computes exactly the same function.
    attention_bias: bool = False
    # Biases on the FFN projections only, as Hugging Face Llama's `mlp_bias` (`bias` sets both kinds at once).
    mlp_bias: bool = False
    # Sliding-window attention (Mistral; Beltagy et al. 2020, "Longformer"): a query at position i sees the keys at
    # positions j with i - sliding_window < j <= i, itself included. None = the whole causal prefix.
    sliding_window: Optional[int] = None
    # RoPE context extension, e.g. {"type": "yarn", "factor": 4.0, "original_max_seq_len": 2048}; None = plain
    # RoPE. Keys and formulas: minigpt.model.rope.ROPE_SCALING_KEYS.
    rope_scaling: Optional[dict[str, Any]] = None
    # --- architecture variants (minigpt.model.positions, minigpt.model.norm, minigpt.model.ffn, minigpt.model.attention, minigpt.model.moe)
    pos_encoding: str = "rope"  # rope | alibi | learned | sinusoidal | none
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_position: str = "pre"  # pre (x + f(norm(x))) | post (norm(x + f(x)), the 2017 Transformer)
    ffn: str = "swiglu"  # swiglu | geglu | gelu | relu | relu2
    attention_impl: str = "sdpa"  # sdpa | naive | flash_reference
    attention_block_size: int = 64  # query/key tile size of flash_reference
    # --- recipe options (modded-nanoGPT's speedrun recipe; off by default, so older checkpoints load unchanged)
    # RMSNorm (with a learned [head_dim] gain shared by the heads) of every query and key head before RoPE, as
    # Qwen3's and Gemma 3's q_norm / k_norm (Dehghani et al. 2023; Wortsman et al. 2023): bounds the attention
    # logits, so higher learning rates stay stable.
    qk_norm: bool = False
    # Soft-capping of the output logits, cap * tanh(logits / cap) (Gemma 2's final_logit_softcapping, 30.0;
    # modded-nanoGPT uses 15-30): logits stay in (-cap, cap). None = no capping.
    logit_softcap: Optional[float] = None
    # --- mixture of experts: n_experts = 0 is a dense model
    n_experts: int = 0
    n_experts_per_token: int = 2  # top-k
    n_shared_experts: int = 0  # always-on experts (DeepSeekMoE), fused into one FFN of n x moe_hidden_dim
    moe_every: int = 1  # the FFN of every moe_every-th layer (layers moe_every-1, 2*moe_every-1, ...) is an MoE
    moe_hidden_dim: Optional[int] = None  # width of each expert; default hidden_dim
    router_aux_loss_coef: float = 0.01  # load-balancing loss weight (Switch Transformer uses 0.01)
    router_z_loss_coef: float = 0.001  # router z-loss weight (ST-MoE uses 0.001)

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
        self._check_variants()
        if self.head_dim % 2 and self.pos_encoding == "rope":
            raise ValueError(
                f"ModelConfig.head_dim ({self.head_dim}) must be even: RoPE rotates pairs of channels"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}): "
                "each key/value head serves a whole group of query heads"
            )
        if self.hidden_dim is None:
            self.hidden_dim = ffn_hidden_dim(self.dim, self.ffn, self.multiple_of, self.ffn_dim_multiplier)
        if not isinstance(self.hidden_dim, int) or self.hidden_dim <= 0:
            raise ValueError(f"ModelConfig.hidden_dim must be a positive integer, got {self.hidden_dim!r}")
        self._check_moe()
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or isinstance(self.sliding_window, bool) or self.sliding_window <= 0):
            raise ValueError(f"ModelConfig.sliding_window must be a positive integer (keys per query, itself "
                             f"included) or None for full causal attention, got {self.sliding_window!r}")
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"ModelConfig.{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.norm_eps <= 0:
            raise ValueError(f"ModelConfig.norm_eps must be positive, got {self.norm_eps!r}")
        if self.rope_theta <= 0:
            raise ValueError(f"ModelConfig.rope_theta must be positive, got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            if self.pos_encoding != "rope":
                raise ValueError(f"ModelConfig.rope_scaling rescales RoPE but pos_encoding is "
                                 f"{self.pos_encoding!r}: remove rope_scaling or use pos_encoding='rope'")
            validate_rope_scaling(self.rope_scaling)
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"ModelConfig.qk_norm must be true or false, got {self.qk_norm!r}")
        if self.logit_softcap is not None and (isinstance(self.logit_softcap, bool)
                                               or not isinstance(self.logit_softcap, (int, float))
                                               or not 0 < self.logit_softcap < float("inf")):
            raise ValueError(f"ModelConfig.logit_softcap must be a positive number (the cap, e.g. 30.0) or None for "
                             f"no soft-capping, got {self.logit_softcap!r}")
        if self.attention_impl == "flash_reference" and self.attention_dropout > 0:
            raise ValueError("ModelConfig.attention_dropout > 0 is not supported by attention_impl='flash_reference' "
                             "(its backward pass recomputes the probabilities); use 'sdpa' or 'naive', or set "
                             "attention_dropout=0")

    def _check_variants(self) -> None:
        for name, choices in (("pos_encoding", POS_ENCODINGS), ("norm", NORMS), ("norm_position", NORM_POSITIONS),
                              ("ffn", FFNS), ("attention_impl", ATTENTION_IMPLS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"ModelConfig.{name} must be one of {list(choices)}, got {getattr(self, name)!r}")
        if not isinstance(self.attention_block_size, int) or self.attention_block_size <= 0:
            raise ValueError(f"ModelConfig.attention_block_size must be a positive integer, "
                             f"got {self.attention_block_size!r}")

    def _check_moe(self) -> None:
        for name in ("n_experts", "n_shared_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelConfig.{name} must be an integer >= 0, got {value!r}")
        for name in ("n_experts_per_token", "moe_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.n_experts and self.n_experts_per_token > self.n_experts:
            raise ValueError(f"ModelConfig.n_experts_per_token ({self.n_experts_per_token}) exceeds n_experts "
                             f"({self.n_experts}): each token picks top-k of the experts")
        if self.n_experts and self.moe_every > self.n_layers:
            raise ValueError(f"ModelConfig.moe_every ({self.moe_every}) exceeds n_layers ({self.n_layers}): no layer "
                             "would get experts; lower moe_every")
        if self.moe_hidden_dim is None:
            self.moe_hidden_dim = self.hidden_dim
        if not isinstance(self.moe_hidden_dim, int) or self.moe_hidden_dim <= 0:
            raise ValueError(f"ModelConfig.moe_hidden_dim must be a positive integer, got {self.moe_hidden_dim!r}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"ModelConfig.{name} must be >= 0, got {getattr(self, name)!r}")

    def is_moe_layer(self, layer_id: int) -> bool:
        """True when layer ``layer_id`` (0-based) has a mixture-of-experts FFN: every ``moe_every``-th layer."""
        return self.n_experts > 0 and (layer_id + 1) % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers // self.moe_every if self.n_experts > 0 else 0  # layers moe_every-1, 2*moe_every-1, ...

    @property
    def has_attention_bias(self) -> bool:
        """True when the attention projections carry biases (``bias`` or ``attention_bias``)."""
        return self.bias or self.attention_bias

    @property
    def has_mlp_bias(self) -> bool:
        """True when the FFN projections (dense FFNs and experts) carry biases (``bias`` or ``mlp_bias``)."""
        return self.bias or self.mlp_bias

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head (1 = MHA, ``n_heads`` = MQA)."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a dict; unknown keys raise ``ValueError`` listing them (typos must not pass silently)."""
        return dataclass_from_dict(cls, d, "ModelConfig field")

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

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
    # SmolLM-135M's shape (HuggingFaceTB/SmolLM-135M config.json): random weights for benchmarks against llama.cpp
    # at the size issue 22 measured, where the real weights are not available offline.
    "smollm-135m": dict(
        vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536, max_seq_len=2048,
        rope_theta=10000.0, norm_eps=1e-5,
    ),
    # TinyLlama-1.1B's shape (TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T config.json; Zhang et al. 2024):
    # random weights for benchmarks at a size whose weights outgrow a CPU's caches at every precision.
    "tinyllama-1.1b": dict(
        vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, hidden_dim=5632, max_seq_len=2048,
        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False,
    ),
}


def dataclass_from_dict(cls, d: dict[str, Any], what: str):
    """``cls(**d)`` for a dataclass ``cls``, but keys that are not fields raise ``ValueError`` naming them and the
    valid ones (``what`` names a key in the message, e.g. ``"training option"``)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown {what}(s) {unknown}; valid: {sorted(known)}")
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):  # an annotation that does not resolve: no checks beyond the class's own
        hints = {}
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    return cls(**{k: _typed(k, v, hints.get(k), defaults[k] is None, what) for k, v in d.items()})


def _typed(name: str, value: Any, hint: Any, none_ok: bool, what: str) -> Any:
    """``value`` checked against a field's plain annotation (bool, int, float, str, or Optional of one): a number
    written as a string (YAML reads ``1e-3`` as one) becomes the number; anything else of the wrong type raises
    ``ValueError`` naming the field. Other annotations pass ``value`` through."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        none_ok = none_ok or len(args) < len(typing.get_args(hint))
        hint = args[0] if len(args) == 1 else None
    if value is None and none_ok:
        return value
    kinds = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if hint not in kinds:
        return value
    if hint in (int, float) and isinstance(value, str):
        try:
            return hint(value)
        except ValueError:
            pass
    if hint in (bool, str):
        ok = isinstance(value, hint)
    else:  # a bool is an int to Python, not to a config; an int is a fine float
        ok = isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"{what} {name!r} must be {kinds[hint]}, got {value!r}")
    return value


def preset(name: str, **overrides: Any) -> ModelConfig:
    """Return the named preset's :class:`ModelConfig` with ``overrides`` applied.

    Raises ``ValueError`` for an unknown name, listing the known ones.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides})
