"""Many LoRA adapters over one base model, batched together: each row of a forward is served by its own adapter
(or by the base alone), the idea of S-LoRA (Sheng et al. 2023) and Punica (Chen et al. 2023): the base weights are
read once for the whole batch, and each row adds its adapter's low-rank update, gathered from per-projection
stacks of every adapter's ``A`` and ``B`` (:class:`~minigpt.model.lora.MultiLoRA`).

:func:`attach_adapters` wraps the projections of the engine's model: the fast path's fused ones (``wq|wk|wv``,
``w1|w3``, ``wo``, ``w2``: one stack per fused projection, its parts' ranks side by side), or, for architectures the
fast path does not compute, the model's own linear layers. A batch served by the base alone computes exactly what
the unwrapped model computes; the single-model path (no adapters) is not wrapped at all.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from minigpt.errors import MiniGPTError
from minigpt.infer.fastpath import FastPath
from minigpt.model.ffn import GATED
from minigpt.model.lora import AdapterRows, MultiLoRA, MultiLoRALinear, WithAdapters
from minigpt.model.transformer import Transformer

# An adapter's updates: {our module name ("layers.0.attention.wq"): (A [rank, in], B [out, rank], scaling)}, as
# minigpt.checkpoint.adapter.read_adapter returns them.
AdapterWeights = dict[str, tuple[torch.Tensor, torch.Tensor, float]]


def attach_adapters(model: FastPath | Transformer, adapters: list[AdapterWeights],
                    device: Optional[torch.device] = None) -> AdapterRows:
    """Wrap ``model``'s adapted projections so that row ``i`` of a forward is served by adapter ``ids[i]``
    (1-based into ``adapters``; 0 = the base), as set on the returned :class:`AdapterRows` before each forward.

    Raises :class:`MiniGPTError` for a compiled fast path (its graph reads the weights directly) or an adapter
    module the model does not have.
    """
    rows = AdapterRows(device)
    used: set[str] = set()
    base = model.model if isinstance(model, FastPath) else model
    if isinstance(model, FastPath) and model.reason is None:
        if model.compiled:
            raise MiniGPTError("serving several adapters needs the eager fast path, not a compiled one")
        gated = model.config.ffn in GATED
        for i, lw in enumerate(model.layers):
            names = {k: f"layers.{i}.{v}" for k, v in (("q", "attention.wq"), ("k", "attention.wk"),
                                                       ("v", "attention.wv"), ("o", "attention.wo"),
                                                       ("w1", "feed_forward.w1"), ("w3", "feed_forward.w3"),
                                                       ("w2", "feed_forward.w2"))}
            lw.wqkv = _wrap(lw.wqkv, [names["q"], names["k"], names["v"]], base, adapters, rows, used, device)
            lw.wo = _wrap(lw.wo, [names["o"]], base, adapters, rows, used, device)
            lw.w13 = _wrap(lw.w13, [names["w1"], names["w3"]] if gated else [names["w1"]], base, adapters, rows,
                           used, device)
            lw.w2 = _wrap(lw.w2, [names["w2"]], base, adapters, rows, used, device)
    else:
        for name in sorted({n for ad in adapters for n in ad}):
            module = base.get_submodule(name)
            lora = MultiLoRA.stack([[ad.get(name)] for ad in adapters], module.in_features, [module.out_features],
                                   rows, device)
            parent, child = name.rsplit(".", 1)
            setattr(base.get_submodule(parent), child, MultiLoRALinear(module, lora))
            used.add(name)
    missing = sorted({n for ad in adapters for n in ad} - used)
    if missing:
        raise MiniGPTError(f"the adapters adapt {missing[0]}, which this model's serving path does not have")
    return rows


def _wrap(proj, names: list[str], base: nn.Module, adapters: list[AdapterWeights], rows: AdapterRows,
          used: set[str], device):
    """``proj`` (a fused projection of ``names``' outputs, or the list of their unfused ones) with the adapters'
    updates of those modules; ``proj`` itself when no adapter touches them."""
    if isinstance(proj, list):
        return [_wrap(p, [n], base, adapters, rows, used, device) for p, n in zip(proj, names)]
    if not any(n in ad for ad in adapters for n in names):
        return proj
    modules = [base.get_submodule(n) for n in names]
    lora = MultiLoRA.stack([[ad.get(n) for n in names] for ad in adapters], modules[0].in_features,
                           [m.out_features for m in modules], rows, device)
    used.update(names)
    return WithAdapters(proj, lora)
