"""The inference fast path: fused projections, a lean functional forward, a GQA-aware single-token attention, and
an optional ``torch.compile``\\ d decode step over a static KV cache.

:class:`FastPath` wraps a :class:`~minigpt.model.transformer.Transformer` (fp32, bf16 or int8 weight-only) and computes
the same function as its ``forward`` -- to float rounding: fp32 logits agree within ``1e-5`` (tested) -- with fewer
kernels per token:

* **Fused projections** (as in vLLM and gpt-fast). ``wq``/``wk``/``wv`` become one ``[(n_heads + 2 n_kv_heads)
  head_dim, dim]`` matrix and the gate/up pair ``w1``/``w3`` one ``[2 hidden_dim, dim]`` matrix. The fusion happens
  once, here, and the model's own parameters are re-pointed to *row slices* of the fused matrix (a row slice of a
  contiguous matrix is itself contiguous), so no weight is stored twice and ``state_dict()`` keeps the checkpoint and
  Hugging Face key layout unchanged. One GEMM instead of three saves two kernel launches per layer, which is most of
  the cost of a decode step on small models, and feeds the BLAS wider matrices. (Training gains nothing consistent
  from it on this CPU -- 0.89-1.03x a step in `scripts/train_fusion_ab.py` runs, GEMM-bound -- so the training path
  is left unfused.)
* **One RoPE for q and k**: both are rotated in a single pass over the fused projection output, with
  ``rotate_half(x) == roll(x, head_dim / 2) * [-1 .. -1, 1 .. 1]`` folded into a signed sine table (exact: a sign flip
  and a permutation do not round).
* **GQA decode** (q_len 1): the ``n_heads`` queries are viewed as ``[batch, n_kv_heads, n_rep, head_dim]``, so the
  scores of a whole query group against its KV head are one product and the keys are never repeated
  (``repeat_interleave`` would copy the cache ``n_rep`` times per step).
* **Last position only** in prefill (``last_only``): generation needs the logits of one position, so the LM head
  gets one row, and so does most of the last layer: it still projects every position's key and value (the cache
  needs them), but its attention, output projection and FFN run for the last query alone. Exact, not an
  approximation: no other position's output of the last layer reaches those logits.
* **float32 activations** whatever the weight dtype (:data:`ACT_DTYPE`): bf16 and int8 are storage formats of the
  weights, converted as they are read; the KV cache and the residual stream stay float32.
* **Compiled decode step** (``compile=True``), the one that is fast on a CPU:

  - static shapes: the cache (:class:`LayerKVCache`, one tensor per layer) has a fixed length rounded up to
    :data:`CACHE_BUCKET`; the write position and the per-row left padding are tensors; each query attends to every
    column under a mask. One graph serves every step of every generation of a given batch size and cache length.
  - matrix-vector products written as reductions (:func:`decode_linear`), which Inductor turns into its own
    vectorised loops: ~2x the bandwidth of MKL's ``gemv`` on one core, bf16 converted in the loop, int8 read as
    float32 words and unpacked with shifts (:func:`int8_words`); attention likewise, fused with the mask and the
    softmax.
  - each layer is one ``torch.compiler.nested_compile_region`` (:func:`_step_layer`), compiled once and reused by
    every layer, and the per-layer caches are separate graph inputs, so compile time does not grow with depth
    (`small`: ~10 s cold, against ~85 s for the unrolled graph). The graph only reads the cache: it returns each
    layer's new key and value and :meth:`FastPath.decode_step` writes them (an in-graph write next to these
    regions corrupted the cache of multi-layer models under torch 2.13).
  - per-call overhead trimmed: Dynamo's guards on the weights are dropped (:func:`_guards_on_inputs_only`: a
    FastPath never rebinds them, and checking ~100 tensors per call cost ~0.3 ms), and so are Inductor's
    per-tensor size asserts; one region per layer rather than two halves the wrapper's Python work. Each FastPath
    compiles its own copy of the step's code object.
  - a few tokens per row at once (:meth:`FastPath.decode_tokens`, e.g. the k + 1 tokens a speculative verify
    scores): the same step with ``seq`` new tokens, each attending to the cache and, causally, to the new ones; up
    to :data:`DECODE_ROWS_MAX` rows in all the weights are still read once (a 5-token `small` step: 7.1 ms against
    3.8 ms for one token, where the eager forward takes 14.8 ms).

  Compile time is measured (:attr:`FastPath.compile_seconds`, the first call of each new shape).

Architectures outside the fast path (non-RoPE positions, LayerNorm, post-norm, mixture of experts, dynamic NTK
RoPE) are run through the model's own ``forward``: :func:`supports` says which.
"""
from __future__ import annotations

