"""The optimizers a recipe can pick (``TrainerConfig.optimizer``): AdamW everywhere, or Muon for the hidden matrices.

* ``adamw`` (Loshchilov & Hutter 2019): every trainable parameter, weight decay on tensors with >= 2 dims only
  (matrices and embeddings, never norms or biases; nanoGPT's grouping), :func:`param_groups`.
* ``muon`` (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; modded-nanoGPT):
  ``torch.optim.Muon`` for the 2-D weight matrices inside the transformer blocks -- the attention projections
  ``wq``/``wk``/``wv``/``wo`` and the FFN (and expert) matrices ``w1``/``w2``/``w3`` -- and AdamW for the rest: the
  token and position embeddings, the LM head (tied or not), the norms' gains, biases and MoE routers
  (:func:`split_parameters`). Muon keeps SGD-momentum (Nesterov) per matrix and replaces each update by its
  orthogonalised form, five steps of the quintic Newton-Schulz iteration ``X <- a X + b (X X^T) X + c (X X^T)^2 X``
  with ``(a, b, c) = (3.4445, -4.7750, 2.0315)`` on the Frobenius-normalised momentum, run in bfloat16: singular
  values that start above ~0.002 of the Frobenius norm end in about ``[0.68, 1.2]`` (the iteration trades exactness
  for slope at 0; tested). Embeddings and the head are not hidden layers -- their inputs are one-hot or their rows
  compete in a softmax -- so the reference recipe keeps them on Adam, and vectors have nothing to orthogonalise.

  Muon's learning rate is its own (``muon_lr``, Keller Jordan's default 0.02, scaled per matrix by
  ``sqrt(max(1, rows / cols))``, ``adjust_lr_fn="original"``); the schedule (warmup, cosine decay) multiplies both
  optimizers' peaks by the same factor (:func:`set_lr`). Momentum ``muon_momentum`` (0.95), decoupled weight decay
  ``muon_weight_decay`` (0 by default, as in Keller Jordan's ``MuonWithAuxAdam``).

The two optimizers are stepped as one by :class:`MuonWithAdamW`, which iterates as the pair, so
``torch.distributed.checkpoint``'s ``get/set_optimizer_state_dict`` save and restore both states (the momentum
buffers and AdamW's moments, keyed by parameter name) and a resumed run continues bit for bit. Muon needs every
matrix whole, so it is refused under FSDP sharding (DDP replicates the gradients and works).
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

OPTIMIZERS = ("adamw", "muon")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay only tensors with >= 2 dims (matrices, embeddings), never norms or biases (nanoGPT)."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a tied matrix once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """True for a parameter Muon updates: a 2-D weight inside a transformer block (``layers.N...``) that is not an
    MoE router. ``name`` as ``model.named_parameters()`` gives it."""
    return p.dim() == 2 and name.startswith("layers.") and ".router." not in name


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(muon, adamw)``: the trainable parameters of ``model`` for Muon (:func:`is_hidden_matrix`) and the rest, each
    parameter once (a tied embedding / head matrix is the embedding, so AdamW)."""
    muon, adamw = [], []
    for name, p in model.named_parameters():  # a tied matrix appears once, under its first name
        if p.requires_grad:
            (muon if is_hidden_matrix(name, p) else adamw).append(p)
    return muon, adamw


class MuonWithAdamW:
    """``torch.optim.Muon`` over the hidden matrices and ``torch.optim.AdamW`` over the rest, used as one optimizer:
    ``param_groups`` (Muon's groups first), ``step``, ``zero_grad``, ``state_dict`` / ``load_state_dict``, and
    iteration over the two optimizers (what ``torch.distributed.checkpoint`` takes for several optimizers)."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW) -> None:
        self.muon, self.adamw = muon, adamw
        self.optimizers = (muon, adamw)

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        return {**self.muon.state, **self.adamw.state}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer | MuonWithAdamW:
    """The optimizer ``cfg.optimizer`` names over ``model``'s trainable parameters (``cfg`` a
    :class:`~minigpt.train.config.TrainerConfig`: ``lr``, ``weight_decay``, ``beta1``, ``beta2``, ``eps``, and for
    Muon ``muon_lr``, ``muon_momentum``, ``muon_weight_decay``). AdamW is torch's fused kernel on CPU and CUDA, as
    transformers' Trainer picks by default (``adamw_torch_fused``): on a 2-core CPU one step over the 20M-parameter
    ``small`` preset takes 15 ms against 78 ms for the default multi-tensor loop, 76 against 420 ms at ``medium``
    (docs/benchmarks.md), the same update to float32 rounding.

    Raises ``ValueError`` for an unknown optimizer, or Muon over a model with no hidden matrix (nothing for it to do).
    """
    fused = next(model.parameters()).device.type in ("cpu", "cuda")
    adamw_kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(param_groups(model, cfg.weight_decay), **adamw_kw)
    if cfg.optimizer != "muon":
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {cfg.optimizer!r}")
    muon_params, rest = split_parameters(model)
    if not muon_params:
        raise ValueError("optimizer muon found no trainable hidden matrix (2-D weight in a transformer block); "
                         "use optimizer adamw")
    muon = torch.optim.Muon(muon_params, lr=cfg.muon_lr, weight_decay=cfg.muon_weight_decay,
                            momentum=cfg.muon_momentum, nesterov=True)
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    return MuonWithAdamW(muon, torch.optim.AdamW([g for g in groups if g["params"]], **adamw_kw))


def set_lr(optimizer, lr: float, cfg) -> None:
    """Set every group's learning rate for a step whose scheduled rate is ``lr`` (on the ``cfg.lr`` scale): AdamW's
    groups get ``lr``, Muon's ``lr * cfg.muon_lr / cfg.lr`` -- the same warmup and decay shape at Muon's own peak."""
    optimizers = optimizer if isinstance(optimizer, MuonWithAdamW) else (optimizer,)
    for opt in optimizers:
        scale = cfg.muon_lr / cfg.lr if isinstance(opt, torch.optim.Muon) else 1.0
        for group in opt.param_groups:
            group["lr"] = lr * scale
