"""Throughput accounting of a model: FLOPs per token (training and inference) and the parameters a mixture of
experts leaves idle. The measured peak FLOP/s and memory in use are :mod:`minigpt.runtime`'s."""
from __future__ import annotations

from minigpt.model.config import ModelConfig


def idle_expert_parameters(config: ModelConfig) -> int:
    """Parameters of the experts a token does *not* use: ``(n_experts - n_experts_per_token)`` experts on each MoE
    layer (0 for a dense model). Total minus this is the active parameter count ``N_active`` (Fedus et al. 2022)."""
    if not config.n_experts:
        return 0
    gated = config.ffn in ("swiglu", "geglu")
    per_expert = (3 if gated else 2) * config.dim * config.moe_hidden_dim
    if config.has_mlp_bias:
        per_expert += (2 if gated else 1) * config.moe_hidden_dim + config.dim
    return config.n_moe_layers * (config.n_experts - config.n_experts_per_token) * per_expert


def flops_per_token(config: ModelConfig, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * N_active + 12 * n_layers * n_heads * head_dim * seq_len``.

    ``6N`` is forward (2N) plus backward (4N) over every weight matrix (Kaplan et al. 2020); the second term is
    the attention score and value products, which have no parameters (Chowdhery et al. 2022, PaLM, appendix B;
    nanoGPT's ``estimate_mfu``). ``n_params`` is the total parameter count; ``N`` counts the tied LM head once, which
    is the matmul it performs. For a mixture of experts only the experts a token is routed to compute, so
    ``N_active = n_params - idle_expert_parameters(config)``. Inference costs a third of this.
    """
    n_active = n_params - idle_expert_parameters(config)
    return 6.0 * n_active + 12.0 * config.n_layers * config.n_heads * config.head_dim * seq_len
