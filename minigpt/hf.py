"""The Hugging Face boundary: ``LlamaForCausalLM`` config and tensor names <-> ours.

Only this module speaks Hugging Face's names (``hidden_size``, ``q_proj``...). Because our RoPE uses the same
rotate-half layout as ``transformers``' Llama, the mapping is a pure rename: no tensor is permuted.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig
from .errors import MiniGPTError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)

# ours (per layer, after "layers.{i}.") -> Hugging Face (after "model.layers.{i}.")
_LAYER_KEYS = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_GLOBAL_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER = {v: k for k, v in _LAYER_KEYS.items()}
_HF_GLOBAL = {v: k for k, v in _GLOBAL_KEYS.items()}
_LAYER_RE = re.compile(r"^(model\.)?layers\.(\d+)\.(.+)$")


def to_hf_key(key: str) -> str:
    """Our state-dict key -> Hugging Face ``LlamaForCausalLM`` key."""
    if key in _GLOBAL_KEYS:
        return _GLOBAL_KEYS[key]
    m = re.match(r"^layers\.(\d+)\.(.+)$", key)
    if m and m.group(2) in _LAYER_KEYS:
        return f"model.layers.{m.group(1)}.{_LAYER_KEYS[m.group(2)]}"
    raise KeyError(f"no Hugging Face name for tensor {key!r}")


def from_hf_key(key: str) -> str:
    """Hugging Face ``LlamaForCausalLM`` key -> ours. Raises ``KeyError`` for unknown names."""
    if key in _HF_GLOBAL:
        return _HF_GLOBAL[key]
    m = _LAYER_RE.match(key)
    if m and m.group(3) in _HF_LAYER:
        return f"layers.{m.group(2)}.{_HF_LAYER[m.group(3)]}"
    raise KeyError(f"unknown Hugging Face tensor {key!r}")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """``config.json`` of a ``LlamaForCausalLM`` -> :class:`ModelConfig`.

    Raises :class:`MiniGPTError` for an unsupported architecture or a feature we do not implement.
    """
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    if archs[0] not in SUPPORTED_ARCHITECTURES and hf.get("model_type") != "llama":
        raise MiniGPTError(f"unsupported architecture {archs[0]!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    rope = hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", "default")
    scaling = hf.get("rope_scaling")
    if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")):
        raise MiniGPTError(f"RoPE scaling {scaling or rope!r} is not supported yet; only default RoPE")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise MiniGPTError("attention_bias / mlp_bias Llama variants are not supported yet")
    if hf.get("hidden_act", "silu") != "silu":
        raise MiniGPTError(f"hidden_act {hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU)")
    n_heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        hidden_dim=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def config_to_hf(config: ModelConfig, **extra: Any) -> dict[str, Any]:
    """:class:`ModelConfig` -> a ``LlamaForCausalLM`` ``config.json`` dict (``extra`` keys are merged in)."""
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.bias,
        "mlp_bias": config.bias,
        "hidden_act": "silu",
    }
    d.update(extra)
    return d


def is_hf_dir(path: str | Path) -> bool:
    """True if ``path/config.json`` describes a Hugging Face model (has ``model_type`` or ``architectures``)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        d = json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return "model_type" in d or "architectures" in d


def state_dict_from_hf(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face state dict to ours; drop ``lm_head`` when embeddings are tied.

    Raises :class:`MiniGPTError` naming unknown tensors.
    """
    out, unknown = {}, []
    for k, v in tensors.items():
        if k.endswith("rotary_emb.inv_freq"):
            continue  # derived buffer some older exports carry
        try:
            out[from_hf_key(k)] = v
        except KeyError:
            unknown.append(k)
    if unknown:
        raise MiniGPTError(f"unexpected tensors in the Hugging Face checkpoint: {unknown[:5]}")
    if config.tie_embeddings:
        out.pop("output.weight", None)
    return out
