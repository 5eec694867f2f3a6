"""The compiled decode step of :class:`~minigpt.infer.fastpath.FastPath`: a traced function of static shapes over
``seq`` new tokens per row (:func:`static_step`), one nested compile region per layer under ``torch.compile``
(:func:`step_layer`, over :func:`decode_layer`), and the ``torch.compile`` set-up that trims its per-call overhead
(:func:`compile_step`).

The layer is the model's block (:func:`~minigpt.model.transformer.pre_norm_residual` with
:func:`~minigpt.model.norm.rms_norm`, :func:`~minigpt.model.rope.rope_rotate` and
:func:`~minigpt.model.ffn.ffn_hidden`) over the fused weights; only the attention core and the matrix-vector
products are written for Inductor here.
"""
from __future__ import annotations

import os
import types
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from minigpt.errors import MiniGPTError
from minigpt.infer.fastpath.kernels import ACT_DTYPE, DECODE_ROWS_MAX, Proj, decode_linear
from minigpt.infer.fastpath.screen import screened_argmax
from minigpt.model.ffn import ffn_hidden
from minigpt.model.norm import rms_norm
from minigpt.model.rope import rope_rotate
from minigpt.model.transformer import pre_norm_residual
from minigpt.runtime import cpu_flags, cpu_vendor

SIMDLEN_ENV = "MINIGPT_STEP_SIMDLEN"


