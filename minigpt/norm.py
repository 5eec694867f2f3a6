"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization")."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dimension.

    No mean subtraction and no bias, unlike LayerNorm. The statistics are computed in float32 and the result is
    cast back to the input dtype, as in the Llama reference and Hugging Face ``LlamaRMSNorm``, so bf16/fp16 runs do
    not lose precision in the sum of squares.

    Shapes: ``x`` ``[..., dim]`` -> ``[..., dim]``.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
