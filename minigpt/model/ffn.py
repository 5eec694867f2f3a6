"""Position-wise feed-forward networks: the gated SwiGLU (Llama) and GeGLU (Shazeer 2020, "GLU Variants Improve
Transformer"), and the plain two-layer MLP with GELU (Hendrycks & Gimpel 2016; GPT-2) or ReLU (Vaswani et al. 2017).

Names follow the Llama reference: ``w1`` is the first (gate) projection, ``w3`` the up projection of a gated FFN,
``w2`` the down projection back into the residual stream.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: a gated MLP. ``w1`` is the gate, ``w3`` the up projection, ``w2`` the down.

    Shapes: ``[batch, seq_len, dim] -> [batch, seq_len, dim]`` through ``hidden_dim`` channels.
    """

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden_dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class GeGLU(SwiGLU):
    """``w2(gelu(w1 x) * w3 x)``: SwiGLU with the exact (erf) GELU as the gate (Shazeer 2020, eq. 6)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.gelu(self.w1(x)) * self.w3(x)))


class MLP(nn.Module):
    """``w2(act(w1 x))`` with ``act`` = ``"gelu"`` (exact erf form) or ``"relu"``; two matrices, no gate.

    Shapes: ``[batch, seq_len, dim] -> [batch, seq_len, dim]`` through ``hidden_dim`` channels.
    """

    def __init__(self, dim: int, hidden_dim: int, activation: str, bias: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        if activation not in ("gelu", "relu"):
            raise ValueError(f"MLP activation must be 'gelu' or 'relu', got {activation!r}")
        self.activation = F.gelu if activation == "gelu" else F.relu
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(self.activation(self.w1(x))))


def build_ffn(kind: str, dim: int, hidden_dim: int, bias: bool = False, dropout: float = 0.0) -> nn.Module:
    """The FFN named by ``ModelConfig.ffn``: ``swiglu``, ``geglu``, ``gelu`` or ``relu``; ``ValueError`` otherwise."""
    if kind == "swiglu":
        return SwiGLU(dim, hidden_dim, bias, dropout)
    if kind == "geglu":
        return GeGLU(dim, hidden_dim, bias, dropout)
    if kind in ("gelu", "relu"):
        return MLP(dim, hidden_dim, kind, bias, dropout)
    raise ValueError(f"ModelConfig.ffn must be one of swiglu, geglu, gelu, relu; got {kind!r}")
