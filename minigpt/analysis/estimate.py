"""``minigpt estimate``: parameters, FLOPs, KV-cache and training memory of a model config, without building it.

Every number is a closed-form count from :class:`~minigpt.model.config.ModelConfig`; each says which accounting it uses:

* **Parameters** -- exact: the sum of the tensor sizes the model would allocate (a tied LM head counted once),
  equal to ``sum(p.numel() for p in model.parameters())`` (pinned by tests for every preset and variant).
  *Non-embedding* removes the token (and learned position) embeddings, as Kaplan et al. 2020 count ``N``; an
  untied LM head stays in it. *Active per token* removes the experts a token is not routed to (Fedus et al. 2022).
* **FLOPs per token** -- training: :func:`minigpt.model.accounting.flops_per_token`, ``6 * N_active + 12 * n_layers * n_heads *
  head_dim * seq_len`` (Kaplan et al. 2020; attention term from Chowdhery et al. 2022, PaLM, appendix B, which counts
  the full ``seq_len x seq_len`` score matrix, ignoring the causal half a kernel may skip). Inference: the forward
  third, ``2 * N_active + 4 * n_layers * n_heads * head_dim * context`` for a token decoded with ``context`` tokens in
  the KV cache. ``N`` counts every parameter (the embedding lookup does no multiply, so the ``6N`` rule slightly
  over-counts untied models; the convention of PaLM and nanoGPT).
* **KV cache** -- exact for :class:`~minigpt.model.kv_cache.KVCache`: ``2 (K and V) * n_layers * n_kv_heads * head_dim *
  bytes`` per token; ``int8`` counts one byte per element and leaves out quantisation scales.
* **Training memory** -- weights, gradients and the two AdamW moments, all float32 (``4 + 4 + 8`` bytes per
  parameter; under bf16 autocast a bf16 copy of each weight matrix is added, ``2`` bytes per parameter), plus an
  activation estimate: the tensors autograd keeps for the backward pass of *this* implementation, counted per token
  and layer (the method of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  section 4, applied to our layer instead of GPT-3's), within about 10 % of what
  ``torch.autograd.graph.saved_tensors_hooks`` measures (a test checks it). With activation checkpointing of every
  block, only each block's input is kept and one block's activations are rebuilt at a time. Allocator overhead,
  temporary buffers and the framework itself are not counted.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from minigpt.checkpoint.native import load_config
from minigpt.errors import MiniGPTError, json_loads
from minigpt.interop import hf
from minigpt.model.accounting import flops_per_token, idle_expert_parameters
from minigpt.model.config import GATED_FFNS, ModelConfig, preset

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
GIB = 2**30


# ------------------------------------------------------------------------------------------------ parameters

def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _ffn(config: ModelConfig, hidden: int) -> int:
    """One FFN of ``config.ffn`` type and width ``hidden``: 3 matrices gated, 2 plain (:mod:`minigpt.model.ffn`)."""
    d, b = config.dim, config.has_mlp_bias
    n = _linear(d, hidden, b) + _linear(hidden, d, b)
    return n + (_linear(d, hidden, b) if config.ffn in GATED_FFNS else 0)


def _norm(config: ModelConfig) -> int:
    return config.dim * (2 if config.norm == "layernorm" else 1)  # LayerNorm has a bias


def count_parameters(config: ModelConfig) -> dict[str, int]:
    """``{"total", "embedding", "non_embedding", "active", "attention", "ffn", "norms", "lm_head"}`` (counts).

    ``attention``/``ffn``/``norms`` are summed over layers (MoE layers count their router, every expert and the
    shared experts in ``ffn``); ``lm_head`` is 0 when tied; ``active`` = ``total`` minus the idle experts.
    """
    c = config
    ab = c.has_attention_bias
    attention = (_linear(c.dim, c.n_heads * c.head_dim, ab) + 2 * _linear(c.dim, c.n_kv_heads * c.head_dim, ab)
                 + _linear(c.n_heads * c.head_dim, c.dim, ab)) * c.n_layers
    moe = c.dim * c.n_experts + c.n_experts * _ffn(c, c.moe_hidden_dim)
    moe += _ffn(c, c.n_shared_experts * c.moe_hidden_dim) if c.n_shared_experts else 0
    ffn = c.n_moe_layers * moe + (c.n_layers - c.n_moe_layers) * _ffn(c, c.hidden_dim)
    norms = 2 * c.n_layers * _norm(c) + (_norm(c) if c.norm_position == "pre" else 0)
    norms += 2 * c.n_layers * c.head_dim if c.qk_norm else 0  # q_norm and k_norm gains
    embedding = c.vocab_size * c.dim + (c.max_seq_len * c.dim if c.pos_encoding == "learned" else 0)
    lm_head = 0 if c.tie_embeddings else c.vocab_size * c.dim
    total = embedding + attention + ffn + norms + lm_head
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding,
            "active": total - idle_expert_parameters(c), "attention": attention, "ffn": ffn, "norms": norms,
            "lm_head": lm_head}


# ------------------------------------------------------------------------------------------------ FLOPs, KV cache

def flops(config: ModelConfig, seq_len: int) -> dict[str, float]:
    """``{"training_per_token", "inference_per_token"}``: FLOPs at ``seq_len`` training context / decode context
    (see the module docstring for the accounting)."""
    n = count_parameters(config)
    attention = config.n_layers * config.n_heads * config.head_dim * seq_len
    return {"training_per_token": flops_per_token(config, n["total"], seq_len),
            "inference_per_token": 2.0 * n["active"] + 4.0 * attention}


def kv_cache_bytes_per_token(config: ModelConfig, bytes_per_element: float) -> int:
    """``2 * n_layers * n_kv_heads * head_dim * bytes_per_element``: keys and values of one position, every layer."""
    return int(2 * config.n_layers * config.n_kv_heads * config.head_dim * bytes_per_element)


def kv_cache_bytes(config: ModelConfig, batch: int, context: int, bytes_per_element: float) -> int:
    """KV-cache bytes for ``batch`` sequences of ``context`` positions."""
    return batch * context * kv_cache_bytes_per_token(config, bytes_per_element)


# ------------------------------------------------------------------------------------------------ training memory

def _ffn_activations(config: ModelConfig, hidden: int) -> int:
    # Gated: the gate and up outputs, the activated gate, their product (the down projection's input). Plain: the
    # activation's input and output.
    return (4 if config.ffn in GATED_FFNS else 2) * hidden


def layer_activations(config: ModelConfig, layer: int, seq_len: int, element_bytes: int) -> float:
    """Bytes autograd keeps per token for the backward pass of block ``layer`` (see the module docstring).

    Counted in elements of ``element_bytes`` (4 fp32, 2 under bf16 autocast), float32 tensors at 4 bytes:
    each norm's input and normalised output (``4 * dim``), the attention and FFN inputs (``2 * dim``), q, k, v
    (``h_q + 2 * h_kv``), the attention output twice (kept by the kernel and by ``wo``, ``2 * h_q``), the FFN's
    hidden activations, and per implementation: ``naive`` also keeps the repeated K/V heads and the float32
    probabilities (``n_heads * seq_len`` per token: the quadratic term), ``flash_reference`` the repeated K/V and a
    float32 output (SDPA with ALiBi also keeps its float bias mask, counted per step in :func:`activation_bytes`).
    MoE layers keep ``k`` gathered inputs, expert activations and weighted outputs per token.
    """
    c = config
    h_q, h_kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    elements = 6 * c.dim + 3 * h_q + 2 * h_kv
    fp32 = 0.0  # bytes of float32 tensors, whatever the compute dtype
    if c.attention_impl == "naive":
        elements += 2 * (h_q - h_kv)
        fp32 += 4.0 * c.n_heads * seq_len
    elif c.attention_impl == "flash_reference":
        elements += 2 * (h_q - h_kv)
        fp32 += 4.0 * h_q
    if c.is_moe_layer(layer):
        k = c.n_experts_per_token
        elements += k * (_ffn_activations(c, c.moe_hidden_dim) + 2 * c.dim)
        if c.n_shared_experts:
            elements += _ffn_activations(c, c.n_shared_experts * c.moe_hidden_dim)
        fp32 += 4.0 * 3 * c.n_experts  # router logits, probabilities and their float copies
    else:
        elements += _ffn_activations(c, c.hidden_dim)
    dropout_masks = 2 * c.dim if c.dropout > 0 else 0  # one byte per element, on both residual branches
    return elements * element_bytes + fp32 + dropout_masks


def activation_bytes(config: ModelConfig, batch: int, seq_len: int, element_bytes: int = 4,
                     checkpointing: bool = False) -> float:
    """Activation bytes kept for backward over a ``batch x seq_len`` step: the blocks, the final norm and LM head
    input, and the float32 log-probabilities of the cross-entropy (``4 * vocab_size`` per token). With
    ``checkpointing`` each block keeps only its input (``dim`` elements per token) and the largest block's
    activations exist once, while it is recomputed."""
    c = config
    # Two kinds of block, dense and MoE (every moe_every-th): one of each stands for all (layer 0 is dense unless
    # every layer is MoE), so the cost does not grow with n_layers.
    kinds = {c.moe_every - 1: c.n_moe_layers} if c.n_moe_layers else {}
    if c.n_layers > c.n_moe_layers:
        kinds[0] = c.n_layers - c.n_moe_layers
    per_kind = {layer: layer_activations(c, layer, seq_len, element_bytes) for layer in kinds}
    top = (3 if c.norm_position == "pre" else 1) * c.dim * element_bytes + 4.0 * c.vocab_size
    blocks = ((c.n_layers * c.dim * element_bytes + max(per_kind.values())) if checkpointing
              else sum(n * per_kind[layer] for layer, n in kinds.items()))
    per_step = 0.0
    if c.pos_encoding == "alibi" and c.attention_impl == "sdpa":
        # SDPA keeps the additive float mask that carries the ALiBi bias: [1, n_heads, seq_len, seq_len] per layer.
        per_step = (1 if checkpointing else c.n_layers) * 4.0 * c.n_heads * seq_len * seq_len
    return batch * seq_len * (blocks + top) + per_step


def training_memory(config: ModelConfig, batch: int, seq_len: int, dtype: str = "float32",
                    checkpointing: bool = False) -> dict[str, float]:
    """Bytes of one AdamW training step: ``{"weights", "gradients", "adam", "autocast_copies", "activations",
    "total"}``. ``dtype`` is the compute dtype (``float32``, or ``bfloat16``/``float16`` autocast over float32
    master weights). Raises ``ValueError`` for another dtype."""
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"training dtype must be float32, bfloat16 or float16, got {dtype!r}")
    n = count_parameters(config)["total"]
    element = DTYPE_BYTES[dtype]
    mem = {"weights": 4.0 * n, "gradients": 4.0 * n, "adam": 8.0 * n,
           "autocast_copies": 0.0 if dtype == "float32" else 2.0 * n,
           "activations": activation_bytes(config, batch, seq_len, element, checkpointing)}
    mem["total"] = sum(mem.values())
    return mem


# ------------------------------------------------------------------------------------------------ report

@dataclass
class EstimateRequest:
    """What to estimate for: decode ``batch x context``; training ``train_batch x train_seq_len`` in ``dtype``."""

    batch: int = 1
    context: Optional[int] = None  # default: the model's max_seq_len
    train_batch: int = 16
    train_seq_len: Optional[int] = None  # default: the model's max_seq_len
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("batch", "train_batch", "context", "train_seq_len"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")


def estimate(config: ModelConfig, request: EstimateRequest = EstimateRequest()) -> dict[str, Any]:
    """Every figure for ``config`` as one JSON-ready dict (byte counts as integers)."""
    context = request.context or config.max_seq_len
    seq_len = request.train_seq_len or config.max_seq_len
    kv = {name: kv_cache_bytes_per_token(config, b) for name, b in DTYPE_BYTES.items() if name != "float16"}
    return {
        "config": config.to_dict(),
        "parameters": count_parameters(config),
        "flops": {"train_seq_len": seq_len, "context": context,
                  "training_per_token": flops(config, seq_len)["training_per_token"],
                  "inference_per_token": flops(config, context)["inference_per_token"]},
        "kv_cache": {"per_token": kv, "batch": request.batch, "context": context,
                     "total": {k: v * request.batch * context for k, v in kv.items()}},
        "training_memory": {"batch": request.train_batch, "seq_len": seq_len, "dtype": request.dtype,
                            "no_checkpointing": _ints(training_memory(config, request.train_batch, seq_len,
                                                                      request.dtype, False)),
                            "checkpointing": _ints(training_memory(config, request.train_batch, seq_len,
                                                                   request.dtype, True))},
    }


def _ints(d: dict[str, float]) -> dict[str, int]:
    return {k: int(round(v)) for k, v in d.items()}


def human_bytes(n: float) -> str:
    """``1073741824`` -> ``"1.00 GiB"`` (binary units)."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def human_count(n: float) -> str:
    """``6738415616`` -> ``"6.74 B"``."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return str(int(n))


def format_report(est: dict[str, Any]) -> str:
    """A plain-text report of :func:`estimate`, each section naming its accounting."""
    p, f, kv, tm = est["parameters"], est["flops"], est["kv_cache"], est["training_memory"]
    c = est["config"]
    moe = f", MoE {c['n_experts']} experts top-{c['n_experts_per_token']}" if c["n_experts"] else ""
    lines = [
        f"model: dim {c['dim']}, n_layers {c['n_layers']}, n_heads {c['n_heads']}, n_kv_heads {c['n_kv_heads']}, "
        f"head_dim {c['head_dim']}, hidden_dim {c['hidden_dim']}, vocab_size {c['vocab_size']}, "
        f"max_seq_len {c['max_seq_len']}{moe}",
        "",
        "parameters (exact count of the tensors; tied LM head counted once)",
        f"  total              {p['total']:>16,}  ({human_count(p['total'])})",
        f"  non-embedding      {p['non_embedding']:>16,}  (Kaplan et al. 2020: token/position embeddings excluded)",
        f"  active per token   {p['active']:>16,}  (idle experts excluded)",
        f"  attention / ffn / norms / untied head: {p['attention']:,} / {p['ffn']:,} / {p['norms']:,} / "
        f"{p['lm_head']:,}",
        "",
        "FLOPs per token (6N + 12*L*H*hd*T: Kaplan et al. 2020, PaLM app. B; N = active parameters)",
        f"  training  (T = {f['train_seq_len']}): {f['training_per_token']:.4g}",
        f"  inference (2N + 4*L*H*hd*ctx, ctx = {f['context']}): {f['inference_per_token']:.4g}",
        "",
        "KV cache (2 * n_layers * n_kv_heads * head_dim * bytes; int8 without scales)",
    ]
    display = {"float32": "fp32", "bfloat16": "bf16/fp16", "int8": "int8"}
    for name, per_token in kv["per_token"].items():
        lines.append(f"  {display[name]:<9} {human_bytes(per_token):>12} per token | batch {kv['batch']} x context "
                     f"{kv['context']}: {human_bytes(kv['total'][name])}")
    lines += ["", f"training memory per step (batch {tm['batch']} x seq_len {tm['seq_len']}, {tm['dtype']}; "
                  "fp32 weights + grads + AdamW m, v; activations = tensors kept for backward, "
                  "Korthikanti et al. 2022 method)"]
    for label, key in (("no checkpointing", "no_checkpointing"), ("activation checkpointing", "checkpointing")):
        m = tm[key]
        lines.append(f"  {label:<25} total {human_bytes(m['total']):>11} = weights {human_bytes(m['weights'])} + "
                     f"grads {human_bytes(m['gradients'])} + adam {human_bytes(m['adam'])}"
                     + (f" + autocast copies {human_bytes(m['autocast_copies'])}" if m["autocast_copies"] else "")
                     + f" + activations {human_bytes(m['activations'])}")
    return "\n".join(lines)


def resolve_config(preset_name: Optional[str] = None, config_path: Optional[str] = None,
                   overrides: Optional[dict[str, Any]] = None) -> ModelConfig:
    """The config to estimate: a preset (default ``tiny``), or a config file -- a training YAML (``preset``,
    ``model``, ``vocab_size`` keys, as ``minigpt train --config`` reads), a MiniGPT or Hugging Face ``config.json``,
    or a model directory -- with ``overrides`` (ModelConfig fields) on top.

    Raises :class:`~minigpt.errors.MiniGPTError` for a missing or unreadable file or an invalid config.
    """

    import yaml


    overrides = dict(overrides or {})
    try:
        if config_path is None:
            return preset(preset_name or "tiny", **overrides)
        path = Path(config_path)
        if path.is_dir():

            return dataclasses.replace(load_config(path), **overrides)
        if not path.is_file():
            raise MiniGPTError(f"config file {path} does not exist")
        text = path.read_text()
        d = json_loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        if not isinstance(d, dict):
            raise MiniGPTError(f"config file {path} must hold a mapping")
        if "architectures" in d or "model_type" in d:
            return dataclasses.replace(hf.config_from_hf(d), **overrides)
        if "preset" in d or "model" in d or preset_name:
            base = {"vocab_size": d["vocab_size"]} if "vocab_size" in d else {}
            return preset(preset_name or d.get("preset", "tiny"), **{**base, **(d.get("model") or {}), **overrides})
        return ModelConfig.from_dict({**{k: v for k, v in d.items() if k != "format"}, **overrides})
    except (ValueError, TypeError, yaml.YAMLError) as e:
        raise MiniGPTError(f"invalid model config: {e}") from None
    except RecursionError:  # PyYAML reads nesting recursively
        raise MiniGPTError(f"invalid model config: {config_path} is nested too deeply to read") from None
