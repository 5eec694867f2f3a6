"""The Hugging Face boundary: ``config.json`` and tensor names of Llama-family models <-> ours.

Only this module (and the import/export modules built on it) speaks Hugging Face's names (``hidden_size``,
``q_proj``...). Because our RoPE uses the same rotate-half layout as ``transformers``' Llama, the mapping is a pure
rename: no tensor is permuted.

Architectures read: ``LlamaForCausalLM`` (with ``attention_bias`` and/or ``mlp_bias``); ``MistralForCausalLM`` (a
Llama without biases whose attention may slide: ``sliding_window``); ``Qwen2ForCausalLM`` (a Llama with biases on
q/k/v, loaded with ``attention_bias`` and a zero o bias; its sliding window is read when every layer slides, and a
mix of sliding and full layers is refused); ``MixtralForCausalLM`` (a Mistral whose every FFN is a top-k mixture of
SwiGLU experts, :mod:`minigpt.model.moe`). Architectures written: ``LlamaForCausalLM``, ``MistralForCausalLM`` for
dense models with a sliding window, and ``MixtralForCausalLM`` for models with experts on every layer and no
shared expert. Mixtral tensors use the names of Mixtral's original checkpoints (``block_sparse_moe.gate``,
``block_sparse_moe.experts.{e}.w1/w2/w3``), which ``transformers`` 5 converts on load and writes back on save;
the fused in-memory layout of ``transformers`` 5 (``mlp.experts.gate_up_proj`` / ``down_proj``) is read too.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Optional

import torch

from minigpt.errors import MiniGPTError, json_loads
from minigpt.model.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "mixtral": "MixtralForCausalLM"}

# ours (per layer, after "layers.{i}.") -> Hugging Face (after "model.layers.{i}.")
_LAYER_KEYS = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w1.bias": "mlp.gate_proj.bias",
    "feed_forward.w2.bias": "mlp.down_proj.bias",
    "feed_forward.w3.bias": "mlp.up_proj.bias",
}
_GLOBAL_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER = {v: k for k, v in _LAYER_KEYS.items()}
_HF_GLOBAL = {v: k for k, v in _GLOBAL_KEYS.items()}
_LAYER_RE = re.compile(r"^(model\.)?layers\.(\d+)\.(.+)$")
# Mixture-of-experts tensors inside a layer: ours <-> Mixtral's original checkpoint names.
_EXPERT_RE = re.compile(r"^feed_forward\.experts\.(\d+)\.(w[123])\.weight$")
_HF_EXPERT_RE = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_ROUTER, _HF_ROUTER = "feed_forward.router.weight", "block_sparse_moe.gate.weight"

# rope_scaling keys whose Hugging Face name differs from ours
_ROPE_KEY_TO_HF = {"original_max_seq_len": "original_max_position_embeddings"}
_ROPE_KEY_FROM_HF = {v: k for k, v in _ROPE_KEY_TO_HF.items()}


def to_hf_key(key: str) -> str:
    """Our state-dict key -> Hugging Face ``LlamaForCausalLM`` key."""
    if key in _GLOBAL_KEYS:
        return _GLOBAL_KEYS[key]
    m = re.match(r"^layers\.(\d+)\.(.+)$", key)
    if m and m.group(2) in _LAYER_KEYS:
        return f"model.layers.{m.group(1)}.{_LAYER_KEYS[m.group(2)]}"
    if m and m.group(2) == _ROUTER:
        return f"model.layers.{m.group(1)}.{_HF_ROUTER}"
    e = _EXPERT_RE.match(m.group(2)) if m else None
    if e:
        return f"model.layers.{m.group(1)}.block_sparse_moe.experts.{e.group(1)}.{e.group(2)}.weight"
    raise KeyError(f"no Hugging Face name for tensor {key!r}")


def from_hf_key(key: str) -> str:
    """Hugging Face ``LlamaForCausalLM`` key -> ours. Raises ``KeyError`` for unknown names."""
    if key in _HF_GLOBAL:
        return _HF_GLOBAL[key]
    m = _LAYER_RE.match(key)
    if m and m.group(3) in _HF_LAYER:
        return f"layers.{m.group(2)}.{_HF_LAYER[m.group(3)]}"
    if m and m.group(3) in (_HF_ROUTER, "mlp.gate.weight"):
        return f"layers.{m.group(2)}.{_ROUTER}"
    e = _HF_EXPERT_RE.match(m.group(3)) if m else None
    if e:
        return f"layers.{m.group(2)}.feed_forward.experts.{e.group(1)}.{e.group(2)}.weight"
    raise KeyError(f"unknown Hugging Face tensor {key!r}")


def _split_fused_experts(key: str, value: torch.Tensor) -> Optional[dict[str, torch.Tensor]]:
    """``transformers`` 5's fused expert tensors -> our per-expert ones, or None for any other tensor.

    ``mlp.experts.gate_up_proj`` ``[n_experts, 2 * hidden, dim]`` holds each expert's gate (``w1``) rows then its up
    (``w3``) rows; ``mlp.experts.down_proj`` ``[n_experts, dim, hidden]`` holds ``w2``.
    """
    m = _LAYER_RE.match(key)
    if not m or m.group(3) not in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        return None
    prefix = f"layers.{m.group(2)}.feed_forward.experts"
    out = {}
    for e in range(value.shape[0]):
        if m.group(3) == "mlp.experts.down_proj":
            out[f"{prefix}.{e}.w2.weight"] = value[e]
        else:
            gate, up = value[e].chunk(2, dim=0)
            out[f"{prefix}.{e}.w1.weight"], out[f"{prefix}.{e}.w3.weight"] = gate, up
    return out


def architecture(hf: dict[str, Any]) -> str:
    """The supported architecture a ``config.json`` dict describes; raises :class:`MiniGPTError` otherwise."""
    archs = hf.get("architectures") or [_MODEL_TYPES.get(hf.get("model_type"), hf.get("model_type", "?"))]
    if not isinstance(archs, list):
        raise MiniGPTError(f"config.json: architectures must be a list of names, e.g. [\"LlamaForCausalLM\"], "
                           f"got {archs!r}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise MiniGPTError(f"unsupported architecture {archs[0]!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return archs[0]


def _sliding_window(hf: dict[str, Any], arch: str) -> Optional[int]:
    """The attention window of a ``config.json`` as transformers applies it, or None for full causal attention.

    Mistral and Mixtral slide in every layer when ``sliding_window`` is set; Llama never does. Qwen2 slides only
    with ``use_sliding_window``, and then only in the layers ``layer_types`` marks (by default those from
    ``max_window_layers`` on); one window for some layers and full attention in others is refused.
    """
    window = hf.get("sliding_window")
    if arch == "LlamaForCausalLM" or window is None:
        return None
    if arch == "Qwen2ForCausalLM":
        if not hf.get("use_sliding_window"):
            return None  # transformers' Qwen2Config drops the window then
        types = hf.get("layer_types")
        if types:
            n_sliding, n_layers = sum(t == "sliding_attention" for t in types), len(types)
        else:  # counted, not listed: the file's layer count may be anything
            n_layers = hf["num_hidden_layers"]
            n_sliding = max(0, n_layers - hf.get("max_window_layers", 28))
        if n_sliding == 0:
            return None
        if n_sliding < n_layers:
            raise MiniGPTError(f"{arch} with sliding-window attention in {n_sliding} of {n_layers} layers is not "
                               "supported: MiniGPT slides in every layer or none (set max_window_layers to 0 or "
                               "use_sliding_window to false)")
    return window


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """``(rope_theta, rope_scaling)`` from ``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x)."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise MiniGPTError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    if kind == "default":
        return theta, None
    keys = {"linear": ("factor",), "dynamic": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                     "mscale", "mscale_all_dim", "truncate")}
    if kind not in keys:
        raise MiniGPTError(f"RoPE scaling type {kind!r} is not supported; supported: default, {', '.join(keys)}")
    scaling: dict[str, Any] = {"type": kind}
    for key in keys[kind]:
        if params.get(key) is not None:
            scaling[_ROPE_KEY_FROM_HF.get(key, key)] = params[key]
    if kind in ("llama3", "yarn"):
        # transformers' default when the key is absent
        scaling.setdefault("original_max_seq_len", hf.get("max_position_embeddings", 2048))
    if kind == "dynamic":
        # transformers' dynamic NTK takes max_position_embeddings as the original context.
        scaling["original_max_seq_len"] = hf.get("max_position_embeddings", 2048)
    return theta, scaling


