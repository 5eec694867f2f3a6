"""bf16 mixed precision on CPUs with and without native bf16 arithmetic.

``torch.autocast("cpu", torch.bfloat16)`` runs every linear layer and attention as a bf16 kernel. On CPUs with
AVX-512-BF16 or AMX that is up to twice as fast as fp32; on the others (AVX2-only CPUs, e.g. this repository's
2-core AMD EPYC) oneDNN emulates bf16 with scalar-ish code and the same GEMM runs 10-200x slower than fp32
(``F.linear`` 2048x384x1024: ~6 GFLOP/s bf16 vs ~70 fp32 on one core), so bf16 training is ~3x *slower* than fp32.

:func:`autocast` keeps bf16 numerics but picks the kernels by what the CPU has. Without native bf16 it enters
:class:`EmulatedBf16`, which computes every ``F.linear`` and ``F.scaled_dot_product_attention`` exactly as a bf16
kernel with float32 accumulation would -- operands rounded to bf16, products formed and summed in float32, the result
rounded to bf16 -- but with the fp32 kernels: the product of two bf16 numbers (8-bit significands) is exact in
float32 (24 bits), so only the summation order differs from a native bf16 GEMM. The backward pass follows
``torch.autocast``'s semantics too: activation and weight gradients are bf16 products (rounded to bf16, the weight
gradient then cast to the float32 parameter's dtype). Elementwise ops run on the bf16 tensors they receive, as under
autocast; the model's norms, softmax and loss upcast to float32 themselves.

Where the CPU has native bf16 but no AMX, :func:`autocast` is ``torch.autocast`` with the attention of compiled
code in float32 (:class:`Float32Attention`): PyTorch's CPU flash kernel is faster in float32 there.

What it does not give: bf16's speed-up over fp32 (there is no bf16 hardware to use) or its memory saving on
weights (fp32 master weights are kept either way; saved activations are bf16 as with autocast). MFU of a run under
emulation is quoted against the fp32 peak, the arithmetic actually used (:func:`compute_dtype`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from minigpt.runtime import DTYPES, cpu_flags, native_bf16

BF16 = torch.bfloat16


def training_dtype(name: str, device_type: str) -> torch.dtype:
    """The autocast dtype a recipe's ``dtype`` names. ``auto``: bf16 where :func:`native_bf16` says the device has
    fast bf16 matrix kernels (a CUDA GPU from Ampere on, AVX-512-BF16 / AMX CPUs), else float32 -- so one recipe runs
    at its best speed on either kind of CPU instead of emulating bf16 where it would gain nothing.
    Raises ``KeyError`` for a name outside float32 / bfloat16 / float16 / auto."""
    if name == "auto":
        return BF16 if native_bf16(device_type) else torch.float32
    return DTYPES[name]


def compute_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the matrix arithmetic of :func:`autocast` really runs in: float32 under bf16 emulation, else
    ``dtype``. MFU is quoted against this dtype's measured peak."""
    if dtype == BF16 and device_type == "cpu" and not native_bf16("cpu"):
        return torch.float32
    return dtype


