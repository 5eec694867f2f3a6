"""Rotary position embeddings (Su et al. 2021, "RoFormer"), in the rotate-half layout of Hugging Face Llama, plus
the context-extension rescalings of the rotary frequencies that Llama-family checkpoints use.

Meta's reference code rotates interleaved pairs ``(x[2i], x[2i+1])``; Hugging Face rotates ``(x[i], x[i + d/2])``.
The two differ only by a permutation of the q/k projection rows (:func:`interleaved_to_half`). We use the Hugging
Face layout so that weights move between MiniGPT and ``LlamaForCausalLM`` by renaming keys alone; llama.cpp (GGUF)
and llama2.c files store the interleaved layout and are permuted on import/export.

RoPE scaling (``ModelConfig.rope_scaling``) changes the inverse frequencies ``inv_freq`` and, for YaRN, multiplies
``cos``/``sin`` by an attention factor. The formulas follow the papers and are written to agree operation by
operation with ``transformers`` 5.23 (``modeling_rope_utils.ROPE_INIT_FUNCTIONS``), which is what checkpoints with a
``rope_scaling`` entry are trained and evaluated with:

* ``linear`` -- position interpolation (Chen et al. 2023): ``inv_freq / factor``.
* ``dynamic`` -- dynamic NTK-aware scaling (bloc97 / emozilla, 2023): for a sequence of ``L > original`` positions
  the base becomes ``theta * (factor * L / original - (factor - 1)) ** (d / (d - 2))``. It depends on the current
  length, so tables beyond ``original`` are computed per call (:meth:`RopeScaling.dynamic_inv_freq`).
* ``llama3`` -- Llama 3.1's frequency-dependent interpolation (Meta, ``llama-models`` ``apply_scaling``).
* ``yarn`` -- "NTK-by-parts" interpolation with a ``0.1 ln(factor) + 1`` attention temperature (Peng et al. 2023,
  "YaRN").
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

# type -> (required keys, optional keys) of a ``rope_scaling`` dict (besides "type").
ROPE_SCALING_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor"}), frozenset({"original_max_seq_len"})),
    "llama3": (frozenset({"factor", "low_freq_factor", "high_freq_factor"}), frozenset({"original_max_seq_len"})),
    "yarn": (
        frozenset({"factor"}),
        frozenset({"original_max_seq_len", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
                   "truncate"}),
    ),
}


def validate_rope_scaling(scaling: Any) -> None:
    """Check a ``rope_scaling`` dict; raises ``ValueError`` naming the bad key and the valid choices.

    ``original_max_seq_len`` (the context the model was pre-trained with) defaults to ``max_seq_len``.
    """
    if not isinstance(scaling, dict):
        raise ValueError(f"ModelConfig.rope_scaling must be a dict like {{'type': 'linear', 'factor': 2.0}}, "
                         f"got {scaling!r}")
    kind = scaling.get("type")
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(f"ModelConfig.rope_scaling type {kind!r} is not supported; choose one of "
                         f"{sorted(ROPE_SCALING_KEYS)}")
    required, optional = ROPE_SCALING_KEYS[kind]
    keys = set(scaling) - {"type"}
    if required - keys:
        raise ValueError(f"ModelConfig.rope_scaling of type {kind!r} needs {sorted(required - keys)}")
    if keys - required - optional:
        raise ValueError(f"ModelConfig.rope_scaling of type {kind!r} has unknown keys "
                         f"{sorted(keys - required - optional)}; valid: {sorted(required | optional)}")
    for key in keys - {"truncate", "attention_factor", "mscale", "mscale_all_dim"}:
        value = scaling[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"ModelConfig.rope_scaling[{key!r}] must be a positive number, got {value!r}")
    if scaling["factor"] < 1:
        raise ValueError(f"ModelConfig.rope_scaling['factor'] must be >= 1 (it stretches the context), "
                         f"got {scaling['factor']!r}")
    if "original_max_seq_len" in keys and not isinstance(scaling["original_max_seq_len"], int):
        raise ValueError(f"ModelConfig.rope_scaling['original_max_seq_len'] must be an int, "
                         f"got {scaling['original_max_seq_len']!r}")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("ModelConfig.rope_scaling: llama3 needs high_freq_factor > low_freq_factor")
    if kind == "yarn" and not isinstance(scaling.get("truncate", True), bool):
        raise ValueError(f"ModelConfig.rope_scaling['truncate'] must be true or false, got {scaling['truncate']!r}")


def rope_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Inverse frequencies ``theta^(-2i / head_dim)`` for ``i in [0, head_dim/2)``; shape ``[head_dim // 2]``."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


class RopeScaling:
    """The frequencies of one RoPE configuration: ``theta``, ``head_dim`` and an optional ``rope_scaling`` dict.

    ``inv_freq`` ``[head_dim // 2]`` float32 and ``attention_factor`` (a float multiplying cos and sin) are fixed
    for every type except ``dynamic`` beyond ``original_max_seq_len``.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict[str, Any]], max_seq_len: int) -> None:
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.kind = scaling["type"] if scaling else None
        self.original = int(scaling.get("original_max_seq_len", max_seq_len)) if scaling else max_seq_len
        self.inv_freq, self.attention_factor = self._static()

    @property
    def is_dynamic(self) -> bool:
        return self.kind == "dynamic"

    def _static(self) -> tuple[torch.Tensor, float]:
        s, d = self.scaling, self.head_dim
        if self.kind is None:
            return rope_inv_freq(d, self.theta), 1.0
        if self.kind == "linear":
            return rope_inv_freq(d, self.theta) / s["factor"], 1.0
        if self.kind == "dynamic":
            # Up to the original length the NTK base equals theta (the correction term is 1).
            factor = s["factor"]
            base = self.theta * ((factor * self.original / self.original) - (factor - 1)) ** (d / (d - 2))
            return rope_inv_freq(d, base), 1.0
        if self.kind == "llama3":
            return self._llama3(), 1.0
        return self._yarn()

    def dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        """Dynamic-NTK ``inv_freq`` for a sequence of ``seq_len`` positions (``> original_max_seq_len``).

        Computed in float32 tensors, like ``transformers`` does at run time, so the angles agree to the last bit.
        """
        d, factor = self.head_dim, self.scaling["factor"]
        length = torch.tensor(max(seq_len, self.original), dtype=torch.int64)
        base = self.theta * ((factor * length / self.original) - (factor - 1)) ** (d / (d - 2))
        return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))

    def _llama3(self) -> torch.Tensor:
        # Wavelengths shorter than original/high_freq_factor keep their frequency, those longer than
        # original/low_freq_factor are interpolated by `factor`, and the band between is blended linearly in
        # original/wavelength.
        s = self.scaling
        factor, low, high, original = s["factor"], s["low_freq_factor"], s["high_freq_factor"], self.original
        inv_freq = rope_inv_freq(self.head_dim, self.theta)
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(in_band, blended, scaled)

    def _yarn(self) -> tuple[torch.Tensor, float]:
        s, d, base = self.scaling, self.head_dim, self.theta
        factor = s["factor"]

        def mscale(scale: float, m: float = 1.0) -> float:  # YaRN eq. 22: sqrt(1/t) = 0.1 ln(s) + 1
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = s.get("attention_factor")
        if attention_factor is None:
            if s.get("mscale") and s.get("mscale_all_dim"):  # DeepSeek's variant of the temperature
                attention_factor = float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
            else:
                attention_factor = mscale(factor)
        beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

        def dim_of_rotations(rotations: float) -> float:
            # The channel index whose wavelength fits `rotations` times into the original context (YaRN eq. 17).
            return d * math.log(self.original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_of_rotations(beta_fast), dim_of_rotations(beta_slow)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # the ramp below would divide by zero
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # 1: extrapolate (high frequencies unchanged), 0: interpolate by `factor`
        pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
        return inv_freq, float(attention_factor)

    def tables(
        self, positions: torch.Tensor, inv_freq: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of shape ``[*positions.shape, head_dim]`` float32 for integer ``positions``."""
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        freqs = positions.float()[..., None] * inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float = 10000.0, scaling: Optional[dict[str, Any]] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Precomputed ``(cos, sin)`` tables, each ``[max_seq_len, head_dim]`` float32.

    Row ``p`` holds the angles ``p * inv_freq`` repeated twice (``cat(freqs, freqs)``): the rotate-half layout.
    For ``dynamic`` scaling these are the rows used while a sequence stays within ``original_max_seq_len``.
    """
    if scaling is None:
        inv_freq = rope_inv_freq(head_dim, theta)
        positions = torch.arange(max_seq_len, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()
    return RopeScaling(head_dim, theta, scaling, max_seq_len).tables(torch.arange(max_seq_len))


def signed_sine(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` ``[..., head_dim]`` with the sign of ``rotate_half`` folded in: the first half negated,
    ``[-sin[:d/2], sin[d/2:]]`` (the table :func:`rope_rotate` takes). Exact: a negation does not round."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., head_dim]`` by the angles of its positions: ``x * cos + roll(x, head_dim / 2) *
    sin_signed``, ``cos`` and ``sin_signed`` (:func:`signed_sine`) broadcastable to ``x`` and in its dtype (the
    caller casts the tables once, not once per tensor it rotates).

    The one RoPE formula of the package: the model's attention (``[batch, heads, seq_len, head_dim]``) and both
    blocks of the inference fast path (``[batch, seq_len, heads, head_dim]``, q and k in one pass) call it.
    It is Hugging Face Llama's ``x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``
    rewritten as a roll (``[x2, x1]``) times the sine with the first half negated: the same numbers bit for bit (a
    sign flip does not round), one kernel instead of a negation and a concatenation.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rope_rotate` on the plain tables of :func:`rope_tables`: ``x`` ``[batch, heads, seq_len, head_dim]``,
    ``cos``/``sin`` the rows of its absolute positions, ``[seq_len, head_dim]`` (shared by the batch) or
    ``[batch, 1, seq_len, head_dim]`` (per-row positions), in any float dtype (cast to ``x``'s)."""
    return rope_rotate(x, cos.to(x.dtype), signed_sine(sin).to(x.dtype))


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute q/k projection rows (or biases) from the interleaved RoPE layout to rotate-half, head by head.

    ``w`` ``[n_heads * head_dim, ...]``: within each head, output channel ``2i`` (real part of pair ``i``) moves to
    ``i`` and ``2i + 1`` (imaginary part) to ``i + head_dim / 2``. The same permutation as llama2.c's ``export.py``
    and the inverse of llama.cpp's ``convert_hf_to_gguf.py``.
    """
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`interleaved_to_half` (rotate-half rows -> interleaved pairs), for GGUF export."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