@dataclass(frozen=True)
class Geometry:
    """The static numbers a traced layer needs (hashable: they specialise the compiled region)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    ffn: str
    group_size: int = 0  # of the int4 projections read by ATen's kernels (library.aten_woq_layout); 0: none
    w8a8: bool = False  # the int8 projections of the layers go through FBGEMM (library.w8a8_layout)
    head_w8a8: bool = False  # the LM head does
    float_mv: bool = False  # float32 and bfloat16 projections go through minigpt::float_mv (fastpath.float_mv)
    float_mm: bool = False  # and a prompt's rows through minigpt::float_mm (fastpath.float_mv.float_mm_wanted)


def simd_options() -> dict:
    """Inductor's vector width for the step's generated loops, as compile options: on a CPU with AVX-512, 256 bits
    (AVX2 code) on Intel's and 512 on AMD's, unless ``$MINIGPT_STEP_SIMDLEN`` is ``256``, ``512`` or ``native``
    (Inductor's own choice, the widest); nothing to set elsewhere. Raises ``ValueError`` for another value.

    Why: on a 2-core Xeon (family 6 model 167, docs/benchmarks.md) the 135M decode step with 256-bit loops ran
    fp32 47.6 against 40.4 tokens/s with 512-bit ones, bf16 68.5 against 54.1 (in one process, same tokens). On a
    2-core Zen 4 EPYC (family 25 model 17), which runs 512-bit instructions as two 256-bit halves at the same clock,
    512-bit loops ran bf16 1.05x and int4 1.06x, fp32 0.99x and int8 0.98x (paired medians in one process, session
    57). The int8 and int4 products are MiniGPT's C++ kernels either way."""
    choice = os.environ.get(SIMDLEN_ENV, "").strip().lower()
    if choice not in ("", "256", "512", "native"):
        raise ValueError(f"${SIMDLEN_ENV}={choice!r}: choose 256, 512 or native")
    if choice == "native" or "avx512f" not in cpu_flags():
        return {}
    return {"cpp.simdlen": int(choice or (512 if cpu_vendor() == "AuthenticAMD" else 256))}


def check_compile_mode(compile_mode: Optional[str]) -> Optional[str]:
    """``compile_mode`` if it is None or one of torch.compile's modes (``torch._inductor.list_mode_options``), else
    raises :class:`~minigpt.errors.MiniGPTError` naming them."""
    if compile_mode is not None and compile_mode not in (modes := torch._inductor.list_mode_options()):
        raise MiniGPTError(f"unknown compile mode {compile_mode!r}; choose one of {', '.join(modes)}")
    return compile_mode


def compile_step(fp, compile_mode: Optional[str], serializable: bool = False, greedy: bool = False) -> Callable:
    """``torch.compile`` of :func:`static_step` bound to the FastPath ``fp``: ``(token, input_pos, pad, k_cache,
    v_cache) -> (logits, new_k, new_v)``, compiled on first call of each shape.

    ``compile_mode``: None (Inductor's default) or a mode name such as ``"max-autotune-no-cudagraphs"``.
    ``greedy``: :func:`static_greedy_step` instead (tokens, not logits).
    ``serializable``: for ``.aot_compile`` (:mod:`minigpt.infer.fastpath.aot`): keep only the guards on global state
    (grad mode and the like), the ones a saved step can carry; its caller pins the shapes by the file's key."""
    # size_asserts off: the wrapper would re-check the size and stride of every tensor of every layer on each call
    # (a third of a `tiny` step); the guards on the step's arguments already pin them, and the weights never change.
    guards = _global_state_guards_only if serializable else _guards_on_inputs_only
    options = {"guard_filter_fn": guards, "size_asserts": False, **simd_options()}
    if compile_mode is not None:  # mode and options are exclusive in torch.compile
        options.update(torch._inductor.list_mode_options(compile_mode))
    # A private copy of the step's code object: Dynamo caches compiled graphs per code object, so every FastPath
    # gets its own cache (and the guards dropped on `fp` cannot match another model's weights).
    fn = static_greedy_step if greedy else static_step
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return torch.compile(types.MethodType(fresh, fp), dynamic=False, fullgraph=True, options=options)


def _guards_on_inputs_only(entries) -> list[bool]:
    """Dynamo guard filter of the compiled step: keep the guards on the step's arguments (shapes, dtypes: a new
    batch size or cache length must recompile) and drop those on ``fp`` -- the weights and constants a FastPath
    never rebinds. Checking ~100 weight guards per call cost ~0.3 ms, a tenth of a small model's step."""
    return [not entry.name.startswith("L['fp']") and entry.guard_type not in _DROPPED_GUARDS for entry in entries]


def _global_state_guards_only(entries) -> list[bool]:
    """Guard filter of an ahead-of-time step: the global-state guards (unnamed: grad mode, default device, ...)."""
    return [entry.name == "" for entry in entries]


# The pairwise no-aliasing check spans every tensor the step touches (weights included); the step's own arguments
# (token, position, padding, per-layer caches) never alias by construction.
_DROPPED_GUARDS = ("NO_TENSOR_ALIASING",)


def static_step(fp, token: torch.Tensor, input_pos: torch.Tensor, pad: torch.Tensor,
                k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], regions: bool = True):
    """The traced step of FastPath ``fp`` over ``seq`` new tokens per row (``token`` ``[batch, seq]``; 1 when
    decoding): static shapes, the position ``input_pos`` ``[1]`` and the padding ``pad`` ``[batch]`` as tensors.

    ``k_cache``/``v_cache``: per layer ``[batch, n_kv_heads, T, head_dim]``, read only; every query attends to
    the cached columns ``pad <= column < pos`` (masked scores are ``-inf`` and contribute exact zeros, so the
    result equals attending to the prefix) and to the new tokens' keys and values up to its own.
    Returns ``(logits [batch, seq, vocab], new_k, new_v)``, the last two a list per layer of ``[batch, n_kv_heads,
    seq, head_dim]`` for the caller to write at columns ``pos .. pos + seq - 1``. The graph mutates nothing: with the cache write inside it, the nested compile regions below wrote garbage into
    the cache for models of more than one layer (torch 2.13; tests/infer/test_compile.py covers it).

    ``regions``: each layer through the nested compile region :func:`step_layer` (for ``torch.compile``), else
    :func:`decode_layer` inline (for ``torch.export``, see :func:`_trunk`)."""
    h, new_k, new_v = _trunk(fp, token, input_pos, pad, k_cache, v_cache, regions)
    h = rms_norm(h, fp.final_norm, fp.final_eps)
    g = fp.geometry
    return decode_linear(fp.head, h, w8a8=g.head_w8a8, float_mv=g.float_mv, float_mm=g.float_mm), new_k, new_v


def static_greedy_step(fp, token: torch.Tensor, input_pos: torch.Tensor, pad: torch.Tensor,
                       k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], regions: bool = True):
    """:func:`static_step` for greedy decoding through the head's int8 screen (``fp.screen``,
    :mod:`~minigpt.infer.fastpath.screen`): returns ``(next [batch, seq] int64, new_k, new_v, h [batch, seq,
    dim])``, ``next`` -1 where the screen could not certify the argmax (the caller computes it from ``h``)."""
    h, new_k, new_v = _trunk(fp, token, input_pos, pad, k_cache, v_cache, regions)
    h = rms_norm(h, fp.final_norm, fp.final_eps)
    sc = fp.screen
    return screened_argmax(fp.head.weight, sc.proj, sc.bound, h, sc.native), new_k, new_v, h