def autocast(device_type: str, dtype: torch.dtype, emulate: bool | None = None,
             float32_attention: bool | None = None):
    """A mixed-precision context: nothing for float32; for bf16 on a CPU without native bf16 (or ``emulate=True``)
    :class:`EmulatedBf16`; otherwise ``torch.autocast(device_type, dtype)``, with its attention in float32
    (:class:`Float32Attention`) where ``float32_attention`` (None: :func:`float32_attention_wanted`)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    if emulate is None:
        emulate = dtype == BF16 and device_type == "cpu" and not native_bf16("cpu")
    if emulate:
        return EmulatedBf16()
    if float32_attention is None:
        float32_attention = float32_attention_wanted(device_type)
    if float32_attention and dtype == BF16 and device_type == "cpu":
        return Float32Attention()
    return torch.autocast(device_type=device_type, dtype=dtype)


def float32_attention_wanted(device_type: str) -> bool:
    """Whether bf16 autocast should run compiled attention in float32 on this device (:class:`Float32Attention`):
    a CPU with native bf16 but no AMX.

    Why: there PyTorch's CPU flash-attention kernel is slower in bf16 than in float32. Measured on a 2-core Zen 4
    EPYC (family 25 model 17, AVX512-BF16, no AMX), causal, batch 8 x 256 positions, the inputs strided as the
    model's (``[batch, seq, heads, head_dim]`` transposed), forward + backward, medians of 15: the `small` preset's
    shape (12 heads, 3 KV heads, head_dim 32) 40.4 ms in bf16 against 31.1 ms in float32, the casts included. In a
    whole compiled training step (`minigpt bench`'s train row: AdamW, 8 x 256 tokens, one model alternating the
    two, paired medians): `small` 1.055-1.110x over four runs, `medium` 1.040x. Eagerly the casts, each a pass of
    its own, cost what the kernel saves (`small` 0.97-1.00x, `medium` 0.95x), so eager steps keep the bf16
    kernel. On AMX CPUs (Sapphire Rapids) the bf16 kernel is kept: not measured against float32 there."""
    return device_type == "cpu" and native_bf16("cpu") and "amx_bf16" not in cpu_flags()


class Float32Attention(TorchFunctionMode):
    """``torch.autocast("cpu", torch.bfloat16)``, and in code that ``torch.compile`` traces under it
    ``F.scaled_dot_product_attention`` on its bf16 inputs computed in float32 (autocast off for the call), the
    output rounded to bf16: the attention :class:`EmulatedBf16` computes, at least as accurate as autocast's bf16
    kernel (float32 scores, products of exact bf16 values); Inductor folds the casts into the kernels beside them.
    Run eagerly, attention and every other call are autocast's (:func:`float32_attention_wanted` says why). Use as
    a context manager, like ``torch.autocast``. Shapes as for SDPA: ``q`` ``[batch, heads, q_len, head_dim]`` ->
    the same, bf16."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and torch.compiler.is_compiling():
            with torch.autocast("cpu", enabled=False):
                return _bf16_sdpa(*args, **kwargs)
        return func(*args, **kwargs)

    def __enter__(self):
        self._autocast = torch.autocast("cpu", dtype=BF16)
        self._autocast.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._autocast.__exit__(*exc)


def _bf16_values(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16 (round-to-nearest-even), as float32: exact inputs for an fp32 kernel."""
    return t.to(BF16).float()


class _Bf16Linear(torch.autograd.Function):
    """``y = x W^T + b`` with bf16 operands, float32 accumulation and a bf16 result, in both directions.

    Shapes: ``x`` ``[..., in]``, ``weight`` ``[out, in]``, ``bias`` ``[out]`` or None -> ``[..., out]`` bf16.
    Gradients: ``dx = (dy W)`` rounded to bf16 then cast to ``x``'s dtype; ``dW = dy^T x`` and ``db = sum(dy)``
    rounded to bf16 then cast to the parameters' dtype -- what autocast's bf16 GEMMs and casts produce."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        xb, wb = x.to(BF16), weight.to(BF16)
        y = F.linear(xb.float(), wb.float(), None if bias is None else _bf16_values(bias))
        ctx.save_for_backward(xb, wb)  # bf16, as autocast saves them
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.to(BF16)

    @staticmethod
    def backward(ctx, grad):
        xb, wb = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g = _bf16_values(grad)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ wb.float()).to(BF16).to(x_dtype)
        if ctx.needs_input_grad[1]:
            g2, x2 = g.reshape(-1, g.shape[-1]), xb.reshape(-1, xb.shape[-1]).float()
            grad_w = (g2.t() @ x2).to(BF16).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = g.reshape(-1, g.shape[-1]).sum(0).to(BF16).to(b_dtype)
        return grad_x, grad_w, grad_b


def _bf16_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA on bf16-rounded ``q``/``k``/``v`` computed in float32, output rounded to bf16 (autograd flows through
    the casts, so the input gradients are rounded to bf16 as well)."""
    if attn_mask is not None and attn_mask.is_floating_point():  # an additive bias (ALiBi): SDPA wants q's dtype
        attn_mask = attn_mask.float()
    kw = {"attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale}
    if enable_gqa:
        kw["enable_gqa"] = True
    out = F.scaled_dot_product_attention(_bf16_values(q), _bf16_values(k), _bf16_values(v), **kw)
    return out.to(BF16)


class EmulatedBf16(TorchFunctionMode):
    """The bf16 autocast policy for linear layers and attention, computed with fp32 kernels (module docstring).

    Only ``F.linear`` and ``F.scaled_dot_product_attention`` are rerouted (they are autocast's bf16 ops that this
    model uses); every other call runs unchanged. Use as a context manager around the forward pass, like
    ``torch.autocast``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.is_floating_point() and weight.is_floating_point():
                return _Bf16Linear.apply(x, weight, bias)
        elif func is F.scaled_dot_product_attention:
            return _bf16_sdpa(*args, **kwargs)
        return func(*args, **kwargs)
