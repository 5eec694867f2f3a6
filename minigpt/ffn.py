"""SwiGLU feed-forward network (Shazeer 2020, "GLU Variants Improve Transformer"; used by Llama)."""
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
