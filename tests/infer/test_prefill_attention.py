"""The fast path's causal prefill attention (fastpath.prefill_attention), as blocked oneDNN GEMMs (AVX-512 CPUs) and
as MiniGPT's flash kernel (minigpt::causal_attention, AVX2 CPUs without AVX-512): the definition's result to float32
rounding for every head layout, head size, block split, batch and cache offset, keys past the new positions never
read; taken by a FastPath prefill exactly where it is wanted, with the model's logits. Speed: docs/benchmarks.md."""
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model

from minigpt.infer.fastpath import kernels, prefill_attention, prepare

torch.set_num_threads(1)

needs_onednn = pytest.mark.skipif(not kernels._onednn_linear_available(), reason="this torch has no oneDNN linear")
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


@needs_onednn
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


@needs_onednn
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


@needs_onednn
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


def _needs_flash_kernel():
    if prefill_attention.attention_kernel() != "avx2":
        pytest.skip("MiniGPT's attention kernel has no AVX2 path here (no AVX2, or the runner library is not built)")


@pytest.mark.parametrize("n_heads, n_kv, head_dim, seq_len, start_pos, batch", [
    (9, 3, 64, 150, 0, 1),  # SmolLM-135M's heads; 3 key blocks, a short last query block
    (4, 4, 32, 64, 0, 2), (4, 1, 16, 33, 0, 1), (8, 2, 128, 20, 70, 2), (2, 2, 64, 1, 7, 1), (4, 2, 48, 17, 0, 3),
    (6, 2, 256, 5, 0, 1), (16, 2, 64, 40, 0, 1),  # 8 heads a group: 128 query rows a task
    (4, 2, 24, 30, 9, 2), (3, 3, 80, 12, 0, 1)])  # head sizes off the vector path: the kernel's plain loops
def test_the_flash_kernel_gives_causal_attention_and_never_reads_past_the_new_positions(n_heads, n_kv, head_dim,
                                                                                       seq_len, start_pos, batch):
    """Within float32 rounding of the float64 definition, as SDPA's float32 kernel is; the queries strided as the
    projection lays them out (a view of the fused q/k/v rows)."""
    _needs_flash_kernel()
    gen = torch.Generator().manual_seed(seq_len + start_pos + head_dim)
    qkv = 2 * torch.randn(batch, seq_len, n_heads + 2 * n_kv, head_dim, generator=gen)
    q = qkv[:, :, :n_heads]
    kv_len = start_pos + seq_len + 5
    keys = 2 * torch.randn(batch, n_kv, kv_len, head_dim, generator=gen)
    values = torch.randn(batch, n_kv, kv_len, head_dim, generator=gen)
    keys[:, :, start_pos + seq_len:] = float("nan")  # the cache's unwritten columns: never read
    values[:, :, start_pos + seq_len:] = float("nan")
    scale = head_dim ** -0.5
    got = prefill_attention.flash_attention(q, keys, values, scale, start_pos)
    assert got.shape == q.shape and got.dtype == torch.float32 and got.is_contiguous()
    # Measured on these cases, largest error against the definition: the kernel 1.1e-6 to 4.6e-6, SDPA's float32
    # kernel on the same inputs 6.3e-7 to 5.2e-6 (session 68).
    torch.testing.assert_close(got.double(), _reference(q, keys, values, start_pos), atol=1e-5, rtol=1e-5)


def test_the_flash_kernel_refuses_what_it_cannot_compute():
    _needs_flash_kernel()
    q = torch.zeros(1, 8, 4, 16)
    with pytest.raises(RuntimeError, match="kv_len 7 is shorter than start_pos"):
        prefill_attention.flash_attention(q, torch.zeros(1, 2, 7, 16), torch.zeros(1, 2, 7, 16), 0.25, 0)
    with pytest.raises(RuntimeError, match="n_kv_heads dividing 4"):
        prefill_attention.flash_attention(q, torch.zeros(1, 3, 8, 16), torch.zeros(1, 3, 8, 16), 0.25, 0)
    with pytest.raises(RuntimeError, match="float32"):
        prefill_attention.flash_attention(q.double(), torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16), 0.25, 0)


AVX2 = frozenset({"avx2", "fma"})


@pytest.mark.parametrize("dtype, seq_len, head_dim, grad, flags, want", [
    (torch.float32, 2, 64, False, AVX2, True), (torch.float32, 512, 128, False, AVX2, True),
    (torch.float32, 1, 64, False, AVX2, False), (torch.bfloat16, 512, 64, False, AVX2, False),
    (torch.float32, 512, 64, True, AVX2, False), (torch.float32, 512, 72, False, AVX2, False),
    (torch.float32, 512, 272, False, AVX2, False), (torch.float32, 512, 64, False, AVX512, False)])
def test_the_flash_kernel_is_wanted_for_float32_prefills_on_cpus_with_avx2_and_without_avx512(
        monkeypatch, dtype, seq_len, head_dim, grad, flags, want):
    _needs_flash_kernel()
    monkeypatch.setattr(prefill_attention, "cpu_flags", lambda: flags)
    q = torch.zeros(1, seq_len, 4, head_dim, dtype=dtype, requires_grad=grad)
    assert prefill_attention.flash_wanted(q, seq_len, 2) is want


def test_a_fast_path_prefill_takes_the_flash_kernel_on_avx2_cpus_and_gives_the_models_logits(monkeypatch):
    """A plain causal prefill and a second chunk after it go through MiniGPT's kernel on a CPU without AVX-512
    (whatever the float32 GEMM library), a padded batch does not; the logits are the model's own to float32
    rounding."""
    _needs_flash_kernel()
    monkeypatch.setattr(prefill_attention, "cpu_flags", lambda: AVX2)
    calls = []
    real = prefill_attention.flash_attention
    monkeypatch.setattr(prefill_attention, "flash_attention", lambda *a: calls.append(a[-1]) or real(*a))
    model = make()
    fp = prepare(model)
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, 90), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(tokens)
        cache = fp.new_kv_cache(1, 90)
        first = fp(tokens[:, :70], 0, cache)
        second = fp(tokens[:, 70:], 70, cache)
        assert calls == [0] * SHAPE["n_layers"] + [70] * SHAPE["n_layers"]
        torch.testing.assert_close(torch.cat([first, second], 1), want, atol=1e-4, rtol=1e-4)
        calls.clear()
        mask = torch.ones(2, 40, dtype=torch.long)
        mask[1, :5] = 0
        fp(tokens[:, :40].repeat(2, 1), 0, fp.new_kv_cache(2, 40), attention_mask=mask)
        assert calls == []
