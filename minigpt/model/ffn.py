"""Position-wise feed-forward networks: the gated SwiGLU (Llama) and GeGLU (Shazeer 2020, "GLU Variants Improve
Transformer"), and the plain two-layer MLP with GELU (Hendrycks & Gimpel 2016; GPT-2), ReLU (Vaswani et al. 2017) or
squared ReLU (So et al. 2021, "Primer"; modded-nanoGPT's MLP).

Names follow the Llama reference: ``w1`` is the first (gate) projection, ``w3`` the up projection of a gated FFN,
``w2`` the down projection back into the residual stream.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU, ``max(x, 0) ** 2`` (So et al. 2021, "Primer", section 3; modded-nanoGPT), elementwise."""
    return F.relu(x).square()


# The activation of each FFN kind (``ModelConfig.ffn``); the gated kinds apply it to the gate and multiply by the
# up projection. GELU is the exact (erf) form throughout (Hendrycks & Gimpel 2016, eq. 1; Shazeer 2020, eq. 6).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "swiglu": F.silu, "geglu": F.gelu, "gelu": F.gelu, "relu": F.relu, "relu2": relu2}
GATED = frozenset({"swiglu", "geglu"})
PLAIN = frozenset(ACTIVATIONS) - GATED  # two-matrix MLPs


def ffn_hidden(kind: str, h1: torch.Tensor, h3: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The hidden activations ``[..., hidden_dim]`` of an FFN of ``kind`` (a key of :data:`ACTIVATIONS`):
    ``act(h1) * h3`` for the gated kinds (``h1 = w1 x`` the gate, ``h3 = w3 x`` the up projection), ``act(h1)``
    for the plain MLPs. With ``h3`` None a gated kind takes ``h1`` as the fused ``[..., 2 hidden_dim]`` output of
    one gate-then-up projection (the inference fast path's). The one FFN combination of the package: the modules
    below and both blocks of the fast path call it."""
    act = ACTIVATIONS[kind]
    if kind not in GATED:
        return act(h1)
    if h3 is None:
        h1, h3 = h1.chunk(2, dim=-1)
    return act(h1) * h3


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: a gated MLP. ``w1`` is the gate, ``w3`` the up projection, ``w2`` the down.

    Shapes: ``[batch, seq_len, dim] -> [batch, seq_len, dim]`` through ``hidden_dim`` channels.
    """

    kind = "swiglu"

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden_dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(ffn_hidden(self.kind, self.w1(x), self.w3(x))))


class GeGLU(SwiGLU):
    """``w2(gelu(w1 x) * w3 x)``: SwiGLU with the exact (erf) GELU as the gate (Shazeer 2020, eq. 6)."""

    kind = "geglu"


class MLP(nn.Module):
    """``w2(act(w1 x))`` with ``act`` = ``"gelu"`` (exact erf form), ``"relu"`` or ``"relu2"`` (squared ReLU); two
    matrices, no gate.

    Shapes: ``[batch, seq_len, dim] -> [batch, seq_len, dim]`` through ``hidden_dim`` channels.
    """

    def __init__(self, dim: int, hidden_dim: int, activation: str, bias: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        if activation not in PLAIN:
            raise ValueError(f"MLP activation must be one of {sorted(PLAIN)}, got {activation!r}")
        self.kind = activation
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(ffn_hidden(self.kind, self.w1(x))))


def build_ffn(kind: str, dim: int, hidden_dim: int, bias: bool = False, dropout: float = 0.0) -> nn.Module:
    """The FFN named by ``ModelConfig.ffn``: ``swiglu``, ``geglu``, ``gelu``, ``relu`` or ``relu2``; ``ValueError``
    otherwise."""
    if kind == "swiglu":
        return SwiGLU(dim, hidden_dim, bias, dropout)
    if kind == "geglu":
        return GeGLU(dim, hidden_dim, bias, dropout)
    if kind in PLAIN:
        return MLP(dim, hidden_dim, kind, bias, dropout)
    raise ValueError(f"ModelConfig.ffn must be one of {sorted(ACTIVATIONS)}; got {kind!r}")
