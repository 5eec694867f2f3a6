"""Normalisation layers: RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; Llama's choice) and
LayerNorm (Ba et al. 2016, "Layer Normalization"; the 2017 Transformer's and GPT-2's)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dimension: ``x`` ``[..., dim]``, ``weight``
    ``[dim]`` -> ``[..., dim]``.

    No mean subtraction and no bias, unlike LayerNorm. The statistics are computed in float32 and the result is
    cast back to the input dtype before the gain, as in the Llama reference and Hugging Face ``LlamaRMSNorm``, so
    bf16/fp16 runs do not lose precision in the sum of squares. The one RMSNorm formula of the package:
    :class:`RMSNorm` and the inference fast path (:mod:`minigpt.infer.fastpath`) both call it.
    """
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    # type_as rather than .to(x.dtype): the same cast, and about a microsecond less Python overhead when it is a
    # no-op (float32 activations), which the eager decode step pays twice per layer.
    return weight * x32.type_as(x)


class RMSNorm(nn.Module):
    """:func:`rms_norm` with a learned gain ``weight`` ``[dim]`` (initialised to ones).

    Shapes: ``x`` ``[..., dim]`` -> ``[..., dim]``.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """``y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias`` over the last dimension (biased variance).

    Statistics in float32 like :class:`RMSNorm`, so the two differ only in the mean subtraction and the bias, which
    is what the RMSNorm-vs-LayerNorm comparison is about. Shapes: ``[..., dim]`` -> ``[..., dim]``.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * y + self.bias


def build_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """``kind`` ``"rmsnorm"`` or ``"layernorm"`` (``ModelConfig.norm``); raises ``ValueError`` otherwise."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    if kind == "layernorm":
        return LayerNorm(dim, eps)
    raise ValueError(f"ModelConfig.norm must be 'rmsnorm' or 'layernorm', got {kind!r}")