def _flag(hf: dict[str, Any], key: str) -> bool:
    """A boolean field of ``config.json`` (absent or null: False). Raises :class:`MiniGPTError` for anything but
    true / false: ``bool("no")`` would read a string as True."""
    value = hf.get(key)
    if value is None or isinstance(value, bool):
        return bool(value)
    raise MiniGPTError(f"config.json: {key} must be true or false, got {value!r}")


def _number(hf: dict[str, Any], key: str, default: Any = None, kind: type = int) -> Any:
    """Field ``key`` of ``config.json``, an integer (``kind`` float: any number); absent or null: ``default``, and
    with no default raises :class:`MiniGPTError` naming the field, as for a value of another type."""
    value = hf.get(key)
    if value is None and default is not None:
        return default
    if value is None:
        raise MiniGPTError(f"config.json: {key} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise MiniGPTError(f"config.json: {key} must be {'a number' if kind is float else 'an integer'}, "
                           f"got {value!r}")
    return value


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """``config.json`` of a Llama / Mistral / Qwen2 ``...ForCausalLM`` -> :class:`ModelConfig`.

    ``max_seq_len`` is ``max_position_embeddings``, except with dynamic NTK scaling, where transformers reads
    ``max_position_embeddings`` as the *original* context: there the model may run to ``factor`` times it.
    Raises :class:`MiniGPTError` for an unsupported architecture, a feature we do not implement, or a boolean field
    that is not true / false.
    """
    arch = architecture(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise MiniGPTError(f"hidden_act {hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU)")
    context = _number(hf, "max_position_embeddings", 2048)
    theta, scaling = _rope_from_hf(hf)
    max_seq_len = context
    if scaling is not None and scaling["type"] == "dynamic":
        max_seq_len = int(context * scaling["factor"])
    # Only Llama's config has bias switches; Qwen2 always has q/k/v biases, Mistral and Mixtral never any.
    attention_bias, mlp_bias = _flag(hf, "attention_bias"), _flag(hf, "mlp_bias")
    if arch != "LlamaForCausalLM":
        attention_bias, mlp_bias = arch == "Qwen2ForCausalLM", False
    n_heads = _number(hf, "num_attention_heads")
    moe: dict[str, Any] = {}
    if arch == "MixtralForCausalLM":
        k = hf.get("num_experts_per_tok", 2)
        # transformers' load-balancing loss is k times ours (it counts assignments per token, we per assignment).
        moe = dict(n_experts=hf.get("num_local_experts", 8), n_experts_per_token=k,
                   moe_hidden_dim=hf["intermediate_size"],
                   router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)) * k, router_z_loss_coef=0.0)
    return ModelConfig(
        vocab_size=_number(hf, "vocab_size"),
        dim=_number(hf, "hidden_size"),
        n_layers=_number(hf, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=_number(hf, "num_key_value_heads", n_heads),
        head_dim=_number(hf, "head_dim", _number(hf, "hidden_size") // max(n_heads, 1)),
        hidden_dim=_number(hf, "intermediate_size"),
        norm_eps=_number(hf, "rms_norm_eps", 1e-6, float),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=max_seq_len,
        tie_embeddings=_flag(hf, "tie_word_embeddings"),
        bias=attention_bias and mlp_bias,
        attention_bias=attention_bias and not mlp_bias,
        mlp_bias=mlp_bias and not attention_bias,
        sliding_window=_sliding_window(hf, arch),
        **moe,
    )


# ModelConfig fields a Llama checkpoint represents, or that do not change what a trained model computes (dropout,
# which of the equivalent attention implementations runs, the router losses' weights).
_REPRESENTED = {"vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "multiple_of",
                "ffn_dim_multiplier", "norm_eps", "rope_theta", "rope_scaling", "max_seq_len", "tie_embeddings",
                "dropout", "attention_dropout", "bias", "attention_bias", "mlp_bias", "attention_impl",
                "attention_block_size", "router_aux_loss_coef", "router_z_loss_coef"}
# The architectures whose attention can slide (the same window in every layer).
_SLIDING_TARGETS = ("MistralForCausalLM", "MixtralForCausalLM")
# Mixture-of-experts fields: unused by a dense model (n_experts = 0); written by a Mixtral export.
_MOE_FIELDS = {"n_experts", "n_experts_per_token", "n_shared_experts", "moe_every", "moe_hidden_dim"}


def check_representable(config: ModelConfig, target: str = "LlamaForCausalLM") -> None:
    """Raise :class:`MiniGPTError` naming the first config field set to a feature a ``target`` checkpoint cannot
    hold.

    Any field not in the lists above must keep its default, so a feature added to :class:`ModelConfig` later is
    refused by the exporters until they learn to write it. Experts are accepted only by ``MixtralForCausalLM``, and
    only in Mixtral's layout: an MoE on every layer (``moe_every=1``), no shared experts, no biases. A
    ``sliding_window`` is accepted only by Mistral and Mixtral, which have no biases.
    """
    if config.n_experts:
        if target != "MixtralForCausalLM":
            raise MiniGPTError(f"n_experts={config.n_experts} (a mixture of experts) cannot be represented in a "
                               f"{target} export; the Hugging Face export writes such models as MixtralForCausalLM")
        layout = {"n_shared_experts": (config.n_shared_experts, 0), "moe_every": (config.moe_every, 1),
                  "bias": (config.bias, False), "attention_bias": (config.attention_bias, False),
                  "mlp_bias": (config.mlp_bias, False)}
        for name, (value, needed) in layout.items():
            if value != needed:
                raise MiniGPTError(f"{name}={value!r} cannot be represented in a {target} export (Mixtral needs "
                                   f"{name}={needed!r})")
    if target == "MistralForCausalLM":
        for name in ("bias", "attention_bias", "mlp_bias"):
            if getattr(config, name):
                raise MiniGPTError(f"{name}=True cannot be represented in a {target} export (Mistral has no biases; "
                                   f"a sliding_window model is exported as Mistral)")
    held = _REPRESENTED | _MOE_FIELDS | ({"sliding_window"} if target in _SLIDING_TARGETS else set())
    for f in dataclasses.fields(config):
        if f.name in held:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if getattr(config, f.name) != default:
            raise MiniGPTError(f"{f.name}={getattr(config, f.name)!r} cannot be represented in a {target} export")


def rope_to_hf(config: ModelConfig) -> dict[str, Any]:
    """Our RoPE settings as transformers 5's ``rope_parameters`` dict."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        params["rope_type"] = config.rope_scaling["type"]
        for key, value in config.rope_scaling.items():
            if key != "type":
                params[_ROPE_KEY_TO_HF.get(key, key)] = value
        if params["rope_type"] == "dynamic":
            params.pop("original_max_position_embeddings", None)  # carried by max_position_embeddings instead
        elif params["rope_type"] in ("llama3", "yarn"):
            params.setdefault("original_max_position_embeddings", config.max_seq_len)
    return params


def config_to_hf(config: ModelConfig, **extra: Any) -> dict[str, Any]:
    """:class:`ModelConfig` -> a ``LlamaForCausalLM`` (with experts ``MixtralForCausalLM``, with a sliding window
    ``MistralForCausalLM``) ``config.json`` dict (``extra`` keys are merged in).

    Written with both ``rope_parameters`` (transformers >= 5) and, when scaled, the equivalent ``rope_scaling``
    (transformers 4.x, vLLM). Dynamic NTK puts the original context in ``max_position_embeddings`` (see
    :func:`config_from_hf`). Raises :class:`MiniGPTError` naming a field the architecture cannot hold.
    """
    if config.n_experts:
        return _mixtral_config(config, **extra)
    mistral = config.sliding_window is not None
    check_representable(config, "MistralForCausalLM" if mistral else "LlamaForCausalLM")
    rope = rope_to_hf(config)
    context = config.max_seq_len
    if config.rope_scaling and config.rope_scaling["type"] == "dynamic":
        context = config.rope_scaling.get("original_max_seq_len", config.max_seq_len)
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
        "rope_parameters": rope,
        "max_position_embeddings": context,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.has_attention_bias,
        "mlp_bias": config.has_mlp_bias,
        "hidden_act": "silu",
    }
    if mistral:
        for key in ("attention_bias", "mlp_bias"):  # Mistral has no biases (checked above)
            d.pop(key)
        d.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=config.sliding_window)
    if config.rope_scaling:
        d["rope_scaling"] = dict(rope)
    d.update(extra)
    return d


def _mixtral_config(config: ModelConfig, **extra: Any) -> dict[str, Any]:
    check_representable(config, "MixtralForCausalLM")
    d = config_to_hf(dataclasses.replace(config, n_experts=0, hidden_dim=config.moe_hidden_dim))
    for key in ("attention_bias", "mlp_bias"):  # Mixtral has no biases (checked above)
        d.pop(key, None)
    d.update({
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": config.n_experts,
        "num_experts_per_tok": config.n_experts_per_token,
        "router_aux_loss_coef": config.router_aux_loss_coef / config.n_experts_per_token,  # see config_from_hf
        "router_jitter_noise": 0.0,
        "sliding_window": config.sliding_window,
    })
    d.update(extra)
    return d


def is_hf_dir(path: str | Path) -> bool:
    """True if ``path/config.json`` describes a Hugging Face model (has ``model_type`` or ``architectures``)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        d = json_loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and ("model_type" in d or "architectures" in d)


def state_dict_from_hf(
    tensors: dict[str, torch.Tensor], config: ModelConfig, arch: str = "LlamaForCausalLM"
) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face state dict to ours; drop ``lm_head`` when embeddings are tied; give Qwen2's
    bias-free o projection the zero bias our ``attention_bias`` layout expects.

    Raises :class:`MiniGPTError` naming unknown tensors.
    """
    out, unknown = {}, []
    for k, v in tensors.items():
        if k.endswith("rotary_emb.inv_freq"):
            continue  # derived buffer some older exports carry
        fused = _split_fused_experts(k, v)
        if fused is not None:
            out.update(fused)
            continue
        try:
            out[from_hf_key(k)] = v
        except KeyError:
            unknown.append(k)
    if unknown:
        raise MiniGPTError(f"unexpected tensors in the Hugging Face checkpoint: {unknown[:5]}")
    if config.tie_embeddings:
        out.pop("output.weight", None)
    if arch == "Qwen2ForCausalLM":
        for i in range(config.n_layers):
            wo = out.get(f"layers.{i}.attention.wo.weight")
            if wo is not None:
                out.setdefault(f"layers.{i}.attention.wo.bias", torch.zeros(config.dim, dtype=wo.dtype))
    return out


def state_dict_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict (tied head already removed) -> ``LlamaForCausalLM`` / ``MixtralForCausalLM`` names."""
    return {to_hf_key(k): v for k, v in sd.items()}
