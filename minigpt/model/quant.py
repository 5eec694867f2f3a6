"""Weight-only quantization, applied at load time, saved and loaded as is: int8 with per-output-channel symmetric
scales, and int4 in groups of 32 with a float16 scale each (llama.cpp's ``Q4_0``; below the int8 part).

Each linear weight ``W`` ``[out, in]`` becomes ``Q = round(W / s)`` in ``[-127, 127]`` (int8) with one float32 scale
per output channel, ``s_o = max_i |W_oi| / 127`` (the "absmax" weight-only scheme of LLM.int8()'s vector-wise
quantization without the outlier path, Dettmers et al. 2022, and of gpt-fast's ``int8`` mode). A matmul then
computes ``y = (x Q^T) * s``: the scale commutes out of the sum because it is per output row, so only the weights are
approximated (rounding error at most ``s_o / 2`` per weight) and activations stay in their float dtype.

What is quantized: every projection inside the blocks (``wq wk wv wo w1 w2 w3``, experts included) and the LM head.
The token embedding stays float (one row is read per token; it costs no bandwidth). With tied embeddings the head
gets its own int8 copy of the embedding matrix, so the quantized model is untied in memory.

On disk (:mod:`minigpt.checkpoint.quantized`): a MiniGPT directory whose ``config.json`` carries
``"quantization": {"method": "int8_weight_only", "granularity": "per_output_channel"}`` next to the model fields,
and whose ``model.safetensors`` holds each quantized ``NAME.weight`` as int8 plus ``NAME.weight_scale`` (float32,
``[out]``); ``output.weight`` (int8) is present even for a tied model. :func:`minigpt.checkpoint.load_model` and
therefore every command recognise such a directory.

Speed on CPUs: a matrix-vector product is bound by the bytes it reads, so int8 reads a quarter of fp32. Stock
PyTorch has no int8 x float kernel for AVX2 CPUs (``aten._weight_int8pack_mm`` is vectorised for AVX-512 only and
runs at ~1 GFLOP/s here); the eager path therefore dequantizes on the fly (:func:`int8_linear`), which is *slower*
than fp32, and the speed comes from the compiled decode step (``--compile``), where Inductor fuses the int8 -> float
conversion into its matrix-vector loop.

int4 weight-only, group-wise (:class:`Int4Linear`): llama.cpp's ``Q4_0`` (``ggml/src/ggml-quants.c``,
``quantize_row_q4_0_ref``; ``block_q4_0`` in ``ggml-common.h``) with its block of 32 as ``group_size``. Each row
of ``W`` ``[out, in]`` is cut into groups of ``group_size`` consecutive inputs; per group the value of largest
magnitude ``m`` (signed; the first one on ties) gives the scale ``d = m / -8`` (stored float16, as ``Q4_0``'s
``ggml_half d``), and each weight becomes ``q = min(15, trunc(w / d + 8.5))`` in ``[0, 15]``, standing for
``(q - 8) * d``: sixteen levels ``-8 .. 7`` times ``d``, the extreme mapped exactly to ``-8``. The rounding error is
at most ``|d| / 2 = max|w| / 16`` per weight, except for weights of the opposite sign beyond ``7.5 |d|``, which clamp
to level 7: at most ``|d| = max|w| / 8``. Two values share a byte as in ``Q4_0``: byte ``j`` of a group
holds input ``j`` in its low nibble and input ``j + group_size / 2`` in its high nibble, so with the default group
of 32 a row's bytes and scales are exactly the ``qs`` and ``d`` of llama.cpp's blocks (:func:`quantize_weight_int4`
equals ``gguf.quants.quantize(..., Q4_0)``; tested). 4.5 bits a weight, an eighth of fp32's bytes plus the scales.

What int4 quantizes: the block projections whose input width is a multiple of ``group_size``. The LM head, and any
projection whose rows do not divide into groups (e.g. ``w2`` of a model with ``hidden_dim`` 172), get int8
per-channel instead -- llama.cpp's quantizer likewise keeps ``output.weight`` of a ``Q4_0`` model at a higher
precision (``Q6_K``, or ``Q8_0`` when its rows do not divide into 256-blocks) and falls back to another type for
a tensor whose rows are not a multiple of the block (``tensor_type_fallback`` in ``src/llama-quant.cpp``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

METHOD = "int8_weight_only"
QUANT_CONFIG = {"method": METHOD, "granularity": "per_output_channel"}
METHOD_INT4 = "int4_weight_only"
METHODS = (METHOD, METHOD_INT4)
GROUP_SIZE = 32  # llama.cpp's QK4_0
# The names a user types (`--quantize`, `minigpt quantize --dtype`) and the methods they stand for.
SCHEMES = {"int8": METHOD, "int4": METHOD_INT4}


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: ``w`` ``[out, in]`` (any float dtype) -> ``(q [out, in] int8, scale [out]
    float32)`` with ``w ~= q * scale[:, None]``. A row of zeros gets scale 1 (and stays exactly zero)."""
    w32 = w.detach().float()
    scale = w32.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale[:, None]`` in ``dtype``: the float matrix an int8 layer stands for."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
    """``(x q^T) * scale (+ bias)`` for ``x`` ``[..., in]`` float, ``q`` ``[out, in]`` int8, ``scale`` ``[out]``.

    Written as a cast then a matmul so that ``torch.compile`` fuses the cast into the product (one read of the int8
    matrix); eagerly the cast materialises a float copy of ``q`` per call."""
    y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias


class Int8Linear(nn.Module):
    """A linear layer with an int8 weight ``[out, in]`` and a float32 per-output-channel ``weight_scale`` ``[out]``
    (both buffers: nothing here trains). ``[..., in] -> [..., out]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        q, scale = quantize_weight(linear.weight)
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, device=q.device)
        m.weight, m.weight_scale = q, scale
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def check_group_size(group_size: int, in_features: Optional[int] = None) -> None:
    """Raise ``ValueError`` (one line) unless ``group_size`` is a positive multiple of 8 -- a group is packed as
    whole 32-bit words of eight nibbles, which the compiled decode step reads -- and, when given, divides
    ``in_features``."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
        raise ValueError(f"int4 group size must be a positive multiple of 8, got {group_size!r}")
    if in_features is not None and in_features % group_size:
        raise ValueError(f"int4 needs rows that divide into groups of {group_size}; this layer has {in_features} "
                         "inputs")


def quantize_weight_int4(w: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-wise int4 as llama.cpp's ``Q4_0`` (module docstring): ``w`` ``[out, in]`` (any float dtype) ->
    ``(packed [out, in / 2] uint8, scale [out, in / group_size] float16)`` with
    ``w ~= (q - 8) * scale`` group by group. A group of zeros gets scale 0 and stays exactly zero. Raises
    ``ValueError`` for a bad ``group_size``, a ``w`` that is not 2-D or whose rows do not divide into groups, or
    scales beyond float16's range (``max|w| > 8 * 65504``)."""
    if w.dim() != 2:
        raise ValueError(f"int4 quantizes 2-D weights [out, in], got shape {tuple(w.shape)}")
    out, n_in = w.shape
    check_group_size(group_size, n_in)
    blocks = w.detach().float().reshape(out, n_in // group_size, group_size)
    # The signed value of largest magnitude, first one on ties (ggml: `if (amax < fabsf(v))`; torch.argmax also
    # returns the first maximum).
    extreme = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
    d = extreme / -8.0
    if not bool(torch.isfinite(d.half()).all()):
        raise ValueError("int4: a weight is too large (or not finite) for float16 group scales")
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.trunc(blocks * inv + 8.5).clamp_(0, 15).to(torch.uint8)
    half = group_size // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    return packed.reshape(out, n_in // 2).contiguous(), d.squeeze(-1).half()


def dequantize_weight_int4(packed: torch.Tensor, scale: torch.Tensor, group_size: int = GROUP_SIZE,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - 8) * scale`` group by group in ``dtype``: the ``[out, in]`` float matrix an int4 layer stands for."""
    out = packed.shape[0]
    groups = packed.reshape(out, -1, group_size // 2)  # [out, n_groups, group_size / 2] bytes
    # Written straight into one float buffer and scaled in place: 3x faster than unpacking to int8 first, which
    # matters because the eager path dequantizes every call.
    w = torch.empty(out, groups.shape[1], 2, group_size // 2, dtype=torch.float32, device=packed.device)
    w[:, :, 0] = groups & 15  # low nibbles: the group's first half
    w[:, :, 1] = groups >> 4  # high nibbles: its second half
    w.sub_(8.0).mul_(scale.float()[:, :, None, None])
    return w.view(out, -1).to(dtype)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x W^T (+ bias)`` with ``W`` the int4 matrix ``(packed [out, in / 2], scale [out, in / group_size])``;
    ``x`` ``[..., in]`` float. Eager: the weight is dequantized to ``x``'s dtype per call (the compiled decode step,
    :mod:`minigpt.infer.fastpath`, reads the packed bytes instead)."""
    y = F.linear(x, dequantize_weight_int4(packed, scale, group_size, x.dtype))
    return y if bias is None else y + bias


class Int4Linear(nn.Module):
    """A linear layer with group-wise int4 weights (module docstring): ``weight`` ``[out, in / 2]`` uint8 (two
    values a byte, ``Q4_0``'s layout) and ``weight_scale`` ``[out, in / group_size]`` float16 (buffers: nothing here
    trains). ``[..., in] -> [..., out]``. Raises ``ValueError`` when ``in_features`` does not divide into groups."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int = GROUP_SIZE,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        check_group_size(group_size, in_features)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // group_size,
                                                         dtype=torch.float16, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = GROUP_SIZE) -> "Int4Linear":
        packed, scale = quantize_weight_int4(linear.weight, group_size)
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size, device=packed.device)
        m.weight, m.weight_scale = packed, scale
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, self.weight, self.weight_scale, self.group_size, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of "
                f"{self.group_size}")


QUANTIZED_LAYERS = (Int8Linear, Int4Linear)


def is_quantized(model: nn.Module) -> bool:
    """True when ``model`` holds :class:`Int8Linear` or :class:`Int4Linear` layers."""
    return any(isinstance(m, QUANTIZED_LAYERS) for m in model.modules())


def _replace_linears(model: nn.Module, make) -> None:
    """Replace every ``nn.Linear`` below ``model.layers`` and the LM head ``model.output`` by ``make(linear, name)``
    (``name`` its dotted path), except MoE routers: their logits pick the experts, and a rounding flip there changes
    which weights run."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            inside = full.startswith("layers.") or full == "output"
            if inside and isinstance(child, nn.Linear) and child_name != "router":
                setattr(module, child_name, make(child, full))


def quant_config(method: str = METHOD, group_size: int = GROUP_SIZE) -> dict:
    """The ``quantization`` entry of a quantized model's ``config.json``. Raises ``ValueError`` for an unknown
    method or a bad ``group_size``."""
    if method == METHOD:
        return dict(QUANT_CONFIG)
    if method != METHOD_INT4:
        raise ValueError(f"unknown quantization method {method!r}; choose one of {list(METHODS)}")
    check_group_size(group_size)
    return {"method": METHOD_INT4, "granularity": "per_group", "group_size": group_size, "layout": "q4_0",
            "int8_layers": "the LM head and projections whose input width is not a multiple of group_size"}


def int4_applies(name: str, in_features: int, group_size: int) -> bool:
    """Whether the int4 scheme stores layer ``name`` (a dotted path) as int4 (else int8 per-channel): every block
    projection whose input width divides into groups; never the LM head (see the module docstring)."""
    return name != "output" and in_features % group_size == 0


def quantize_model(model: nn.Module, method: str = METHOD, group_size: int = GROUP_SIZE) -> nn.Module:
    """Quantize ``model`` (a :class:`~minigpt.model.transformer.Transformer`) in place and return it. ``method``
    ``"int8_weight_only"`` (default): every block projection and the LM head become :class:`Int8Linear`;
    ``"int4_weight_only"``: the projections :func:`int4_applies` to become :class:`Int4Linear` with groups of
    ``group_size``, the rest :class:`Int8Linear`. Embeddings, norms and MoE routers stay float. Raises
    ``ValueError`` for an unknown method or a bad group size."""
    config = quant_config(method, group_size)

    def make(linear: nn.Linear, name: str) -> nn.Module:
        if method == METHOD_INT4 and int4_applies(name, linear.in_features, group_size):
            return Int4Linear.from_linear(linear, group_size)
        return Int8Linear.from_linear(linear)

    _replace_linears(model, make)
    model.quantization = config
    return model


def quantized_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of a quantized model to save: int8/int4 weights, their scales and every float tensor (the tied
    embedding kept once as ``tok_embeddings.weight``; the head as its own int8 ``output.weight``)."""
    # Cloned: after FastPath's fusion the tensors are row views of shared storage, which safetensors refuses.
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s state dict (what a checkpoint stores), each tensor counted once however many names it
    has (a tied embedding and LM head are one matrix)."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def quantize_in_place(model: nn.Module, quantize: Optional[str]) -> nn.Module:
    """Quantize ``model`` by the name a user gives (``"int8"``, ``"int4"``; None or ``"none"``: leave it) unless it
    is quantized already. Raises ``ValueError`` for an unknown name."""
    if quantize in (None, "none"):
        return model
    if quantize not in SCHEMES:
        raise ValueError(f"unknown quantization {quantize!r}; choose {', '.join(SCHEMES)} or none")
    if not is_quantized(model):
        quantize_model(model, SCHEMES[quantize])
    return model
