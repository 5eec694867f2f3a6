"""The :class:`FastPath` wrapper of a :class:`~minigpt.model.transformer.Transformer` (the package docstring of
:mod:`minigpt.infer.fastpath` describes what it does), and the helpers that build one: :func:`prepare` and
:func:`load_for_inference`.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from minigpt.checkpoint.adapter import load_merged
from minigpt.checkpoint.native import load_model
from minigpt.heap import keep_freed_blocks
from minigpt.infer.fastpath import prefill_attention
from minigpt.infer.fastpath.aot import cached_step
from minigpt.infer.fastpath.float_mv import float_mm_wanted, float_mv_wanted
from minigpt.infer.fastpath.kernels import (
    ACT_DTYPE,
    LayerWeights,
    fuse_projections,
    int4_word_scales,
    int8_words,
    module_proj,
)
from minigpt.infer.fastpath.library import (
    aten_woq_layout,
    aten_woq_wanted,
    q4_layout,
    q4_wanted,
    w8a8_kernel,
    w8a8_layouts,
    w8a8_wanted,
)
from minigpt.infer.fastpath.screen import build_screen, resolve
from minigpt.infer.fastpath.step import Geometry, check_compile_mode, compile_step
from minigpt.infer.kv_cache import LayerKVCache
from minigpt.infer.launcher import CACHE_BUCKET
from minigpt.model.attention import causal_mask, padded_causal_mask
from minigpt.model.config import ModelConfig
from minigpt.model.ffn import GATED, ffn_hidden
from minigpt.model.kv_cache import KVCache
from minigpt.model.norm import rms_norm
from minigpt.model.quant import is_quantized, quantize_in_place
from minigpt.model.rope import rope_rotate, signed_sine
from minigpt.model.transformer import Transformer, positions_from_mask, pre_norm_residual


def supports(config: ModelConfig) -> Optional[str]:
    """``None`` when the fast path computes this architecture, else the reason it does not (a short phrase)."""
    if config.pos_encoding != "rope":
        return f"pos_encoding={config.pos_encoding}"
    if config.norm != "rmsnorm" or config.norm_position != "pre":
        return f"norm={config.norm}/{config.norm_position}"
    if config.n_experts:
        return "mixture of experts"
    if config.rope_scaling and config.rope_scaling.get("type") == "dynamic":
        return "dynamic RoPE scaling"
    if config.sliding_window is not None and config.sliding_window < config.max_seq_len:
        return "sliding-window attention"
    if config.qk_norm:
        return "QK-norm"
    if config.logit_softcap is not None:
        return "logit soft-capping"
    return None


class FastPath(nn.Module):
    """Inference wrapper of a :class:`Transformer` with the fast kernels described in the package docstring.

    ``FastPath(model)`` fuses the model's projections in place (its parameters become views; its outputs do not
    change) and puts it in eval mode. Call it like the model: ``forward(tokens [batch, seq_len], start_pos, kv_cache,
    attention_mask, positions=None, last_only=False) -> logits [batch, seq_len or 1, vocab_size]``. For one-token
    steps use :meth:`decode_step`, which runs the compiled graph when ``compile=True``.

    ``compile_mode``: ``None`` (inductor's default) or e.g. ``"max-autotune-no-cudagraphs"``. ``compile_cache``:
    where compiled steps are saved and loaded by later runs (:mod:`minigpt.infer.fastpath.aot`; None: its default
    directory, False: compile in every process). ``aoti``: save and load the compiled steps as AOTInductor
    packages (:mod:`minigpt.infer.fastpath.aoti`; CPU; a longer first compile, then loads in milliseconds and no
    Python wrapper per token), falling back to the saved ``torch.compile`` step when packaging fails.
    ``screen``: greedy steps (:meth:`decode_next`) of a compiled float model read the LM head through an int8
    screen (:mod:`minigpt.infer.fastpath.screen`); None: unless ``$MINIGPT_HEAD_SCREEN`` is ``0``. Raises
    ``ValueError`` for an architecture the fast path does not compute (see :func:`supports`) only when ``strict``
    (otherwise such models run through their own forward), and :class:`~minigpt.errors.MiniGPTError` for a
    ``compile_mode`` torch.compile does not know.
    """

    def __init__(self, model: Transformer, fuse: bool = True, compile: bool = False,
                 compile_mode: Optional[str] = None, strict: bool = False,
                 compile_cache: Optional[Path | bool] = None, woq_kernel: Optional[str] = None,
                 aoti: bool = False, screen: Optional[bool] = None) -> None:
        super().__init__()
        # int8/int4 weights in the compiled step: library.WOQ_KERNELS; $MINIGPT_WOQ_KERNEL, else "auto"
        self.woq_kernel = woq_kernel or os.environ.get("MINIGPT_WOQ_KERNEL") or "auto"
        aten_woq_wanted(self.woq_kernel)  # a bad name fails here, not at the first step
        self.woq_group_size = 0  # int4 group size of the projections given to ATen's kernels (Geometry)
        model.eval()
        self.__dict__["model"] = model  # not a submodule: .to()/.float() on the wrapper must not re-materialise views
        self.config = model.config
        self.reason = supports(model.config)
        if self.reason is not None and strict:
            raise ValueError(f"the fast path does not compute this model ({self.reason})")
        self.fused = fuse and self.reason is None
        # The compiled step reads the fused matrices; without fusion it is not offered.
        self.compiled = compile and self.reason is None and fuse
        self.compile_mode = check_compile_mode(compile_mode)  # a bad name fails here, not at the first compile
        self.compile_seconds = 0.0  # wall time spent compiling (first call of each new shape), seconds
        # The compiled steps per (batch, seq, cache length, grad mode, inference mode, greedy): loaded from or saved
        # to ``compile_cache`` (:mod:`minigpt.infer.fastpath.aot`; None: its default directory, False: never) when
        # ahead-of-time compilation works, else the torch.compile'd function of ``_step_fns``.
        self.compile_cache = compile_cache
        self.aoti = aoti  # turned off after a failed packaging (warned once), so that it is not retried per shape
        self.compile_sources: dict[str, int] = {}  # "loaded" / "saved" / "jit": how many steps came each way
        self._steps: dict[tuple, Callable] = {}
        self._step_fns: dict[bool, Callable] = {}  # by greedy: the torch.compile'd step once the cache is off
        # Greedy steps through an int8 screen of a float head (screen.py): on by default for compiled steps;
        # False or $MINIGPT_HEAD_SCREEN=0 turns it off.
        self.screen, self._screen_pending = None, False  # see head_screen
        self._screen_wanted = os.environ.get("MINIGPT_HEAD_SCREEN", "1") != "0" if screen is None else screen
        # The AOTInductor packages loaded, by file: one serves every cache length of its (batch, seq).
        self.packages: dict = {}
        self._buffers_i64: dict[tuple, torch.Tensor] = {}
        if self.reason is None:
            self._build(fuse)

    # ------------------------------------------------------------------------------------------------ set-up
    def _build(self, fuse: bool) -> None:
        c, m = self.config, self.model
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.n_rep = c.n_heads // c.n_kv_heads
        gated = c.ffn in GATED
        self.layers: list[LayerWeights] = []
        for block in m.layers:
            a, f = block.attention, block.feed_forward
            if fuse:
                wqkv = fuse_projections([a.wq, a.wk, a.wv])
                w13 = fuse_projections([f.w1, f.w3]) if gated else module_proj(f.w1)
            else:
                # Unfused: concatenated copies would double the memory, so the three projections stay apart.
                wqkv = [module_proj(a.wq), module_proj(a.wk), module_proj(a.wv)]
                w13 = [module_proj(f.w1), module_proj(f.w3)] if gated else module_proj(f.w1)
            self.layers.append(LayerWeights(
                block.attention_norm.weight.detach(), block.ffn_norm.weight.detach(), wqkv, module_proj(a.wo),
                w13, module_proj(f.w2), block.attention_norm.eps, block.ffn_norm.eps))
        self.embedding = m.tok_embeddings.weight.detach()
        self.final_norm = m.norm.weight.detach()
        self.final_eps = m.norm.eps
        self.head = module_proj(m.output)
        projections = [self.head] + [q for lw in self.layers for q in (lw.wqkv, lw.wo, lw.w13, lw.w2)]
        # The compiled step takes each projection as one tensor set: unfused layers of mixed kinds run eagerly.
        self.compiled = self.compiled and not any(isinstance(p, list) for p in projections)
        # int8 and int4 weights: ATen's weight-only kernels where wanted and they take the shape (in the compiled
        # step and in eager decode steps alike), else, compiled, read as float32 words (same memory)
        aten, w8a8 = aten_woq_wanted(self.woq_kernel), w8a8_wanted(self.woq_kernel)
        flat = [q for p in projections for q in (p if isinstance(p, list) else [p])]
        self._screen_pending = self.compiled and self._screen_wanted
        # The step passes ATen's int4 kernel one group size (a constant): with several, int4 stays on the loops.
        groups = {q.group_size for q in flat} - {0}
        packed = {id(q) for q, ok in zip(flat, w8a8_layouts(flat)) if ok} if w8a8 else set()  # int8 ones
        # int4: MiniGPT's int4 x int8 kernel where it runs vectorised (asked only when there is int4: the first
        # ask builds the runner library)
        q4 = bool(groups) and q4_wanted(self.woq_kernel)
        for q in flat:
            if id(q) in packed or (q4 and q.group_size and q4_layout(q)):
                continue
            if aten and (q.group_size == 0 or len(groups) == 1) and aten_woq_layout(q):
                continue
            if self.compiled:
                q.words = int8_words(q.weight)
                q.word_scale = int4_word_scales(q)
        aten_int4 = any(q.aten_layout and q.group_size for q in flat)
        self.woq_group_size = groups.pop() if aten_int4 else 0
        int8_layers = [q for q in flat[1:] if q.scale is not None and q.scale.dim() == 1]  # flat[0]: the head
        layers_w8a8 = bool(int8_layers) and all(id(q) in packed for q in int8_layers)
        # RoPE tables in the activation dtype, the sine in the signed form rope_rotate takes (signed once, here).
        self.cos = m.rope_cos.to(ACT_DTYPE)
        self.sin_signed = signed_sine(m.rope_sin).to(ACT_DTYPE)
        self.scale = 1.0 / math.sqrt(c.head_dim)
        # A bf16 AOTInductor step on a CPU: its float products through MiniGPT's C++ kernel, and a prompt's fp32 or
        # bf16 ones (float_mv says why, and why not float32 decode or torch.compile's steps)
        package = self.compiled and self.aoti and self.device.type == "cpu"
        self.geometry = Geometry(c.n_heads, c.n_kv_heads, c.head_dim, self.scale, c.ffn, self.woq_group_size,
                                 layers_w8a8, self.head.w8a8 is not None, package and float_mv_wanted(flat),
                                 package and float_mm_wanted(flat))

    @property
    def device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.tok_embeddings.weight.dtype

    def weight_bytes(self) -> int:
        """Bytes read per decode step for the weights: every projection, the norms and the LM head (the embedding
        row lookup is negligible). The numerator of achieved GB/s = ``weight_bytes * tokens/s``."""
        if self.reason is not None:
            return sum(p.numel() * p.element_size() for p in self.model.parameters())
        n = self.head.nbytes + self.final_norm.numel() * self.final_norm.element_size()
        for lw in self.layers:
            for p in (lw.wqkv, lw.wo, lw.w13, lw.w2):
                n += sum(q.nbytes for q in p) if isinstance(p, list) else p.nbytes
            n += 2 * lw.attn_norm.numel() * lw.attn_norm.element_size()
        return n

    @property
    def any_cache_length(self) -> bool:
        """Whether the compiled step is (or will be) an AOTInductor package, which serves every cache length: a
        cache may start short and grow (:func:`~minigpt.infer.generate.grown_cache_for`)."""
        return self.compiled and self.aoti and self.compile_cache is not False and self.device.type == "cpu" \
            and not self._step_fns

    def new_kv_cache(self, batch_size: int, max_seq_len: Optional[int] = None,
                     dtype: Optional[torch.dtype] = None) -> KVCache:
        """A zeroed cache; with ``compile`` its length is rounded up to :data:`CACHE_BUCKET` (capped at the model's
        context) so that nearby lengths share a compiled graph."""
        length = max_seq_len or self.config.max_seq_len
        if length > self.config.max_seq_len:
            raise ValueError(f"cache length {length} exceeds the model's max_seq_len {self.config.max_seq_len}")
        if self.reason is not None:
            return self.model.new_kv_cache(batch_size, length, dtype or self.act_dtype)
        if self.compiled:
            length = min(self.config.max_seq_len, -(-length // CACHE_BUCKET) * CACHE_BUCKET)
        c = self.config
        self._ensure_rope(length)
        return LayerKVCache(c.n_layers, batch_size, c.n_kv_heads, length, c.head_dim, dtype or self.act_dtype,
                            self.device)

    def _ensure_rope(self, end: int) -> None:
        """Grow the RoPE tables to ``end`` positions when the model's lazily sized tables
        (:meth:`Transformer.ensure_positions`) stop short; a compiled step captured the old tables, so it is
        compiled again."""
        if end <= self.cos.shape[0]:
            return
        self.model.ensure_positions(end)
        self.cos = self.model.rope_cos.to(ACT_DTYPE)
        self.sin_signed = signed_sine(self.model.rope_sin).to(ACT_DTYPE)
        self._step_fns, self._steps, self.packages = {}, {}, {}

    @property
    def act_dtype(self) -> torch.dtype:
        """The dtype of the activations and of the KV cache: float32 (:data:`ACT_DTYPE`) on the fast path, the
        weights' own dtype for models it hands back to their ``forward``."""
        return ACT_DTYPE if self.reason is None else self.dtype

    # ------------------------------------------------------------------------------------------------ forward
    @staticmethod
    def _project(p, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([q(x) for q in p], dim=-1) if isinstance(p, list) else p(x)

    def forward(self, tokens: torch.Tensor, start_pos: int = 0, kv_cache: Optional[KVCache] = None,
                attention_mask: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                last_only: bool = False) -> torch.Tensor:
        """Logits ``[batch, seq_len, vocab]`` (``[batch, 1, vocab]`` with ``last_only``) of ``tokens`` at
        ``start_pos``; same contract as :meth:`Transformer.forward`. ``positions`` ``[batch, seq_len]`` (int64):
        the RoPE positions when the caller already knows them (they are ``cumsum(attention_mask) - 1`` otherwise).
        Raises ``ValueError`` when the sequence passes ``max_seq_len`` or the cache."""
        if self.reason is not None:
            logits = self.model(tokens, start_pos, kv_cache, attention_mask)
            return logits[:, -1:] if last_only else logits
        batch, seq_len = tokens.shape
        end = start_pos + seq_len
        if end > self.config.max_seq_len:
            raise ValueError(f"sequence of {end} positions exceeds the model's max_seq_len {self.config.max_seq_len}")
        self._ensure_rope(end)
        if attention_mask is not None and tuple(attention_mask.shape) != (batch, end):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(batch, end)} "
                             "(batch, cached + new tokens)")
        if positions is None and attention_mask is not None:
            positions = positions_from_mask(attention_mask, start_pos, seq_len)
        if positions is None:
            cos = self.cos[start_pos:end, None, :]  # [seq_len, 1, head_dim]: broadcast over batch and heads
            sin = self.sin_signed[start_pos:end, None, :]
        else:
            cos = self.cos[positions][:, :, None, :]  # [batch, seq_len, 1, head_dim]
            sin = self.sin_signed[positions][:, :, None, :]

        # Attention masks: none for a plain causal prefill (SDPA's causal kernel) or an unpadded single-token step.
        mask, key_valid = None, None
        if attention_mask is not None:
            if seq_len == 1:
                key_valid = attention_mask.bool()[:, None, None, :]  # [batch, 1, 1, end]
            else:
                mask = padded_causal_mask(attention_mask, seq_len)
        elif seq_len > 1 and start_pos > 0:
            mask = causal_mask(seq_len, end, tokens.device)

        h = F.embedding(tokens, self.embedding).to(ACT_DTYPE)
        last_layer = len(self.layers) - 1
        for i, lw in enumerate(self.layers):
            h = self._block(i, lw, h, cos, sin, start_pos, kv_cache, mask, key_valid,
                            last_only=last_only and i == last_layer, plain_causal=attention_mask is None)
        return self.head(rms_norm(h, self.final_norm, self.final_eps))

    def _block(self, i, lw: LayerWeights, h, cos, sin, start_pos, kv_cache, mask, key_valid,
               last_only: bool = False, plain_causal: bool = False):
        """One block over ``h`` ``[batch, seq_len, dim]``: the model's pre-norm residual block over the fused
        weights. With ``last_only`` it still writes every position's key and value to the cache but returns the
        last position alone, ``[batch, 1, dim]``. ``plain_causal``: no padding (``mask`` is None or the causal mask
        of the new positions over the cache)."""
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim

        def attention(x):
            batch, seq_len, _ = x.shape
            qkv = self._project(lw.wqkv, x).view(batch, seq_len, nh + 2 * nkv, hd)
            qk = rope_rotate(qkv[:, :, :nh + nkv], cos, sin)
            q, k, v = qk[:, :, :nh], qk[:, :, nh:], qkv[:, :, nh + nkv:]
            if kv_cache is not None:
                keys, values = kv_cache.update(i, start_pos, k.transpose(1, 2), v.transpose(1, 2))
            else:
                if start_pos:
                    raise ValueError("start_pos > 0 needs a kv_cache holding the earlier positions")
                keys, values = k.transpose(1, 2), v.transpose(1, 2)
            if last_only and seq_len > 1:
                # The last query sees every key, so the causal mask reduces to its last row (all True without
                # padding).
                q, seq_len = q[:, -1:], 1
                out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values,
                                                     attn_mask=None if mask is None else mask[..., -1:, :],
                                                     enable_gqa=self.n_rep > 1).transpose(1, 2)
            elif seq_len == 1:
                out = self._attend_one(q, keys, values, key_valid)
            elif plain_causal and (kernel := prefill_attention.choice(q, seq_len, nkv)) is not None:
                out = kernel(q, keys, values, self.scale, start_pos)  # oneDNN's GEMMs or MiniGPT's AVX2 kernel
            else:
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=mask is None and start_pos == 0,
                    enable_gqa=self.n_rep > 1).transpose(1, 2)
            return lw.wo(out.reshape(batch, seq_len, nh * hd))

        def feed_forward(x):
            return lw.w2(ffn_hidden(self.config.ffn, self._project(lw.w13, x)))

        return pre_norm_residual(h, lambda x: rms_norm(x, lw.attn_norm, lw.attn_norm_eps), attention,
                                 lambda x: rms_norm(x, lw.ffn_norm, lw.ffn_norm_eps), feed_forward, last_only)

    def _attend_one(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    key_valid: Optional[torch.Tensor]) -> torch.Tensor:
        """Attention of one query per row: ``q`` ``[batch, 1, n_heads, head_dim]``, ``keys``/``values``
        ``[batch, n_kv_heads, kv_len, head_dim]``, ``key_valid`` bool broadcastable to ``[batch, n_kv_heads, n_rep,
        kv_len]`` or None. Returns ``[batch, 1, n_heads, head_dim]``.

        The query group of each KV head is one ``[n_rep, head_dim] x [head_dim, kv_len]`` product (the GQA layout of
        gpt-fast/llama.cpp), softmax in float32 as SDPA's math path."""
        batch = q.shape[0]
        qg = q.reshape(batch, self.n_kv_heads, self.n_rep, self.head_dim) * self.scale
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float()
        if key_valid is not None:
            scores = scores.masked_fill(~key_valid, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).view(batch, 1, self.n_heads, self.head_dim)

    # ------------------------------------------------------------------------------------------- decode step
    def decode_step(self, token: torch.Tensor, pos: int, kv_cache: KVCache,
                    attention_mask: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                    pad: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[batch, vocab]`` of one new token per row (``token`` ``[batch, 1]``) written at cache column
        ``pos``.

        Eager: ``attention_mask`` ``[batch, pos + 1]`` and ``positions`` ``[batch, 1]`` as in :meth:`forward`.
        Compiled: the padding is described by ``pad`` ``[batch]`` (int64, the number of left-padding columns of each
        row; None = no padding), RoPE position ``pos - pad``, and the graph is shared by every ``pos``.
        """
        if not self.compiled:
            return self(token, pos, kv_cache, attention_mask, positions)[:, -1]
        return self.decode_tokens(token, pos, kv_cache, pad)[:, -1]

    def decode_tokens(self, tokens: torch.Tensor, pos: int, kv_cache: KVCache,
                      pad: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` of ``seq`` new tokens per row (``tokens`` ``[batch, seq]``) written at cache
        columns ``pos .. pos + seq - 1``: a few tokens at once, such as the k + 1 of a speculative verify, through
        the compiled step when ``compile`` (one graph per ``[batch, seq, cache length]``; while ``batch * seq <=``
        :data:`DECODE_ROWS_MAX` the weights are still read once), else through :meth:`forward`. ``pad`` as in
        :meth:`decode_step`. Raises ``ValueError`` when the tokens do not fit in the cache or (compiled) the cache
        is not one of :meth:`new_kv_cache` with this batch size."""
        batch, seq = tokens.shape
        kv_cache.check_fits(pos + seq)
        if not self.compiled:
            return self(tokens, pos, kv_cache)
        return self._run_step(tokens, pos, kv_cache, pad, greedy=False)[0]

    def decode_next(self, token: torch.Tensor, pos: int, kv_cache: KVCache,
                    pad: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The greedy next token ``[batch]`` (int64) after one new token per row (``token`` ``[batch, 1]``) written at
        cache column ``pos``: the argmax of :meth:`decode_step`'s logits, computed through the head's int8 screen
        when the step is compiled and the head is float (:mod:`~minigpt.infer.fastpath.screen`: the same token
        but for float32 ties, a fifth fewer bytes read per token at fp32). ``pad`` as in :meth:`decode_step`."""
        if self.head_screen() is None:
            return self.decode_step(token, pos, kv_cache, pad=pad).argmax(-1)
        kv_cache.check_fits(pos + 1)
        nxt, h = self._run_step(token, pos, kv_cache, pad, greedy=True)
        return resolve(nxt, h, self.head.weight)[:, -1]

    def head_screen(self):
        """The LM head's int8 screen (:class:`~minigpt.infer.fastpath.screen.HeadScreen`) for greedy steps, built
        at the first call (by :meth:`decode_next`: only greedy decoding pays for it; 135M fp32: ~0.07 s), or
        None: not compiled, turned off, a head that is not float."""
        if self._screen_pending:
            t0 = time.perf_counter()  # set-up, counted as compiling: a machine's first builds its kernel (~16 s)
            self._screen_pending, self.screen = False, build_screen(self.head)
            self.compile_seconds += time.perf_counter() - t0
        return self.screen

    def _run_step(self, tokens: torch.Tensor, pos: int, kv_cache: KVCache, pad: Optional[torch.Tensor],
                  greedy: bool) -> tuple:
        """The compiled step (``greedy``: the screened greedy one) over ``tokens`` at column ``pos``, its new keys
        and values written into ``kv_cache``: returns the step's other outputs (``(logits,)`` or ``(next, h)``)."""
        batch, seq = tokens.shape
        # A compiled step is specialised to its inputs' strides and a saved one runs unguarded (aot._bound): a
        # column view of a longer token matrix once made a loaded step read the wrong tokens.
        tokens = tokens.contiguous()
        pad = self._buffer(("pad", batch), batch) if pad is None else pad.contiguous()
        shape = (batch, seq, kv_cache.max_seq_len)
        key = shape + (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), greedy)
        first = key not in self._steps
        t0 = time.perf_counter()
        input_pos = self._buffer(("pos",), 1).fill_(pos)  # reused: no allocation per step
        if not isinstance(kv_cache, LayerKVCache) or kv_cache.batch_size != batch:
            raise ValueError("the compiled decode step needs a cache from FastPath.new_kv_cache of the same batch size")
        args = (tokens, input_pos, pad, kv_cache.k, kv_cache.v)
        step = self._steps.get(key)
        if step is None:  # a saved ahead-of-time step per shape, else one torch.compile'd function for all
            if self.geometry.w8a8 or self.geometry.head_w8a8:
                w8a8_kernel()  # before the step's first call: the op's CPU kernel is chosen once per process
            if greedy in self._step_fns:  # the cache is off or ahead-of-time compiling failed: not tried again
                step, source = self._step_fns[greedy], "jit"
            elif self._step_fns:  # ... nor for the other step (greedy or logits)
                step, source = compile_step(self, self.compile_mode, greedy=greedy), "jit"
                self._step_fns[greedy] = step
            else:
                step, source = cached_step(self, args, self.compile_cache, aoti=self.aoti, greedy=greedy)
                self.aoti = self.aoti and source.startswith("aoti")
                if source == "jit":
                    self._step_fns[greedy] = step
            self._steps[key] = step
            self.compile_sources[source] = self.compile_sources.get(source, 0) + 1
        first_out, new_k, new_v, *rest = step(*args)
        if not getattr(step, "writes_cache", False):  # a package writes the new columns itself (aoti.StepModule)
            for cache_k, cache_v, k, v in zip(kv_cache.k, kv_cache.v, new_k, new_v):
                cache_k[:, :, pos:pos + seq].copy_(k)
                cache_v[:, :, pos:pos + seq].copy_(v)
        if first:
            self.compile_seconds += time.perf_counter() - t0
        return (first_out, *rest)

    @property
    def _compiled_shapes(self) -> set[tuple[int, int, int]]:
        """The (batch, seq, cache length) shapes compiled so far (derived from the steps' keys)."""
        return {key[:3] for key in self._steps}

    def _buffer(self, key: tuple, size: int) -> torch.Tensor:
        """A persistent zeroed int64 tensor of ``size`` elements per ``key`` (step inputs reused across steps)."""
        if key not in self._buffers_i64:
            # A normal tensor even when first made under inference_mode (generate runs there): an inference
            # tensor could not be refilled by a later step outside it.
            with torch.inference_mode(False):
                self._buffers_i64[key] = torch.zeros(size, dtype=torch.long, device=self.device)
        return self._buffers_i64[key]


def prepare(model: Transformer, dtype: Optional[torch.dtype] = None, quantize: Optional[str] = None,
            fuse: bool = True, compile: bool = False, compile_mode: Optional[str] = None,
            woq_kernel: Optional[str] = None, aoti: bool = False) -> FastPath:
    """Convert ``model`` in place for inference and wrap it: cast to ``dtype`` (bf16 weights are an option; the
    norms' statistics and the softmax stay float32), quantize (``"int8"``: weight-only per-channel; ``"int4"``:
    weight-only in groups of 32, llama.cpp's ``Q4_0``; see :mod:`minigpt.model.quant`; skipped when the model is
    already quantized), fuse, and optionally compile the decode step (``woq_kernel``: which kernels it uses for
    int8/int4 weights, :data:`~minigpt.infer.fastpath.library.WOQ_KERNELS`; ``aoti``: as AOTInductor packages,
    :class:`FastPath`). Raises ``ValueError`` for an unknown
    ``quantize`` or ``woq_kernel``."""
    if dtype is not None and not is_quantized(model):
        model.to(dtype=dtype)
    quantize_in_place(model, quantize)
    return FastPath(model, fuse=fuse, compile=compile, compile_mode=compile_mode, woq_kernel=woq_kernel, aoti=aoti)


def load_for_inference(source, device: torch.device | str = "cpu", dtype: Optional[torch.dtype] = None,
                       quantize: Optional[str] = None, compile: bool = False, compile_mode: Optional[str] = None,
                       fast: bool = True, adapter=None, aoti: bool = False):
    """Load any model source (:func:`minigpt.checkpoint.native.load_model`) ready to generate: a :class:`FastPath`
    (``fast``) or the plain :class:`Transformer` (``fast=False``; ``compile`` then does not apply, ``quantize``
    still does). ``adapter``: a PEFT LoRA folder merged into the weights first
    (:func:`minigpt.checkpoint.adapter.load_merged`). ``aoti``: compiled steps as AOTInductor packages
    (:class:`FastPath`). Also keeps the C heap's freed blocks for reuse (:func:`minigpt.heap.keep_freed_blocks`: a
    prefill 1.5x faster where glibc would map fresh pages for every large activation). Raises
    :class:`~minigpt.errors.MiniGPTError` for unreadable sources or an adapter made for another base."""
    keep_freed_blocks()
    if adapter is None and quantize not in (None, "none"):
        # Quantized tensor by tensor as it is read: the float model is never built in full.
        model = load_model(source, device=device, dtype=dtype, quantize=quantize)
    else:
        model = load_merged(source, adapter, device=device, dtype=dtype)
    if not fast:
        return quantize_in_place(model, quantize)
    return prepare(model, quantize=quantize, compile=compile, compile_mode=compile_mode, aoti=aoti)
