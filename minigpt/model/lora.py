"""LoRA: low-rank adapters on frozen linear layers (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models").

A frozen projection ``W`` ``[out, in]`` gets a trainable update ``delta W = (lora_alpha / lora_rank) * B A`` with
``A`` ``[lora_rank, in]`` and ``B`` ``[out, lora_rank]``, so ``y = x W^T + dropout(x) A^T B^T * scaling``. ``B``
starts at zero, so the adapted model starts equal to the base (section 4.1 of the paper). ``A`` starts like
``nn.Linear``'s default weight, Kaiming-uniform with ``a = sqrt(5)``, which is PEFT's default
(``init_lora_weights=True``) and Microsoft's ``loralib``. With ``use_rslora`` the scale is
``lora_alpha / sqrt(lora_rank)`` (Kalajdzievski 2023, "rank-stabilized LoRA"), as PEFT's ``use_rslora``.

Targets are named at the boundary with Hugging Face's module names (``q_proj k_proj v_proj o_proj gate_proj
up_proj down_proj``; :data:`HF_TARGETS` maps them to ours), so a ``--lora-targets`` list means the same thing here
as in a PEFT ``LoraConfig``. The PEFT file format is :mod:`minigpt.checkpoint.adapter`.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

from minigpt.errors import MiniGPTError
from minigpt.model.quant import Int8Linear, dequantize_weight, quantize_weight

# Hugging Face (PEFT target) name -> our module name, inside each block (minigpt.interop.hf renames the same way).
HF_TARGETS = {
    "q_proj": "attention.wq",
    "k_proj": "attention.wk",
    "v_proj": "attention.wv",
    "o_proj": "attention.wo",
    "gate_proj": "feed_forward.w1",
    "up_proj": "feed_forward.w3",
    "down_proj": "feed_forward.w2",
}
# The targets of the original paper's best budget (section 7.1: W_q and W_v).
DEFAULT_TARGETS = ("q_proj", "v_proj")


class LoRALinear(nn.Module):
    """A frozen ``base_layer`` (``nn.Linear`` or :class:`~minigpt.model.quant.Int8Linear`) plus a low-rank update.

    ``[..., in] -> [..., out]``: ``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``. ``lora_A`` ``[rank, in]``
    and ``lora_B`` ``[out, rank]`` are ``nn.Linear`` layers without bias (the attribute names and the weight
    layout of PEFT's ``LoraLayer``). They are float32 on an int8 base, else the base weight's dtype.
    """

    def __init__(self, base_layer: nn.Module, lora_rank: int, lora_alpha: float, lora_dropout: float = 0.0,
                 use_rslora: bool = False) -> None:
        super().__init__()
        check_lora_args(lora_rank, lora_alpha, lora_dropout)
        if not isinstance(base_layer, (nn.Linear, Int8Linear)):
            raise MiniGPTError(f"LoRA wraps nn.Linear or Int8Linear layers, not {type(base_layer).__name__}")
        self.base_layer = base_layer
        for p in base_layer.parameters():
            p.requires_grad_(False)
        weight = base_layer.weight
        dtype = torch.float32 if isinstance(base_layer, Int8Linear) else weight.dtype
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.lora_rank, self.lora_alpha, self.use_rslora = lora_rank, lora_alpha, use_rslora
        self.scaling = lora_alpha / (math.sqrt(lora_rank) if use_rslora else lora_rank)
        self.lora_dropout = nn.Dropout(lora_dropout) if lora_dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(self.in_features, lora_rank, bias=False, device=weight.device, dtype=dtype)
        self.lora_B = nn.Linear(lora_rank, self.out_features, bias=False, device=weight.device, dtype=dtype)
        self.disabled = False  # True inside adapters_disabled(): the layer computes the base alone
        self.reset_lora_parameters()
        self.train(base_layer.training)  # a layer added to a model in eval mode must not start dropping out

    def reset_lora_parameters(self) -> None:
        """``A`` Kaiming-uniform (``a = sqrt(5)``, nn.Linear's and PEFT's default), ``B`` zeros: delta W = 0."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if self.disabled:
            return y
        a = self.lora_A.weight
        update = self.lora_B(self.lora_A(self.lora_dropout(x.to(a.dtype))))
        return y + (update * self.scaling).to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        """``scaling * B A`` ``[out, in]`` (float32): what merging adds to the base weight."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def merged(self) -> nn.Module:
        """A plain layer of the base's type computing the same function (without dropout) with ``W + delta W``.

        An int8 base is dequantized, merged and quantized again per output channel, so the result carries the
        rounding error of one more quantization (at most half a quantization step per weight).
        """
        base = self.base_layer
        with torch.no_grad():
            if isinstance(base, Int8Linear):
                w = dequantize_weight(base.weight, base.weight_scale) + self.delta_weight()
                out = Int8Linear(self.in_features, self.out_features, base.bias is not None, device=w.device)
                out.weight, out.weight_scale = quantize_weight(w)
                if base.bias is not None:
                    out.bias = base.bias.clone()
                return out
            base.weight += self.delta_weight().to(base.weight.dtype)
        return base

    def extra_repr(self) -> str:
        return f"lora_rank={self.lora_rank}, lora_alpha={self.lora_alpha}, scaling={self.scaling:g}"


def check_lora_args(lora_rank: int, lora_alpha: float, lora_dropout: float) -> None:
    """Raise :class:`MiniGPTError` (one line) for a rank <= 0, a non-positive alpha or a dropout outside [0, 1)."""
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank <= 0:
        raise MiniGPTError(f"lora_rank must be a positive integer, got {lora_rank!r}")
    if isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float)) or not lora_alpha > 0:
        raise MiniGPTError(f"lora_alpha must be positive, got {lora_alpha!r}")
    if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)) or not 0.0 <= lora_dropout < 1.0:
        raise MiniGPTError(f"lora_dropout must be in [0, 1), got {lora_dropout!r}")


def resolve_targets(targets: Iterable[str] | str) -> list[str]:
    """Hugging Face target names (a list, or a comma-separated string; ``"all-linear"`` = all seven) -> checked
    list. Raises :class:`MiniGPTError` naming an unknown target and the valid ones."""
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    targets = list(targets)
    if targets == ["all-linear"]:
        return list(HF_TARGETS)
    if not targets:
        raise MiniGPTError(f"no LoRA target modules given; choose from {', '.join(HF_TARGETS)} or all-linear")
    for t in targets:
        if t not in HF_TARGETS:
            raise MiniGPTError(f"unknown LoRA target module {t!r}; valid: {', '.join(HF_TARGETS)} (or all-linear)")
    return targets


def target_module_names(model: nn.Module, targets: Iterable[str]) -> list[str]:
    """Our module names (``layers.{i}.attention.wq`` ...) of the linear layers ``targets`` (HF names) select, in
    layer order. Mixture-of-experts FFNs hold no ``w1/w2/w3`` at the block level and are not targeted."""
    names = []
    wanted = {HF_TARGETS[t] for t in targets}
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "layers" and ".".join(parts[2:]) in wanted \
                and isinstance(module, (nn.Linear, Int8Linear, LoRALinear)):
            names.append(name)
    return names


def apply_lora(model: nn.Module, lora_rank: int, lora_alpha: float, lora_dropout: float = 0.0,
               targets: Iterable[str] | str = DEFAULT_TARGETS, use_rslora: bool = False,
               layers: Optional[Iterable[int]] = None) -> list[str]:
    """Freeze every parameter of ``model`` (a :class:`~minigpt.model.transformer.Transformer`) and wrap the target
    projections in :class:`LoRALinear`, in place; only the adapters' ``lora_A``/``lora_B`` weights then train.

    ``targets``: Hugging Face module names (see :data:`HF_TARGETS`). ``layers``: restrict to these block indices
    (PEFT's ``layers_to_transform``). Returns the wrapped module names (ours). Raises :class:`MiniGPTError` for a
    rank <= 0, an unknown target, a target that matches no layer, or a model that already has adapters.
    """
    check_lora_args(lora_rank, lora_alpha, lora_dropout)
    targets = resolve_targets(targets)
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise MiniGPTError("the model already has LoRA adapters; merge_lora first to stack another")
    names = target_module_names(model, targets)
    if layers is not None:
        keep = set(layers)
        names = [n for n in names if int(n.split(".")[1]) in keep]
    if not names:
        raise MiniGPTError(f"LoRA targets {', '.join(targets)} match no layer of this model")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent_name, child = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), lora_rank, lora_alpha, lora_dropout, use_rslora))
    return names


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """``{our module name: LoRALinear}`` of ``model``, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every :class:`LoRALinear` by its base layer with ``W + scaling * B A`` folded in (see
    :meth:`LoRALinear.merged`), in place; returns ``model``. ``requires_grad`` flags are left as they are (the
    base weights stay frozen)."""
    for name, layer in list(lora_layers(model).items()):
        parent_name, child = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), child, layer.merged())
    return model


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block every :class:`LoRALinear` of ``model`` computes its frozen base alone, so ``model`` is the
    base model without a second copy in memory (PEFT's ``PeftModel.disable_adapter()``, which TRL's DPO uses as the
    reference model of a LoRA policy). The previous state is restored on exit, also after an exception."""
    layers = list(lora_layers(model).values())
    before = [layer.disabled for layer in layers]
    for layer in layers:
        layer.disabled = True
    try:
        yield model
    finally:
        for layer, state in zip(layers, before):
            layer.disabled = state


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters with ``requires_grad`` (tied matrices once): what an optimizer over ``model`` should update."""
    seen, out = set(), []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


# ---------------------------------------------------------------------------------------------------- many adapters
class AdapterRows:
    """Which adapter serves each row of the next forward, shared by every :class:`MultiLoRA` of one model: ``ids``
    int64 ``[batch]`` (0 = the base model alone), or ``uniform`` when every row has the same one."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self.ids: Optional[torch.Tensor] = None
        self.uniform: Optional[int] = 0

    def set_rows(self, ids: list[int]) -> None:
        """Route the rows of the next forward: ``ids[i]`` serves row ``i``."""
        first = ids[0] if ids else 0
        self.uniform = first if all(i == first for i in ids) else None
        self.ids = None if self.uniform is not None else torch.tensor(ids, dtype=torch.long, device=self.device)


class MultiLoRA:
    """The LoRA updates of several adapters for one (possibly fused) projection, applied per row: S-LoRA's and
    Punica's batched gather (Sheng et al. 2023, "S-LoRA: Serving Thousands of Concurrent LoRA Adapters"; Chen et
    al. 2023, "Punica: Multi-Tenant LoRA Serving", its BGMV kernel), here with ``torch.bmm`` over gathered weights.

    ``a`` ``[n_adapters + 1, rank, in]`` and ``b`` ``[n_adapters + 1, out, rank]`` stack every adapter's ``A`` and
    ``scaling * B`` (index 0: zeros, the base model). A fused projection (the fast path's ``wq|wk|wv``) stacks its
    parts' ranks side by side with ``b`` block-diagonal, so one pair of products serves all parts; smaller ranks
    are zero-padded. ``__call__(x [batch, seq, in]) -> [batch, seq, out]`` (or None when every row is the base):
    row ``i`` gets ``x_i A_{id_i}^T (scaling B_{id_i})^T``.
    """

    def __init__(self, a: torch.Tensor, b: torch.Tensor, rows: AdapterRows) -> None:
        self.a, self.b, self.rows = a, b, rows

    @classmethod
    def stack(cls, parts: list[list[Optional[tuple[torch.Tensor, torch.Tensor, float]]]], in_features: int,
              out_features: list[int], rows: AdapterRows, device=None) -> Optional["MultiLoRA"]:
        """``parts[adapter][p]``: adapter ``adapter + 1``'s ``(A [r, in], B [out_p, r], scaling)`` for part ``p``
        of the projection (output widths ``out_features``), or None where it does not adapt that part. None when no
        adapter adapts any part."""
        ranks = [max((ad[p][0].shape[0] for ad in parts if ad[p] is not None), default=0)
                 for p in range(len(out_features))]
        if not sum(ranks):
            return None
        n = len(parts) + 1
        a = torch.zeros(n, sum(ranks), in_features, device=device)
        b = torch.zeros(n, sum(out_features), sum(ranks), device=device)
        for i, adapter in enumerate(parts, start=1):
            r0, o0 = 0, 0
            for p, part in enumerate(adapter):
                if part is not None:
                    pa, pb, scaling = part
                    r = pa.shape[0]
                    a[i, r0:r0 + r] = pa.float()
                    b[i, o0:o0 + out_features[p], r0:r0 + r] = pb.float() * scaling
                r0, o0 = r0 + ranks[p], o0 + out_features[p]
        return cls(a, b, rows)

    def __call__(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        uniform = self.rows.uniform
        if uniform == 0:
            return None
        x32 = x.float()
        if uniform is not None:  # one adapter for the whole batch: plain products, no gather
            return ((x32 @ self.a[uniform].T) @ self.b[uniform].T).to(x.dtype)
        ids = self.rows.ids
        return torch.bmm(torch.bmm(x32, self.a[ids].transpose(1, 2)), self.b[ids].transpose(1, 2)).to(x.dtype)


class WithAdapters:
    """A projection ``base`` (any callable ``[..., in] -> [..., out]``) plus the per-row updates of a
    :class:`MultiLoRA`; rows served by the base model get exactly ``base(x)``."""

    def __init__(self, base, lora: MultiLoRA) -> None:
        self.base, self.lora = base, lora

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        delta = self.lora(x)
        return y if delta is None else y + delta

    def __getattr__(self, name: str):  # nbytes, weight, ...: the base projection's
        return getattr(self.__dict__["base"], name)


class MultiLoRALinear(nn.Module):
    """An ``nn.Linear`` / :class:`Int8Linear` ``base_layer`` plus the per-row updates of a :class:`MultiLoRA`
    (for models that run their own forward rather than the fast path)."""

    def __init__(self, base_layer: nn.Module, lora: MultiLoRA) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.adapted = WithAdapters(base_layer, lora)
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapted(x)