def static_prefill(fp, token: torch.Tensor, input_pos: torch.Tensor, pad: torch.Tensor,
                   k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], regions: bool = True):
    """:func:`static_step` without its logits: ``(new_k, new_v)`` of ``seq`` prompt tokens (``token`` ``[batch,
    seq]``), per layer ``[batch, n_kv_heads, seq, head_dim]``, for a prompt's cache columns when only the logits of
    its last token are wanted (the native runner's prefill package, :class:`~minigpt.infer.fastpath.aoti.StepModule`).
    No output reads the last layer's attention output or feed-forward, so a traced graph drops them."""
    _, new_k, new_v = _trunk(fp, token, input_pos, pad, k_cache, v_cache, regions)
    return new_k, new_v


def _trunk(fp, token, input_pos, pad, k_cache, v_cache, regions: bool = True):
    """The layers of the step: ``(h [batch, seq, dim] before the final norm, new_k, new_v)``.

    ``regions`` False calls :func:`decode_layer` directly. Why: ``torch.export`` (the AOTInductor package) traces
    a nested compile region by running Dynamo over it at every call, 30 times for a 30-layer model; inline, the
    same package (the same shared library, byte for byte in size, the same outputs to the bit) took 102.5 s to
    export and compile against 134.9 s at SmolLM-135M's shape on 2 cores, the six of `serve --compile-batch 4`
    914 s against 1,134 s (docs/benchmarks.md, session 49)."""
    layer = step_layer if regions else decode_layer
    columns = torch.arange(k_cache[0].shape[2], device=token.device)
    # The cached columns a query sees: the row's own prefix, without the columns being written now (their keys
    # and values enter the attention directly, see step_layer).
    key_valid = ((columns[None, :] < input_pos) & (columns[None, :] >= pad[:, None]))[:, None, None, :]
    offsets = torch.arange(token.shape[1], device=token.device)
    rope_pos = (input_pos - pad)[:, None] + offsets[None, :]  # [batch, seq]
    cos = fp.cos[rope_pos][:, :, None, :]
    sin = fp.sin_signed[rope_pos][:, :, None, :]
    h = F.embedding(token, fp.embedding).to(ACT_DTYPE)
    new_k, new_v = [], []
    g = fp.geometry
    for i, lw in enumerate(fp.layers):
        h, k, v = layer(h, k_cache[i], v_cache[i], key_valid, cos, sin, lw.attn_norm, *_proj_args(lw.wqkv),
                        *_proj_args(lw.wo), lw.ffn_norm, *_proj_args(lw.w13), *_proj_args(lw.w2), g,
                        lw.attn_norm_eps, lw.ffn_norm_eps)
        new_k.append(k)
        new_v.append(v)
    return h, new_k, new_v


def _proj_args(p: Proj) -> tuple:
    """A projection as plain tensor arguments of a compile region (weight, scale, bias, words, word_scale); the
    words, when there are any, replace the weight (they are the same bytes)."""
    return None if p.words is not None else p.weight, p.scale, p.bias, p.words, p.word_scale


def decode_layer(h, k_cache, v_cache, key_valid, cos, sin, attn_norm, wqkv, wqkv_scale, wqkv_bias, wqkv_words,
                 wqkv_ws, wo, wo_scale, wo_bias, wo_words, wo_ws, ffn_norm, w13, w13_scale, w13_bias, w13_words,
                 w13_ws, w2, w2_scale, w2_bias, w2_words, w2_ws, g: Geometry, attn_eps: float, ffn_eps: float):
    """One block for ``seq`` new tokens per row: ``h`` ``[batch, seq, dim]`` -> ``(h [batch, seq, dim], k, v)``,
    ``k``/``v`` ``[batch, n_kv_heads, seq, head_dim]`` the new tokens' keys and values (cache layout, for the
    caller to write). ``cos``/``sin`` ``[batch, seq, 1, head_dim]``, the sine signed
    (:func:`~minigpt.model.rope.signed_sine`).

    Each query attends to the cached columns under ``key_valid`` plus, directly, the new keys and values at or
    before its own position."""
    nh, nkv, hd = g.n_heads, g.n_kv_heads, g.head_dim
    new_kv = []  # the attention's new keys and values, the region's other outputs

    def linear(x, *tensors):  # (weight, scale, bias, words, word_scale)
        return decode_linear(Proj(*tensors), x, g.group_size, g.w8a8, g.float_mv, g.float_mm)

    def attention(x):
        batch, seq = x.shape[0], x.shape[1]
        qkv = linear(x, wqkv, wqkv_scale, wqkv_bias, wqkv_words, wqkv_ws)
        qkv = qkv.view(batch, seq, nh + 2 * nkv, hd)
        qk = rope_rotate(qkv[:, :, :nh + nkv], cos, sin)
        q = qk[:, :, :nh]
        k = qk[:, :, nh:].transpose(1, 2)  # [batch, n_kv_heads, seq, head_dim]
        v = qkv[:, :, nh + nkv:].transpose(1, 2)
        new_kv.extend((k, v))
        if seq > DECODE_ROWS_MAX:  # a prompt's rows (the prefill package): one SDPA call, its masked kernel
            out = _prompt_attention(q, k, v, k_cache, v_cache, key_valid, g.scale)
        else:
            out = _step_attention(q, k, v, k_cache, v_cache, key_valid, g.scale)
        return linear(out, wo, wo_scale, wo_bias, wo_words, wo_ws)

    def feed_forward(x):
        hidden = ffn_hidden(g.ffn, linear(x, w13, w13_scale, w13_bias, w13_words, w13_ws))
        return linear(hidden, w2, w2_scale, w2_bias, w2_words, w2_ws)

    h = pre_norm_residual(h, lambda x: rms_norm(x, attn_norm, attn_eps), attention,
                          lambda x: rms_norm(x, ffn_norm, ffn_eps), feed_forward)
    k, v = new_kv
    # Clones: a region's outputs may not alias each other or its inputs (they are a few hundred floats).
    return h, k.clone(), v.clone()


