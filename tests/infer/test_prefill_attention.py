"""The fast path's causal prefill attention as blocked oneDNN GEMMs (fastpath.prefill_attention): SDPA's result to
float32 rounding for every head layout, block split, batch and cache offset, keys past the new positions never
read; taken by a FastPath prefill exactly where it is wanted, with the model's logits. Speed: docs/benchmarks.md."""
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model

from minigpt.infer.fastpath import kernels, prefill_attention, prepare

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(not kernels._onednn_linear_available(), reason="this torch has no oneDNN linear")
SHAPE = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96, multiple_of=16)
make = partial(random_model, SHAPE, noise=0.02, norm_noise=0.1)


def _reference(q, keys, values, start_pos):
    """float64 attention of queries at start_pos.. over keys 0..start_pos + t (the definition)."""
    batch, seq_len, n_heads, head_dim = q.shape
    end = start_pos + seq_len
    rep = n_heads // keys.shape[1]
    k = keys[:, :, :end].double().repeat_interleave(rep, dim=1)
    v = values[:, :, :end].double().repeat_interleave(rep, dim=1)
    allowed = torch.ones(seq_len, end, dtype=torch.bool).tril(start_pos)
    return F.scaled_dot_product_attention(q.double().transpose(1, 2), k, v, attn_mask=allowed).transpose(1, 2)


@pytest.mark.parametrize("n_heads, n_kv, seq_len, start_pos, batch", [
    (9, 3, 70, 0, 1), (4, 4, 64, 0, 2), (4, 1, 33, 0, 1), (6, 2, 40, 25, 2), (2, 2, 1, 7, 1), (4, 2, 17, 0, 3)])
def test_blocked_gemms_give_causal_attention_and_never_read_past_the_new_positions(monkeypatch, n_heads, n_kv,
                                                                                   seq_len, start_pos, batch):
    monkeypatch.setattr(prefill_attention, "QUERY_BLOCK", 16)  # several blocks, a short last one
    gen = torch.Generator().manual_seed(seq_len + start_pos)
    q = torch.randn(batch, seq_len, n_heads, 32, generator=gen)
    kv_len = start_pos + seq_len + 5
    keys, values = (torch.randn(batch, n_kv, kv_len, 32, generator=gen) for _ in range(2))
    keys[:, :, start_pos + seq_len:] = float("nan")  # the cache's unwritten columns: never read
    values[:, :, start_pos + seq_len:] = float("nan")
    got = prefill_attention.causal_attention(q, keys, values, 32 ** -0.5, start_pos)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(q, keys, values, start_pos), atol=2e-6, rtol=2e-6)


AVX512 = frozenset({"avx2", "avx512f"})


@pytest.mark.parametrize("setting, dtype, seq_len, grad, flags, want", [
    ("onednn", torch.float32, 256, False, AVX512, True), ("onednn", torch.float32, 255, False, AVX512, False),
    ("mkl", torch.float32, 512, False, AVX512, False), ("onednn", torch.bfloat16, 512, False, AVX512, False),
    ("onednn", torch.float32, 512, True, AVX512, False), ("onednn", torch.float32, 512, False, {"avx2"}, False)])
def test_it_is_wanted_for_long_float32_prefills_where_float32_products_go_to_onednn_on_avx512(
        monkeypatch, setting, dtype, seq_len, grad, flags, want):
    """Without AVX-512 (an AVX2-only CPU, or $ATEN_CPU_CAPABILITY=avx2) SDPA's flash kernel is the faster."""
    monkeypatch.setenv(kernels.FP32_GEMM_ENV, setting)
    monkeypatch.setattr(prefill_attention, "cpu_flags", lambda: flags)
    q = torch.zeros(1, seq_len, 4, 16, dtype=dtype, requires_grad=grad)
    assert prefill_attention.wanted(q, seq_len) is want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fast_path_prefill_takes_it_and_gives_the_models_logits(monkeypatch, dtype):
    """A plain causal prefill and a second chunk after it (start_pos > 0) go through the kernel, a padded batch
    does not; the logits are the model's own (its eager forward) to float32 rounding."""
    monkeypatch.setenv(kernels.FP32_GEMM_ENV, "onednn")
    monkeypatch.setattr(prefill_attention, "cpu_flags", lambda: AVX512)  # the kernel on any CPU: its numbers
    monkeypatch.setattr(prefill_attention, "MIN_TOKENS", 8)
    monkeypatch.setattr(prefill_attention, "QUERY_BLOCK", 16)
    calls = []
    real = prefill_attention.causal_attention
    monkeypatch.setattr(prefill_attention, "causal_attention", lambda *a: calls.append(a[-1]) or real(*a))
    model = make().to(dtype)
    fp = prepare(model)
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, 60), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(tokens).float()
        cache = fp.new_kv_cache(1, 60)
        first = fp(tokens[:, :40], 0, cache)
        second = fp(tokens[:, 40:], 40, cache)
        assert calls == [0] * SHAPE["n_layers"] + [40] * SHAPE["n_layers"]
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
        torch.testing.assert_close(torch.cat([first, second], 1).float(), want, **tol)
        calls.clear()
        mask = torch.ones(2, 40, dtype=torch.long)
        mask[1, :5] = 0
        fp(tokens[:, :40].repeat(2, 1), 0, fp.new_kv_cache(2, 40), attention_mask=mask)
        assert calls == []
