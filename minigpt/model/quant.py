"""int8 weight-only quantization: per-output-channel symmetric scales, applied at load time, saved and loaded as is.

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
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

METHOD = "int8_weight_only"
QUANT_CONFIG = {"method": METHOD, "granularity": "per_output_channel"}


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


def is_quantized(model: nn.Module) -> bool:
    """True when ``model`` holds :class:`Int8Linear` layers."""
    return any(isinstance(m, Int8Linear) for m in model.modules())


def _replace_linears(model: nn.Module, make) -> None:
    """Replace every ``nn.Linear`` below ``model.layers`` and the LM head ``model.output`` by ``make(linear)``,
    except MoE routers: their logits pick the experts, and a rounding flip there changes which weights run."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            inside = full.startswith("layers.") or full == "output"
            if inside and isinstance(child, nn.Linear) and child_name != "router":
                setattr(module, child_name, make(child))


def quantize_model(model: nn.Module) -> nn.Module:
    """Quantize ``model`` (a :class:`~minigpt.model.transformer.Transformer`) in place: every block projection and the LM
    head become :class:`Int8Linear`; embeddings, norms and MoE routers stay float. Returns it."""
    _replace_linears(model, Int8Linear.from_linear)
    model.quantization = dict(QUANT_CONFIG)
    return model


def quantized_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of a quantized model to save: int8 weights, their scales and every float tensor (the tied
    embedding kept once as ``tok_embeddings.weight``; the head as its own int8 ``output.weight``)."""
    # Cloned: after FastPath's fusion the tensors are row views of shared storage, which safetensors refuses.
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