def _step_attention(q, k, v, k_cache, v_cache, key_valid, scale: float) -> torch.Tensor:
    """Attention of a decode step's few new rows (at most ``DECODE_ROWS_MAX``), shapes as in
    :func:`_prompt_attention`: ``q`` ``[batch, seq, n_heads, head_dim]`` -> ``[batch, seq, n_heads * head_dim]``.

    Scores and weighted values as broadcast reductions rather than batched matmuls: the products are tiny
    (``[n_rep * seq, head_dim] x [head_dim, T]`` per KV head), so a BLAS call costs more in overhead than in
    arithmetic, while Inductor fuses them with the mask and the softmax into a couple of loops."""
    batch, seq, nh, hd = q.shape
    nkv = k.shape[1]
    qg = q.reshape(batch, seq, nkv, nh // nkv, hd).permute(0, 2, 3, 1, 4)[..., None, :] * scale
    # The identity view makes Inductor store the rotated, scaled queries once (its as_strided lowering
    # realizes its input). Left to itself it inlines them into the score reduction, redoing RoPE's roll as a
    # scalar gather for every cached key (the int4 layer's attention kernel: 60 us at 135M, T = 192; 22 us now).
    qg = torch.as_strided(qg, qg.shape, qg.stride())
    scores = (qg * k_cache[:, :, None, None, :, :]).sum(-1)  # [batch, n_kv, n_rep, seq, T]
    scores = scores.masked_fill(~key_valid[:, :, :, None, :], float("-inf"))
    # The new keys last, each query seeing those at or before its own position: [..., T + seq].
    new_scores = (qg * k[:, :, None, None, :, :]).sum(-1)  # [batch, n_kv, n_rep, seq, seq]
    if seq > 1:
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        new_scores = new_scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(torch.cat([scores, new_scores], dim=-1), dim=-1)
    t = k_cache.shape[2]
    out = ((probs[..., :t, None] * v_cache[:, :, None, None, :, :]).sum(-2)
           + (probs[..., t:, None] * v[:, :, None, None, :, :]).sum(-2))  # [batch, n_kv, n_rep, seq, head_dim]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, seq, nh * hd)


def _prompt_attention(q, k, v, k_cache, v_cache, key_valid, scale: float) -> torch.Tensor:
    """Attention of many new rows: ``q`` ``[batch, seq, n_heads, head_dim]``, the new ``k``/``v`` ``[batch,
    n_kv_heads, seq, head_dim]`` after the cache's columns (valid under ``key_valid`` ``[batch, 1, 1, T]``), each row
    seeing the new keys up to its own -> ``[batch, seq, n_heads * head_dim]``.

    Why not the step's broadcast reductions: they cost ``rows x (T + rows)`` scalar-ish loops a head, which a
    prompt's hundreds of rows feel (a 245-token prompt through the prefill package of SmolLM-135M's shape, 2-core
    Zen 3: 2x the eager forward's time, docs/benchmarks.md); SDPA's CPU kernel takes the same mask in blocks."""
    batch, seq = q.shape[0], q.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    mask = torch.cat([key_valid.expand(batch, 1, seq, key_valid.shape[-1]), causal.expand(batch, 1, seq, seq)], -1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(batch, seq, -1)


# Under torch.compile a decode layer is one nested compile region: Inductor compiles it once and stamps the code out
# for every layer, so compile time does not grow with depth (a whole 20-layer step took minutes to compile). One
# region rather than two halves around the cache write: a region call costs Python wrapper time, and the cache is
# written outside.
step_layer = torch.compiler.nested_compile_region(decode_layer)