import math
import sys
import time
import types
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minigpt.model.attention import causal_mask, padded_causal_mask
from minigpt.model.config import ModelConfig
from minigpt.model.kv_cache import KVCache
from minigpt.model.quant import Int8Linear, int8_linear, is_quantized, quantize_model
from minigpt.model.transformer import Transformer, positions_from_mask

# Activations, the residual stream and the KV cache of the fast path are float32 whatever the weight dtype: bf16
# (or int8) is a storage format for the weights, converted on the fly. Half-precision arithmetic has no hardware
# support on most CPUs, and the weights, not the activations, are what a decode step reads.
ACT_DTYPE = torch.float32

# Cache lengths of the compiled step are rounded up to a multiple of this, so that generations of nearby lengths
# share one compiled graph (each new [batch, cache length] pair costs a compilation).
CACHE_BUCKET = 64


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
    return None


class Proj:
    """One (possibly fused) linear projection ``y = x W^T (* scale) + b``.

    ``weight`` ``[out, in]`` float (fp32/bf16) or int8; ``scale`` ``[out]`` (int8 only: per-output-channel
    symmetric scales, :mod:`minigpt.model.quant`); ``bias`` ``[out]`` or None.
    """

    __slots__ = ("weight", "scale", "bias", "words")

    def __init__(self, weight: Optional[torch.Tensor], scale: Optional[torch.Tensor] = None,
                 bias: Optional[torch.Tensor] = None, words: Optional[torch.Tensor] = None) -> None:
        self.weight, self.scale, self.bias = weight, scale, bias
        self.words = words  # int8 only: the weight as float32 words (int8_words), read by the compiled step

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` in the activation dtype (float32) -> ``[..., out]`` in the same dtype.

        bf16/fp16 weights: a few rows (decode) go through the BLAS's half-precision matrix-vector product on
        activations rounded to the weight dtype; many rows (prefill) through an fp32 GEMM on the weights upcast
        once per call, because CPUs without native bf16 run half-precision GEMMs ~100x slower than fp32 ones."""
        w = self.weight
        if self.scale is not None:
            return int8_linear(x, w, self.scale, self.bias)
        if w.dtype == x.dtype:
            return F.linear(x, w, self.bias)
        if x.numel() // x.shape[-1] <= DECODE_ROWS_MAX:
            bias = None if self.bias is None else self.bias.to(w.dtype)
            return F.linear(x.to(w.dtype), w, bias).to(x.dtype)
        return F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    @property
    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        for t in (self.scale, self.bias):
            if t is not None:
                n += t.numel() * t.element_size()
        return n


@dataclass
class LayerWeights:
    """The tensors of one block, fused where the architecture allows. ``w13`` is the fused gate/up projection of a
    gated FFN (``gate`` then ``up`` rows); plain MLPs keep ``w1`` alone (``w13`` is then just ``w1``)."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    wqkv: Proj
    wo: Proj
    w13: Proj
    w2: Proj
    attn_norm_eps: float
    ffn_norm_eps: float


def _module_proj(linear: nn.Module) -> Proj:
    if isinstance(linear, Int8Linear):
        return Proj(linear.weight, linear.weight_scale, linear.bias)
    return Proj(linear.weight.detach(), None, None if linear.bias is None else linear.bias.detach())


def _fuse(linears: list[nn.Module]) -> Proj:
    """Concatenate ``linears`` (all float ``nn.Linear`` or all ``Int8Linear``) along the output dimension and make
    each module's tensors row views of the fused ones: no copy survives, the modules keep working unchanged."""
    def concat_and_repoint(get, set_) -> Optional[torch.Tensor]:
        parts = [get(m) for m in linears]
        if parts[0] is None:
            return None
        fused = torch.cat([p.detach() for p in parts])
        start = 0
        for m, p in zip(linears, parts):
            set_(m, fused[start:start + p.shape[0]])
            start += p.shape[0]
        return fused

    if all(isinstance(m, Int8Linear) for m in linears):
        w = concat_and_repoint(lambda m: m.weight, lambda m, v: setattr(m, "weight", v))
        s = concat_and_repoint(lambda m: m.weight_scale, lambda m, v: setattr(m, "weight_scale", v))
        b = concat_and_repoint(lambda m: m.bias, lambda m, v: setattr(m, "bias", v))
        return Proj(w, s, b)

    def set_param(name):
        def set_(m, v):
            setattr(m, name, nn.Parameter(v, requires_grad=False))
        return set_

    w = concat_and_repoint(lambda m: m.weight, set_param("weight"))
    b = concat_and_repoint(lambda m: m.bias, set_param("bias"))
    return Proj(w, None, b)


# Up to this many rows the compiled step writes its matrix-vector products as per-row reductions (see
# decode_linear); larger batches use the BLAS GEMM.
DECODE_ROWS_MAX = 8


def int8_words(q: torch.Tensor) -> Optional[torch.Tensor]:
    """The compiled step's view of an int8 matrix ``q`` ``[out, in]``: the same bytes as float32 words
    ``[out, in / 4]``, byte ``j`` of word ``m`` of a row being ``q[row, 4 m + j]`` (little-endian). Shares ``q``'s
    memory. None for a non-contiguous ``q``, ``in`` not a multiple of 4 or a big-endian host.

    Why: Inductor's vectorised loops load int8 through a scalar copy per element, but float32 with plain vector
    loads; from a float32-typed word a bit cast and two shifts per byte give the signed values. Measured in the
    whole decode step (in-process A/B against converting int8 in the loop from a k-major copy): 1.6x (`small`) and
    2.1x (`medium`) faster at batch 1. (bf16 read the same way, two halves per word, was 3-8 % slower than
    Inductor's own vectorised bf16 conversion, so bf16 weights are read as they are.)
    """
    if q.dtype != torch.int8 or q.dim() != 2 or q.shape[1] % 4 or q.storage_offset() % 4:
        return None
    if sys.byteorder != "little" or not q.is_contiguous():
        return None
    # Not q.view(torch.float32): the compiled step would trace that view back to its int8 base and read int8 again.
    # A tensor set on the same storage shares the bytes without being a view.
    words = torch.empty(0, dtype=torch.float32, device=q.device)
    return words.set_(q.untyped_storage(), q.storage_offset() // 4, (q.shape[0], q.shape[1] // 4))


def _int8_words_linear(x32: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """``x32`` ``[batch, in]`` float32 times the int8 matrix whose words are ``words`` ``[out, in / 4]``
    (:func:`int8_words`): ``[batch, out]`` float32, the products of ``x q^T`` (unscaled) summed byte lane by lane."""
    batch, n_words = x32.shape[0], words.shape[1]
    bits = words.view(torch.int32)
    lanes = [((bits << (24 - 8 * j)) >> 24).float() for j in range(4)]  # byte j, sign-extended: [out, in / 4]
    if batch > DECODE_ROWS_MAX:  # many rows: one GEMM on the unpacked matrix [out, in]
        return x32 @ torch.stack(lanes, dim=-1).view(words.shape[0], -1).T
    xs = x32.view(batch, n_words, 4)
    # Each lane's slice of x, materialised (see decode_linear) so that the loop reads it contiguously.
    parts = [torch.as_strided(xs[:, :, j].contiguous(), (batch, n_words), (n_words, 1)) for j in range(4)]
    rows = [(parts[0][b][None, :] * lanes[0] + parts[1][b][None, :] * lanes[1] + parts[2][b][None, :] * lanes[2]
             + parts[3][b][None, :] * lanes[3]).sum(-1) for b in range(batch)]
    return rows[0][None] if batch == 1 else torch.stack(rows)


def decode_linear(p, x: torch.Tensor) -> torch.Tensor:
    """``p(x)`` for the traced decode step, ``x`` ``[batch, seq, in]`` -> ``[batch, seq, out]`` (``seq`` new tokens
    per row: 1 when decoding, k + 1 when verifying speculative proposals).

    Written as ``sum(x * W, -1)`` per row instead of a matmul, so that Inductor generates the matrix-vector
    product itself: one fused, vectorised C++ loop that reads each weight once (converting bf16 or int8 on the fly)
    and needs no BLAS call. A BLAS ``gemv`` through ``mm`` reads fp32 at ~9 GB/s on one core here, the generated
    loop at ~17 GB/s, and bf16 weights halve the bytes. Up to :data:`DECODE_ROWS_MAX` rows (``batch * seq``) the
    per-row reductions share one loop over the weights (Inductor fuses reductions of the same shape), so a batch
    of 8 still reads each weight once. The accumulation is float32 whatever the weight dtype.
    """
    if isinstance(p, list):
        return torch.cat([decode_linear(q, x) for q in p], dim=-1)
    batch, seq = x.shape[0], x.shape[1]
    rows = batch * seq  # every (row, position) is one vector of the product
    if rows > DECODE_ROWS_MAX and p.words is None:
        return p(x)
    x32 = x.reshape(rows, -1).float()
    # An identity as_strided makes Inductor materialise x first (its lowering realizes the input); otherwise it
    # inlines x's producer into the reduction and recomputes it for every output row (e.g. SiLU * up before w2).
    x32 = torch.as_strided(x32, x32.shape, x32.stride())
    if p.words is not None:
        y = _int8_words_linear(x32, p.words)
    else:
        w = p.weight.float() if p.weight.dtype != torch.float32 else p.weight
        ys = [(x32[r][None, :] * w).sum(-1) for r in range(rows)]
        y = ys[0][None] if rows == 1 else torch.stack(ys)
    if p.scale is not None:
        y = y * p.scale
    if p.bias is not None:
        y = y + p.bias.float()
    return y.to(x.dtype).view(batch, seq, -1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`minigpt.model.norm.RMSNorm`'s formula (statistics in float32, result cast back, then the gain)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LayerKVCache(KVCache):
    """A :class:`KVCache` whose layers are separate tensors: ``k[i]``/``v[i]`` ``[batch, n_kv_heads, max_seq_len,
    head_dim]``.

    Same memory and interface as the stacked cache; the difference matters to the compiled step: each layer's cache
    is its own graph input with no offset into a shared buffer, so the cache-write kernel of every layer is the
    same code and is compiled once (with one stacked buffer each layer's write bakes in its own offset: one C++
    compilation per layer, most of a cold compile).
    """

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        nn.Module.__init__(self)
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def update(self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`KVCache.update`: write ``k``/``v`` ``[batch, n_kv_heads, seq_len, head_dim]`` at
        ``start_pos`` and return views of positions ``0 .. start_pos + seq_len``."""
        end = start_pos + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(
                f"KV cache overflow: positions up to {end} requested but the cache holds {self.max_seq_len}"
            )
        batch = k.shape[0]
        self.k[layer][:batch, :, start_pos:end] = k
        self.v[layer][:batch, :, start_pos:end] = v
        return self.k[layer][:batch, :, :end], self.v[layer][:batch, :, :end]


class FastPath(nn.Module):
    """Inference wrapper of a :class:`Transformer` with the fast kernels described in the module docstring.

    ``FastPath(model)`` fuses the model's projections in place (its parameters become views; its outputs do not
    change) and puts it in eval mode. Call it like the model: ``forward(tokens [batch, seq_len], start_pos, kv_cache,
    attention_mask, positions=None, last_only=False) -> logits [batch, seq_len or 1, vocab_size]``. For one-token
    steps use :meth:`decode_step`, which runs the compiled graph when ``compile=True``.

    ``compile_mode``: ``None`` (inductor's default) or e.g. ``"max-autotune-no-cudagraphs"``. Raises
    ``ValueError`` for an architecture the fast path does not compute (see :func:`supports`) only when
    ``strict``; otherwise such models run through their own forward.
    """

    def __init__(self, model: Transformer, fuse: bool = True, compile: bool = False,
                 compile_mode: Optional[str] = None, strict: bool = False) -> None:
        super().__init__()
        model.eval()
        self.__dict__["model"] = model  # not a submodule: .to()/.float() on the wrapper must not re-materialise views
        self.config = model.config
        self.reason = supports(model.config)
        if self.reason is not None and strict:
            raise ValueError(f"the fast path does not compute this model ({self.reason})")
        self.fused = fuse and self.reason is None
        # The compiled step reads the fused matrices; without fusion it is not offered.
        self.compiled = compile and self.reason is None and fuse
        self.compile_mode = compile_mode
        self.compile_seconds = 0.0  # wall time spent compiling (first call of each new shape), seconds
        self._step_fn = None
        self._compiled_shapes: set[tuple[int, int, int]] = set()  # (batch, seq, cache length)
        self._buffers_i64: dict[tuple, torch.Tensor] = {}
        if self.reason is None:
            self._build(fuse)

    # ------------------------------------------------------------------------------------------------ set-up
    def _build(self, fuse: bool) -> None:
        c, m = self.config, self.model
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.n_rep = c.n_heads // c.n_kv_heads
        self.gated = c.ffn in ("swiglu", "geglu")
        self.act = F.silu if c.ffn == "swiglu" else F.gelu if c.ffn in ("geglu", "gelu") else F.relu
        self.layers: list[LayerWeights] = []
        for block in m.layers:
            a, f = block.attention, block.feed_forward
            if fuse:
                wqkv = _fuse([a.wq, a.wk, a.wv])
                w13 = _fuse([f.w1, f.w3]) if self.gated else _module_proj(f.w1)
            else:
                # Unfused: concatenated copies would double the memory, so the three projections stay apart.
                wqkv = [_module_proj(a.wq), _module_proj(a.wk), _module_proj(a.wv)]
                w13 = [_module_proj(f.w1), _module_proj(f.w3)] if self.gated else _module_proj(f.w1)
            self.layers.append(LayerWeights(
                block.attention_norm.weight.detach(), block.ffn_norm.weight.detach(), wqkv, _module_proj(a.wo),
                w13, _module_proj(f.w2), block.attention_norm.eps, block.ffn_norm.eps))
        self.embedding = m.tok_embeddings.weight.detach()
        self.final_norm = m.norm.weight.detach()
        self.final_eps = m.norm.eps
        self.head = _module_proj(m.output)
        if self.compiled:  # int8 weights are read by the compiled step as float32 words (same memory)
            for p in [self.head] + [q for lw in self.layers for q in (lw.wqkv, lw.wo, lw.w13, lw.w2)]:
                p.words = int8_words(p.weight)
        # RoPE tables in the activation dtype, with rotate_half's sign folded into the sine (see module docstring).
        dtype = ACT_DTYPE
        half = c.head_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(m.rope_sin.device)
        self.cos = m.rope_cos.to(dtype)
        self.sin_signed = (m.rope_sin * sign).to(dtype)
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self._geometry = _Geometry(c.n_heads, c.n_kv_heads, c.head_dim, self.scale, c.ffn)

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
        return LayerKVCache(c.n_layers, batch_size, c.n_kv_heads, length, c.head_dim, dtype or self.act_dtype,
                            self.device)

    @property
    def act_dtype(self) -> torch.dtype:
        """The dtype of the activations and of the KV cache: float32 (:data:`ACT_DTYPE`) on the fast path, the
        weights' own dtype for models it hands back to their ``forward``."""
        return ACT_DTYPE if self.reason is None else self.dtype

    # ------------------------------------------------------------------------------------------------ forward
    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[batch, seq_len, heads, head_dim]`` by ``cos``/``sin`` broadcastable to it."""
        return x * cos + torch.roll(x, self.head_dim // 2, dims=-1) * sin

    @staticmethod
    def _project(p, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([q(x) for q in p], dim=-1) if isinstance(p, list) else p(x)

    def forward(
        self,
        tokens: torch.Tensor,
        start_pos: int = 0,
        kv_cache: Optional[KVCache] = None,
        attention_mask: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        last_only: bool = False,
    ) -> torch.Tensor:
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
            h = self._block(i, lw, h, cos, sin, start_pos, end, kv_cache, mask, key_valid,
                            last_only=last_only and i == last_layer)
        return self.head(rms_norm(h, self.final_norm, self.final_eps))

    def _block(self, i, lw: LayerWeights, h, cos, sin, start_pos, end, kv_cache, mask, key_valid,
               last_only: bool = False):
        """One block over ``h`` ``[batch, seq_len, dim]``; with ``last_only`` it still writes every position's key
        and value to the cache but returns the last position alone, ``[batch, 1, dim]``."""
        batch, seq_len, _ = h.shape
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        x = rms_norm(h, lw.attn_norm, lw.attn_norm_eps)
        qkv = self._project(lw.wqkv, x).view(batch, seq_len, nh + 2 * nkv, hd)
        qk = self._rope(qkv[:, :, :nh + nkv], cos, sin)
        q, k, v = qk[:, :, :nh], qk[:, :, nh:], qkv[:, :, nh + nkv:]
        if kv_cache is not None:
            keys, values = kv_cache.update(i, start_pos, k.transpose(1, 2), v.transpose(1, 2))
        else:
            if start_pos:
                raise ValueError("start_pos > 0 needs a kv_cache holding the earlier positions")
            keys, values = k.transpose(1, 2), v.transpose(1, 2)
        if last_only and seq_len > 1:
            # The last query sees every key, so the causal mask reduces to its last row (all True without padding).
            q, h, seq_len = q[:, -1:], h[:, -1:], 1
            mask = None if mask is None else mask[..., -1:, :]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                                 enable_gqa=self.n_rep > 1).transpose(1, 2)
        elif seq_len == 1:
            out = self._attend_one(q, keys, values, key_valid)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=mask is None and start_pos == 0,
                enable_gqa=self.n_rep > 1).transpose(1, 2)
        h = h + lw.wo(out.reshape(batch, seq_len, nh * hd))
        x = rms_norm(h, lw.ffn_norm, lw.ffn_norm_eps)
        if self.gated:
            gate_up = self._project(lw.w13, x)
            gate, up = gate_up.chunk(2, dim=-1)
            x = self.act(gate) * up
        else:
            x = self.act(lw.w13(x))
        return h + lw.w2(x)

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
        if pos + seq > kv_cache.max_seq_len:
            raise ValueError(f"{seq} tokens at position {pos} do not fit in a cache of {kv_cache.max_seq_len}")
        if not self.compiled:
            return self(tokens, pos, kv_cache)
        if pad is None:
            pad = self._buffer(("pad", batch), batch)
        key = (batch, seq, kv_cache.max_seq_len)
        if self._step_fn is None:
            # size_asserts off: the wrapper would re-check the size and stride of every tensor of every layer on each
            # call (a third of a `tiny` step); the guards on the step's arguments already pin them, and the
            # weights never change.
            options = {"guard_filter_fn": _guards_on_inputs_only, "size_asserts": False}
            if self.compile_mode is not None:  # mode and options are exclusive in torch.compile
                options.update(torch._inductor.list_mode_options(self.compile_mode))
            # A private copy of the step's code object: Dynamo caches compiled graphs per code object, so every
            # FastPath gets its own cache (and the guards dropped on `self` cannot match another model's weights).
            func = type(self)._static_step
            fresh = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                                       func.__closure__)
            self._step_fn = torch.compile(types.MethodType(fresh, self), dynamic=False, fullgraph=True,
                                          options=options)
        first = key not in self._compiled_shapes
        t0 = time.perf_counter()
        input_pos = self._buffer(("pos",), 1).fill_(pos)  # reused: no allocation per step
        if not isinstance(kv_cache, LayerKVCache) or kv_cache.batch_size != batch:
            raise ValueError("the compiled decode step needs a cache from FastPath.new_kv_cache of the same batch size")
        logits, new_k, new_v = self._step_fn(tokens, input_pos, pad, kv_cache.k, kv_cache.v)
        # The new columns are written here, outside the graph (see _static_step): 2 x n_layers small copies.
        for cache_k, cache_v, k, v in zip(kv_cache.k, kv_cache.v, new_k, new_v):
            cache_k[:, :, pos:pos + seq].copy_(k)
            cache_v[:, :, pos:pos + seq].copy_(v)
        if first:
            self._compiled_shapes.add(key)
            self.compile_seconds += time.perf_counter() - t0
        return logits

    def _buffer(self, key: tuple, size: int) -> torch.Tensor:
        """A persistent zeroed int64 tensor of ``size`` elements per ``key`` (step inputs reused across steps)."""
        if key not in self._buffers_i64:
            # A normal tensor even when first made under inference_mode (generate runs there): an inference
            # tensor could not be refilled by a later step outside it.
            with torch.inference_mode(False):
                self._buffers_i64[key] = torch.zeros(size, dtype=torch.long, device=self.device)
        return self._buffers_i64[key]

    def _static_step(self, token: torch.Tensor, input_pos: torch.Tensor, pad: torch.Tensor,
                     k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]):
        """The traced step over ``seq`` new tokens per row (``token`` ``[batch, seq]``; 1 when decoding): static
        shapes, the position and the padding as tensors.

        ``k_cache``/``v_cache``: per layer ``[batch, n_kv_heads, T, head_dim]``, read only; every query attends to
        the cached columns ``pad <= column < pos`` (masked scores are ``-inf`` and contribute exact zeros, so the
        result equals attending to the prefix) and to the new tokens' keys and values up to its own.
        Returns ``(logits [batch, seq, vocab], new_k, new_v)``, the last two a tuple per layer of
        ``[batch, n_kv_heads, seq, head_dim]`` for the caller to write at columns ``pos .. pos + seq - 1``. The
        graph mutates nothing: with the cache write inside it, the nested compile regions below wrote garbage into
        the cache for models of more than one layer (torch 2.13; tests/test_compile.py covers it)."""
        columns = torch.arange(k_cache[0].shape[2], device=token.device)
        # The cached columns a query sees: the row's own prefix, without the columns being written now (their keys
        # and values enter the attention directly, see _step_layer).
        key_valid = ((columns[None, :] < input_pos) & (columns[None, :] >= pad[:, None]))[:, None, None, :]
        offsets = torch.arange(token.shape[1], device=token.device)
        rope_pos = (input_pos - pad)[:, None] + offsets[None, :]  # [batch, seq]
        cos = self.cos[rope_pos][:, :, None, :]
        sin = self.sin_signed[rope_pos][:, :, None, :]
        h = F.embedding(token, self.embedding).to(ACT_DTYPE)
        new_k, new_v = [], []
        g = self._geometry
        for i, lw in enumerate(self.layers):
            h, k, v = _step_layer(h, k_cache[i], v_cache[i], key_valid, cos, sin, lw.attn_norm,
                                  *_proj_args(lw.wqkv), *_proj_args(lw.wo), lw.ffn_norm, *_proj_args(lw.w13),
                                  *_proj_args(lw.w2), g, lw.attn_norm_eps, lw.ffn_norm_eps)
            new_k.append(k)
            new_v.append(v)
        return decode_linear(self.head, rms_norm(h, self.final_norm, self.final_eps)), new_k, new_v


def _guards_on_inputs_only(entries) -> list[bool]:
    """Dynamo guard filter of the compiled step: keep the guards on the step's arguments (shapes, dtypes: a new
    batch size or cache length must recompile) and drop those on ``self`` -- the weights and constants a FastPath
    never rebinds. Checking ~100 weight guards per call cost ~0.3 ms, a tenth of a small model's step."""
    return [not entry.name.startswith("L['self']") and entry.guard_type not in _DROPPED_GUARDS for entry in entries]


# The pairwise no-aliasing check spans every tensor the step touches (weights included); the step's own arguments
# (token, position, padding, per-layer caches) never alias by construction.
_DROPPED_GUARDS = ("NO_TENSOR_ALIASING",)


@dataclass(frozen=True)
class _Geometry:
    """The static numbers a traced layer needs (hashable: they specialise the compiled region)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    ffn: str


def _proj_args(p: Proj) -> tuple:
    """A projection as plain tensor arguments of a compile region (weight, scale, bias, words); the words, when
    there are any, replace the weight (they are the same bytes)."""
    return None if p.words is not None else p.weight, p.scale, p.bias, p.words


# A decode layer is one nested compile region: Inductor compiles it once and stamps the code out for every layer,
# so compile time does not grow with depth (a whole 20-layer step took minutes to compile). One region rather than
# two halves around the cache write: a region call costs Python wrapper time, and the cache is written outside.
@torch.compiler.nested_compile_region
def _step_layer(h, k_cache, v_cache, key_valid, cos, sin, attn_norm, wqkv, wqkv_scale, wqkv_bias, wqkv_words,
                wo, wo_scale, wo_bias, wo_words, ffn_norm, w13, w13_scale, w13_bias, w13_words, w2, w2_scale,
                w2_bias, w2_words, g: _Geometry, attn_eps: float, ffn_eps: float):
    """One block for ``seq`` new tokens per row: ``h`` ``[batch, seq, dim]`` -> ``(h [batch, seq, dim], k, v)``,
    ``k``/``v`` ``[batch, n_kv_heads, seq, head_dim]`` the new tokens' keys and values (cache layout, for the
    caller to write).

    Each query attends to the cached columns under ``key_valid`` plus, directly, the new keys and values at or
    before its own position."""
    batch, seq = h.shape[0], h.shape[1]
    nh, nkv, hd = g.n_heads, g.n_kv_heads, g.head_dim
    x = rms_norm(h, attn_norm, attn_eps)
    qkv = decode_linear(Proj(wqkv, wqkv_scale, wqkv_bias, wqkv_words), x).view(batch, seq, nh + 2 * nkv, hd)
    qk = qkv[:, :, :nh + nkv]
    qk = qk * cos + torch.roll(qk, hd // 2, dims=-1) * sin
    q = qk[:, :, :nh]
    k = qk[:, :, nh:].transpose(1, 2)  # [batch, n_kv_heads, seq, head_dim]
    v = qkv[:, :, nh + nkv:].transpose(1, 2)
    # Scores and weighted values as broadcast reductions rather than batched matmuls: the products are tiny
    # ([n_rep * seq, head_dim] x [head_dim, T] per KV head), so a BLAS call costs more in overhead than in
    # arithmetic, while Inductor fuses them with the mask and the softmax into a couple of loops.
    qg = q.reshape(batch, seq, nkv, nh // nkv, hd).permute(0, 2, 3, 1, 4)[..., None, :] * g.scale
    scores = (qg * k_cache[:, :, None, None, :, :]).sum(-1)  # [batch, n_kv, n_rep, seq, T]
    scores = scores.masked_fill(~key_valid[:, :, :, None, :], float("-inf"))
    # The new keys last, each query seeing those at or before its own position: [..., T + seq].
    new_scores = (qg * k[:, :, None, None, :, :]).sum(-1)  # [batch, n_kv, n_rep, seq, seq]
    if seq > 1:
        causal = torch.ones(seq, seq, dtype=torch.bool, device=h.device).tril()
        new_scores = new_scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(torch.cat([scores, new_scores], dim=-1), dim=-1)
    t = k_cache.shape[2]
    out = ((probs[..., :t, None] * v_cache[:, :, None, None, :, :]).sum(-2)
           + (probs[..., t:, None] * v[:, :, None, None, :, :]).sum(-2))  # [batch, n_kv, n_rep, seq, head_dim]
    out = out.permute(0, 3, 1, 2, 4).reshape(batch, seq, nh * hd)
    h = h + decode_linear(Proj(wo, wo_scale, wo_bias, wo_words), out)
    x = rms_norm(h, ffn_norm, ffn_eps)
    if g.ffn in ("swiglu", "geglu"):
        gate, up = decode_linear(Proj(w13, w13_scale, w13_bias, w13_words), x).chunk(2, dim=-1)
        x = (F.silu(gate) if g.ffn == "swiglu" else F.gelu(gate)) * up
    else:
        x = decode_linear(Proj(w13, w13_scale, w13_bias, w13_words), x)
        x = F.gelu(x) if g.ffn == "gelu" else F.relu(x)
    # Clones: a region's outputs may not alias each other or its inputs (they are a few hundred floats).
    return h + decode_linear(Proj(w2, w2_scale, w2_bias, w2_words), x), k.clone(), v.clone()


def prepare(model: Transformer, dtype: Optional[torch.dtype] = None, quantize: Optional[str] = None,
            fuse: bool = True, compile: bool = False, compile_mode: Optional[str] = None) -> FastPath:
    """Convert ``model`` in place for inference and wrap it: cast to ``dtype`` (bf16 weights are an option; the
    norms' statistics and the softmax stay float32), quantize (``"int8"``: weight-only per-channel, see
    :mod:`minigpt.model.quant`; skipped when the model is already quantized), fuse, and optionally compile the decode
    step. Raises ``ValueError`` for an unknown ``quantize``."""
    if dtype is not None and not is_quantized(model):
        model.to(dtype=dtype)
    if quantize not in (None, "none", "int8"):
        raise ValueError(f"unknown quantization {quantize!r}; choose int8 or none")
    if quantize == "int8" and not is_quantized(model):
        quantize_model(model)
    return FastPath(model, fuse=fuse, compile=compile, compile_mode=compile_mode)


def load_for_inference(source, device: torch.device | str = "cpu", dtype: Optional[torch.dtype] = None,
                       quantize: Optional[str] = None, compile: bool = False, compile_mode: Optional[str] = None,
                       fast: bool = True):
    """Load any model source (:func:`minigpt.checkpoint.native.load_model`) ready to generate: a :class:`FastPath`
    (``fast``) or the plain :class:`Transformer` (``fast=False``; ``compile`` then does not apply, ``quantize``
    still does). Raises :class:`~minigpt.errors.MiniGPTError` for unreadable sources."""
    from minigpt.checkpoint.native import load_model

    model = load_model(source, device=device, dtype=dtype)
    if not fast:
        if quantize == "int8" and not is_quantized(model):
            quantize_model(model)
        return model
    return prepare(model, quantize=quantize, compile=compile, compile_mode=compile_mode)
