"""The decoder-only Transformer: token embedding, ``n_layers`` pre-norm blocks, final RMSNorm, LM head.

Architecture of Llama (Touvron et al. 2023): pre-norm residual blocks (Xiong et al. 2020) with RMSNorm, RoPE,
grouped-query attention and a SwiGLU FFN; the LM head shares the embedding matrix when ``tie_embeddings``
(Press & Wolf 2017). The config's variant fields swap in the older or alternative choices: post-norm blocks
(Vaswani et al. 2017, no final norm), LayerNorm, ALiBi / learned / sinusoidal / no positions, GeGLU / GELU / ReLU
FFNs, and mixture-of-experts FFNs (:mod:`minigpt.model.moe`). Recipe options: QK-norm
(:mod:`minigpt.model.attention`), the squared-ReLU MLP (:mod:`minigpt.model.ffn`), an untied head and logit
soft-capping (:func:`softcap`).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from minigpt.errors import MiniGPTError
from minigpt.model.attention import Attention, padded_causal_mask
from minigpt.model.config import ModelConfig
from minigpt.model.ffn import build_ffn
from minigpt.model.kv_cache import KVCache
from minigpt.model.moe import MoE
from minigpt.model.norm import LayerNorm, RMSNorm, build_norm
from minigpt.model.positions import Alibi, alibi_slopes, sinusoidal_table
from minigpt.model.rope import RopeScaling, rope_tables

# Rows of the position tables (RoPE ``rope_cos``/``rope_sin``, the sinusoidal ``pos_table``) computed with the
# model. Longer contexts grow them on demand (:meth:`Transformer.ensure_positions`), so a file's context claim (a
# llama2.c header may say 2^31 - 1 positions) never sizes an allocation, while every context up to 32k keeps its
# whole table from the start: readers of the tables (the inference fast path, packing) see all their rows.
EAGER_POSITIONS = 1 << 15


def pre_norm_residual(h: torch.Tensor, attention_norm: Callable, attention: Callable, ffn_norm: Callable,
                      feed_forward: Callable, last_only: bool = False) -> torch.Tensor:
    """The pre-norm residual block (Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture";
    Llama's): ``h = h + attention(attention_norm(h))``, then ``h + feed_forward(ffn_norm(h))``.

    ``h`` ``[batch, seq_len, dim]``; each argument maps ``[batch, n, dim]`` to ``[batch, n, dim]``, except that with
    ``last_only`` ``attention`` returns the last position alone, ``[batch, 1, dim]`` (the fast path's
    last-position prefill), and so does the block. The one block skeleton of the package: :class:`Block` and both
    blocks of the inference fast path (:mod:`minigpt.infer.fastpath`, over its fused weights) call it.
    """
    a = attention(attention_norm(h))
    if last_only:
        h = h[:, -1:]
    h = h + a
    return h + feed_forward(ffn_norm(h))


class Block(nn.Module):
    """Pre-norm ``h = x + attn(norm(x)); out = h + ffn(norm(h))``, or post-norm (``norm_position="post"``,
    Vaswani et al. 2017) ``h = norm(x + attn(x)); out = norm(h + ffn(h))``.
    ``[batch, seq_len, dim] -> [batch, seq_len, dim]``. The FFN is an :class:`~minigpt.model.moe.MoE` on MoE layers."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = build_norm(config.norm, config.dim, config.norm_eps)
        self.attention = Attention(config, layer_id)
        self.ffn_norm = build_norm(config.norm, config.dim, config.norm_eps)
        if config.is_moe_layer(layer_id):
            self.feed_forward = MoE(config)
        else:
            self.feed_forward = build_ffn(config.ffn, config.dim, config.hidden_dim, config.has_mlp_bias,
                                          config.dropout)
        self.post_norm = config.norm_position == "post"

    def forward(self, x, cos, sin, start_pos=0, kv_cache=None, mask=None, alibi=None):
        if self.post_norm:
            h = self.attention_norm(x + self.attention(x, cos, sin, start_pos, kv_cache, mask, alibi))
            return self.ffn_norm(h + self.feed_forward(h))
        return pre_norm_residual(x, self.attention_norm,
                                 lambda y: self.attention(y, cos, sin, start_pos, kv_cache, mask, alibi),
                                 self.ffn_norm, self.feed_forward)


def softcap(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (Gemma 2's ``final_logit_softcapping``; modded-nanoGPT): a smooth clamp of
    ``logits`` ``[..., vocab_size]`` into ``(-cap, cap)`` that is the identity to first order near 0. ``cap`` None
    returns ``logits`` unchanged."""
    if cap is None:
        return logits
    return cap * torch.tanh(logits / cap)


def positions_from_mask(attention_mask: torch.Tensor, start_pos: int, seq_len: int) -> torch.Tensor:
    """Per-row positions ``[batch, seq_len]`` (int64) of the tokens at ``start_pos .. start_pos + seq_len``.

    ``attention_mask`` ``[batch, start_pos + seq_len]`` (1 = real token, 0 = padding) covers the cached prefix and
    the new tokens. A row's first real token is position 0, so a left-padded prompt is rotated exactly as if it
    were alone: ``cumsum(mask) - 1``, with padding clamped to 0 (what ``transformers``' ``generate`` does).
    """
    positions = attention_mask.long().cumsum(-1) - 1
    return positions[:, start_pos:start_pos + seq_len].clamp(min=0)


def _embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num, dim)``; on the meta device (a checkpoint's skeleton) without its init, a ``normal_`` that
    there runs torch's Python reference kernels, whose first use imports Dynamo: 1.1 s of every `minigpt generate`.
    Elsewhere the init runs, so a seeded model draws the same random numbers as ever."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class Transformer(nn.Module):
    """A Llama-style causal language model.

    ``forward(tokens [batch, seq_len], start_pos, kv_cache, attention_mask) -> logits [batch, seq_len,
    vocab_size]`` (float32 under fp32 weights; the dtype of the weights or autocast otherwise).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = _embedding(config.vocab_size, config.dim)
        if config.pos_encoding == "learned":
            self.pos_embeddings = _embedding(config.max_seq_len, config.dim)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        # A post-norm block already ends in a norm, so the 2017 Transformer has no final one.
        self.norm = build_norm(config.norm, config.dim, config.norm_eps) if config.norm_position == "pre" \
            else nn.Identity()
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_rope()
        if not self.tok_embeddings.weight.is_meta:  # on meta there is nothing to fill (and normal_ is slow there)
            self.reset_parameters()

    def init_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the position buffers derived from the config, on ``device``: RoPE frequencies and
        ``cos``/``sin`` tables, the sinusoidal table, or the ALiBi slopes, whichever ``pos_encoding`` uses.
        The tables hold the first ``min(max_seq_len, EAGER_POSITIONS)`` positions (see :meth:`ensure_positions`).

        Called again after building a model on the meta device, whose tables would otherwise be empty.
        """
        c = self.config
        self.rope = None
        rows = min(c.max_seq_len, EAGER_POSITIONS)
        device = torch.get_default_device() if device is None else device
        # Computed on the CPU, then moved: under the meta device (a checkpoint's skeleton) arange and div would run
        # torch's Python reference kernels, whose first use imports Dynamo (~0.8 s of every `minigpt generate`).
        with torch.device("cpu"):
            if c.pos_encoding == "rope":
                self.rope = RopeScaling(c.head_dim, c.rope_theta, c.rope_scaling, c.max_seq_len)
                cos, sin = rope_tables(c.head_dim, rows, c.rope_theta, c.rope_scaling)
            elif c.pos_encoding == "sinusoidal":
                table = sinusoidal_table(rows, c.dim)
            elif c.pos_encoding == "alibi":
                slopes = alibi_slopes(c.n_heads)
        # Non-persistent buffers: derived from the config, so they never enter a checkpoint.
        if c.pos_encoding == "rope":
            self.register_buffer("rope_cos", cos.to(device), persistent=False)
            self.register_buffer("rope_sin", sin.to(device), persistent=False)
        elif c.pos_encoding == "sinusoidal":
            self.register_buffer("pos_table", table.to(device), persistent=False)
        elif c.pos_encoding == "alibi":
            self.register_buffer("alibi_slopes", slopes.to(device), persistent=False)

    def ensure_positions(self, end: int) -> None:
        """Grow the position tables to cover positions ``[0, end)`` (``end <= max_seq_len``); a no-op when they do.

        Rows are appended, doubling the table (capped at ``max_seq_len``), so the rows already there keep their
        bits, and the new ones are computed by the same formula in the tables' current dtype and device.
        """
        c = self.config
        name = "rope_cos" if self.rope is not None else "pos_table" if c.pos_encoding == "sinusoidal" else None
        have = 0 if name is None else getattr(self, name).shape[0]
        if name is None or end <= have:
            return
        rows = min(c.max_seq_len, max(end, 2 * have))
        old = getattr(self, name)
        # Ordinary tensors even under inference_mode (generate runs there): a training step after a generation
        # must be able to save them for backward.
        with torch.inference_mode(False), torch.no_grad():
            if self.rope is not None:
                cos, sin = self.rope.tables(torch.arange(have, rows, device=old.device))
                self.rope_cos = torch.cat((self.rope_cos, cos.to(old.dtype)))
                self.rope_sin = torch.cat((self.rope_sin, sin.to(old.dtype)))
            else:
                self.pos_table = torch.cat((old, sinusoidal_table(rows, c.dim)[have:].to(old)))

    def reset_parameters(self) -> None:
        """GPT-2 initialisation (Radford et al. 2019): N(0, 0.02) everywhere, the projections that write into the
        residual stream (``wo``, ``w2``) scaled by ``1/sqrt(2 * n_layers)`` so the stream's variance stays flat."""
        std = 0.02
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                scale = 1.0 / math.sqrt(2 * self.config.n_layers) if name.endswith(("wo", "w2")) else 1.0
                nn.init.normal_(module.weight, mean=0.0, std=std * scale)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def new_kv_cache(
        self, batch_size: int, max_seq_len: Optional[int] = None, dtype: Optional[torch.dtype] = None
    ) -> KVCache:
        """A zeroed :class:`KVCache` for ``batch_size`` rows of up to ``max_seq_len`` (default: the model's) tokens."""
        c = self.config
        max_seq_len = max_seq_len or c.max_seq_len
        if max_seq_len > c.max_seq_len:
            raise ValueError(f"cache length {max_seq_len} exceeds the model's max_seq_len {c.max_seq_len}")
        dtype = dtype or self.tok_embeddings.weight.dtype
        return KVCache(c.n_layers, batch_size, c.n_kv_heads, max_seq_len, c.head_dim, dtype,
                       self.tok_embeddings.weight.device)

    def forward(
        self,
        tokens: torch.Tensor,
        start_pos: int = 0,
        kv_cache: Optional[KVCache] = None,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits ``[batch, seq_len, vocab_size]`` for ``tokens`` at absolute positions ``start_pos + i``.

        ``attention_mask`` ``[batch, start_pos + seq_len]`` (1 = real token, 0 = padding; rows left-padded) makes
        each row's positions start at its first real token (:func:`positions_from_mask`) and hides padding keys, so
        the logits at real tokens equal those of each row run alone. Without it nothing extra is computed.

        Learned and sinusoidal positions are looked up at the same per-row positions; ALiBi measures distances
        between them. MoE layers store their router losses for :meth:`pop_aux_loss`.

        Raises ``ValueError`` when ``start_pos + seq_len`` exceeds ``max_seq_len`` or the mask has the wrong shape.
        """
        batch, seq_len = tokens.shape
        end = start_pos + seq_len
        if end > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {end} positions exceeds the model's max_seq_len {self.config.max_seq_len}"
            )
        self.ensure_positions(end)
        if self.rope is None:
            return self._forward_variant(tokens, start_pos, kv_cache, attention_mask)
        mask = None
        if attention_mask is None:
            if self.rope.is_dynamic and end > self.rope.original:
                cos, sin = self.rope.tables(torch.arange(start_pos, end, device=tokens.device),
                                            self.rope.dynamic_inv_freq(end))
            else:
                cos, sin = self.rope_cos[start_pos:end], self.rope_sin[start_pos:end]
        else:
            if tuple(attention_mask.shape) != (batch, end):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(batch, end)} "
                                 "(batch, cached + new tokens)")
            positions = positions_from_mask(attention_mask, start_pos, seq_len)
            cos, sin = self._rope_at(positions)
            mask = padded_causal_mask(attention_mask, seq_len, self.config.sliding_window)
        h = self.dropout(self.tok_embeddings(tokens))
        for layer in self.layers:
            h = layer(h, cos, sin, start_pos, kv_cache, mask)
        return self.logits(h)

    def _forward_variant(self, tokens, start_pos, kv_cache, attention_mask) -> torch.Tensor:
        """:meth:`forward` for models without RoPE (``pos_encoding`` alibi / learned / sinusoidal / none)."""
        c = self.config
        batch, seq_len = tokens.shape
        end = start_pos + seq_len
        mask, alibi = None, None
        if attention_mask is None:
            positions = torch.arange(start_pos, end, device=tokens.device)[None]  # [1, seq_len]
            key_positions = torch.arange(end, device=tokens.device)[None]
        else:
            if tuple(attention_mask.shape) != (batch, end):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(batch, end)} "
                                 "(batch, cached + new tokens)")
            key_positions = positions_from_mask(attention_mask, 0, end)  # [batch, end]
            positions = key_positions[:, start_pos:]
            mask = padded_causal_mask(attention_mask, seq_len, self.config.sliding_window)
        h = self.tok_embeddings(tokens)
        if c.pos_encoding == "learned":
            h = h + self.pos_embeddings(positions)
        elif c.pos_encoding == "sinusoidal":
            # Vaswani et al. 2017 (section 3.4) scale the embeddings by sqrt(dim), so that the unit-amplitude table
            # does not drown the small initial token embeddings.
            h = h * math.sqrt(c.dim) + self.pos_table[positions].to(h.dtype)
        elif c.pos_encoding == "alibi":
            alibi = Alibi(self.alibi_slopes, key_positions)
        h = self.dropout(h)
        for layer in self.layers:
            h = layer(h, None, None, start_pos, kv_cache, mask, alibi)
        return self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The model's top: final norm, LM head and (with ``logit_softcap``) soft-capping, ``[batch, seq_len, dim]``
        -> ``[batch, seq_len, vocab_size]``. Every forward over the blocks ends here (also the packed one of
        :mod:`minigpt.posttrain.packing`)."""
        return softcap(self.output(self.norm(h)), self.config.logit_softcap)

    def moe_layers(self) -> list[MoE]:
        """The :class:`~minigpt.model.moe.MoE` FFNs, in layer order (empty for a dense model)."""
        return [layer.feed_forward for layer in self.layers if isinstance(layer.feed_forward, MoE)]

    def pop_aux_loss(self) -> torch.Tensor | float:
        """Sum of the MoE router losses (already weighted by their coefficients) stored by the latest forward, and
        forget them, so that no autograd graph outlives the training step that consumes it. ``0.0`` for a dense
        model (adding it to a loss changes nothing)."""
        total: torch.Tensor | float = 0.0
        for moe in self.moe_layers():
            if moe.aux_loss is not None:
                total = total + moe.aux_loss
                moe.aux_loss = None
        return total

    def moe_metrics(self) -> dict[str, object]:
        """Router statistics of the latest forward for a metrics row: ``aux_loss`` and ``z_loss`` (unweighted,
        averaged over MoE layers) and ``expert_load`` (per MoE layer, the fraction of token-to-expert assignments
        each expert received; uniform = ``1 / n_experts``). Empty for a dense model. One host sync."""
        stats = [m.stats for m in self.moe_layers() if m.stats]
        if not stats:
            return {}
        return {"aux_loss": torch.stack([s["aux_loss"] for s in stats]).mean().item(),
                "z_loss": torch.stack([s["z_loss"] for s in stats]).mean().item(),
                "expert_load": [[round(x, 4) for x in s["load"].tolist()] for s in stats]}

    def _rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE rows ``[batch, 1, seq_len, head_dim]`` for per-row ``positions`` ``[batch, seq_len]``."""
        if self.rope.is_dynamic:
            # transformers sizes the dynamic-NTK base by the largest position in the batch.
            longest = int(positions.max()) + 1
            if longest > self.rope.original:
                cos, sin = self.rope.tables(positions, self.rope.dynamic_inv_freq(longest))
                return cos[:, None], sin[:, None]
        return self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy in nats/token (float32); ``tokens``/``targets`` ``[batch, seq_len]``."""
        return lm_loss(self(tokens), targets)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters (tied matrices counted once); ``exclude_embeddings`` drops the token (and
        learned position) embeddings, as Kaplan et al. 2020 count ``N``. An untied LM head stays counted."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_embeddings.weight.numel()
            if self.config.pos_encoding == "learned":
                n -= self.pos_embeddings.weight.numel()
        return n


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` ``[batch, seq_len, vocab_size]`` against ``targets`` ``[batch, seq_len]``,
    in nats/token, computed in float32."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def resize_token_embeddings(model, vocab_size: int, init_ids: Iterable[int] = ()) -> None:
    """Resize ``model``'s embedding (and untied LM head) to ``vocab_size`` rows, in place, keeping the old rows.

    Rows beyond the old size, and the rows ``init_ids`` (new tokens whose ids fell inside an oversized old matrix),
    are set to the mean of the old rows. ``model.config.vocab_size`` follows. Raises :class:`MiniGPTError` when
    shrinking.
    """
    old = model.tok_embeddings.weight
    old_size = old.shape[0]
    if vocab_size < old_size:
        raise MiniGPTError(f"cannot shrink the vocabulary from {old_size} to {vocab_size}")
    init = sorted(set(range(old_size, vocab_size)) | set(init_ids))

    def grown(weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty(vocab_size, weight.shape[1], dtype=weight.dtype, device=weight.device)
        out[:old_size] = weight.detach()
        out[init] = weight.detach().float().mean(0).to(weight.dtype)
        return out

    tied = model.config.tie_embeddings
    if not isinstance(model.output, nn.Linear):
        raise MiniGPTError("cannot add tokens to an int8-quantized model; add them to the float model first")
    # Built on the meta device: their weights are replaced at once, so nothing is allocated twice.
    embedding = nn.Embedding(vocab_size, old.shape[1], device="meta")
    embedding.weight = nn.Parameter(grown(old), requires_grad=old.requires_grad)
    head = model.output
    if not tied:
        new_head = nn.Linear(head.in_features, vocab_size, bias=False, device="meta")
        new_head.weight = nn.Parameter(grown(head.weight), requires_grad=head.weight.requires_grad)
        model.output = new_head
    model.tok_embeddings = embedding
    if tied:
        model.output = nn.Linear(old.shape[1], vocab_size, bias=False, device="meta")
        model.output.weight = model.tok_embeddings.weight
    model.config.vocab_size = vocab_size
