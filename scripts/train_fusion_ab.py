"""Does fusing projections pay in an eager fp32 training step? A/B in one process, round-robin.

Variants of one AdamW step on batch 8 x 256 (random tokens, vocabulary 4,096, as `minigpt bench`'s train row):
``base`` (the model as it is: separate ``wq``/``wk``/``wv`` and ``w1``/``w3`` GEMMs), ``attn`` (one GEMM on the
concatenated QKV weights), ``ffn`` (one GEMM on the concatenated gate/up weights), ``both``. The fused variants
concatenate the weights inside the forward, so autograd still gives each original matrix its gradient.
Prints the median step time and the median of per-round ratios ``base / variant`` (> 1: the variant is faster).

Run from the repo root: ``.venv/bin/python scripts/train_fusion_ab.py [--preset small] [--rounds 7]``.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from minigpt.model import attention, ffn, rope
from minigpt.model.config import preset
from minigpt.model.transformer import Transformer

PLAIN_ATTENTION, PLAIN_FFN = attention.Attention.forward, ffn.SwiGLU.forward


def fused_attention(self, x, cos, sin, start_pos=0, kv_cache=None, mask=None, alibi=None):
    if kv_cache is not None or mask is not None or alibi is not None or self.impl != "sdpa":
        return PLAIN_ATTENTION(self, x, cos, sin, start_pos, kv_cache, mask, alibi)
    batch, seq_len, _ = x.shape
    qkv = F.linear(x, torch.cat([self.wq.weight, self.wk.weight, self.wv.weight]))
    qkv = qkv.view(batch, seq_len, self.n_heads + 2 * self.n_kv_heads, self.head_dim).transpose(1, 2)
    q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=1)
    q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
    return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


def fused_ffn(self, x):
    gate, up = F.linear(x, torch.cat([self.w1.weight, self.w3.weight])).chunk(2, dim=-1)
    return self.w2(F.silu(gate) * up)


VARIANTS = {"base": (PLAIN_ATTENTION, PLAIN_FFN), "attn": (fused_attention, PLAIN_FFN),
            "ffn": (PLAIN_ATTENTION, fused_ffn), "both": (fused_attention, fused_ffn)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.manual_seed(0)
    model = Transformer(preset(args.preset, vocab_size=4096, max_seq_len=256))
    x, y = torch.randint(0, 4096, (2, 8, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def step(variant: str) -> float:
        attention.Attention.forward, ffn.SwiGLU.forward = VARIANTS[variant]
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).float().view(-1, 4096), y.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    try:
        for v in VARIANTS:
            step(v)
        times = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for v in VARIANTS:
                times[v].append(step(v))
    finally:
        attention.Attention.forward, ffn.SwiGLU.forward = PLAIN_ATTENTION, PLAIN_FFN
    print(f"{args.preset} train step, batch 8 x 256, fp32 eager, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds")
    for v, ts in times.items():
        ratio = statistics.median(b / t for b, t in zip(times["base"], ts))
        print(f"  {v:5s} {statistics.median(ts) * 1e3:8.0f} ms   base / {v} = {ratio:.3f}")


if __name__ == "__main__":
    main()
