"""Mixture-of-experts feed-forward layer with top-k routing (Shazeer et al. 2017; Switch Transformer, Fedus et al.
2022; Mixtral, Jiang et al. 2024), optional always-on shared experts (DeepSeekMoE, Dai et al. 2024), and the two
router losses: load balancing and z-loss.

Routing (Mixtral's, and ``transformers``' ``MixtralSparseMoeBlock``): router logits ``r = W_router x``
``[tokens, n_experts]``; probabilities ``p = softmax(r)``; each token goes to the ``k`` experts with the largest
``p``, and their outputs are mixed with weights ``p_top / sum(p_top)`` -- the same as a softmax over the top-k
logits alone. With ``k = 1`` the weight is therefore 1 and the router learns only through the auxiliary losses.

Dispatch is vectorised over tokens: the ``tokens * k`` (token, expert) assignments are sorted by expert, each expert
runs once on the contiguous slice of tokens routed to it (a loop over experts, never over tokens), and the weighted
outputs are scattered back with ``index_add_``.

Auxiliary losses, per MoE layer (``T`` tokens, ``N`` experts):

* load balancing (Switch Transformer eq. 4-6, with ``f`` counted over the ``T * k`` assignments as in
  DeepSeek-V2's expert-level balance loss): ``L_aux = N * sum_i f_i * P_i``, where ``f_i`` is the fraction of
  assignments that went to expert ``i`` and ``P_i`` the mean router probability of expert ``i``. It equals 1 under
  perfectly uniform routing. (``transformers``' ``load_balancing_loss_func`` divides by ``T`` instead of ``T * k``,
  giving ``k`` times this value.) ``f`` is a count and has no gradient; the loss pushes ``P`` towards experts
  that receive few tokens.
* router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): ``L_z = mean_t (logsumexp_i r_ti)^2``, which keeps router
  logits small and the softmax numerically stable.

The layer stores ``coef_aux * L_aux + coef_z * L_z`` of its latest forward in ``aux_loss`` (with its graph) for the
training loss to consume (:meth:`minigpt.model.transformer.Transformer.pop_aux_loss` clears it, so no graph outlives a
step), and detached statistics (the two losses and the fraction of assignments per expert) in ``stats``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from minigpt.model.config import ModelConfig
from minigpt.model.ffn import build_ffn


def route(router_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing: ``(probs [T, N] float32, weights [T, k] float32, experts [T, k] int64)``.

    ``probs = softmax(router_logits)``; ``experts`` are the ``k`` most probable experts per token (descending) and
    ``weights`` their probabilities renormalised to sum to 1 (Mixtral).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    top_p, experts = torch.topk(probs, k, dim=-1)
    return probs, top_p / top_p.sum(dim=-1, keepdim=True), experts


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """``N * sum_i f_i * P_i`` for ``probs`` ``[T, N]`` and the chosen ``experts`` ``[T, k]`` (see the module
    docstring; 1.0 for perfectly uniform routing)."""
    n_experts = probs.shape[-1]
    counts = torch.zeros(n_experts, device=probs.device, dtype=torch.float32)
    counts.index_add_(0, experts.reshape(-1), torch.ones(experts.numel(), device=probs.device))
    f = counts / experts.numel()
    return n_experts * torch.sum(f * probs.mean(dim=0))


def router_z_loss(router_logits: torch.Tensor) -> torch.Tensor:
    """``mean_t (logsumexp_i router_logits[t, i])^2`` for ``router_logits`` ``[T, N]`` (ST-MoE eq. 5)."""
    return torch.logsumexp(router_logits.float(), dim=-1).pow(2).mean()


class MoE(nn.Module):
    """``n_experts`` FFNs of width ``moe_hidden_dim`` (of type ``config.ffn``) behind a linear router, plus
    ``n_shared_experts`` always-on experts fused into one FFN of width ``n_shared_experts * moe_hidden_dim``.

    Shapes: ``[batch, seq_len, dim] -> [batch, seq_len, dim]``. Parameters: ``router`` ``[n_experts, dim]``,
    ``experts.{e}.w1/w2/w3`` as in :mod:`minigpt.model.ffn` (the names of Mixtral's original checkpoints), ``shared``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_experts = config.n_experts
        self.top_k = config.n_experts_per_token
        self.aux_coef = config.router_aux_loss_coef
        self.z_coef = config.router_z_loss_coef
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = nn.ModuleList(
            build_ffn(config.ffn, config.dim, config.moe_hidden_dim, config.has_mlp_bias)
            for _ in range(config.n_experts))
        self.shared = None
        if config.n_shared_experts:
            self.shared = build_ffn(config.ffn, config.dim, config.n_shared_experts * config.moe_hidden_dim,
                                    config.has_mlp_bias)
        self.dropout = nn.Dropout(config.dropout)
        self.aux_loss: Optional[torch.Tensor] = None
        self.stats: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, dim]
        logits = self.router(flat)  # [T, n_experts]
        probs, weights, experts = route(logits, self.top_k)

        # Sort the T*k assignments by expert: expert e's tokens are then one contiguous slice of `order`.
        assigned = experts.reshape(-1)  # assignment a = token a // k, its (a % k)-th choice
        order = torch.argsort(assigned, stable=True)
        token_of = order // self.top_k
        weight_of = weights.reshape(-1)[order].to(x.dtype)
        counts = torch.bincount(assigned, minlength=self.n_experts)
        out = torch.zeros_like(flat)
        start = 0
        for e, n in enumerate(counts.tolist()):  # one host sync per layer for the slice bounds
            if n:
                idx = token_of[start:start + n]
                out.index_add_(0, idx, self.experts[e](flat[idx]) * weight_of[start:start + n, None])
                start += n
        if self.shared is not None:
            out = out + self.shared(flat)

        lb, z = load_balancing_loss(probs, experts), router_z_loss(logits)
        self.aux_loss = self.aux_coef * lb + self.z_coef * z
        self.stats = {"aux_loss": lb.detach(), "z_loss": z.detach(),
                      "load": counts.detach().float() / assigned.numel()}
        return self.dropout(out.reshape(shape))
