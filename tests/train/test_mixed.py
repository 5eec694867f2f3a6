"""Emulated bf16 mixed precision (minigpt.train.mixed): the numerics of bf16 autocast with fp32 kernels -- a linear layer
is exactly a bf16 GEMM with float32 accumulation, and a training step's loss and gradients are as close to
torch.autocast's as two bf16 runs can be."""
import pytest
import torch
import torch.nn.functional as F

from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer, lm_loss
from minigpt.train.config import TrainerConfig
from minigpt.train.mixed import (
    EmulatedBf16,
    Float32Attention,
    autocast,
    compute_dtype,
    float32_attention_wanted,
    native_bf16,
    training_dtype,
)

torch.set_num_threads(1)


def test_emulated_linear_is_a_bf16_gemm_with_fp32_accumulation():
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 3, 64), torch.randn(24, 64), torch.randn(24)
    with EmulatedBf16():
        y = F.linear(x, w, b)
    assert y.dtype == torch.bfloat16
    # Reference: bf16 operands, products and sums in float64 (exact enough), one final rounding to bf16.
    ref = F.linear(x.bfloat16().double(), w.bfloat16().double(), b.bfloat16().double())
    assert torch.equal(y, ref.to(torch.bfloat16)) or (y.float() - ref.float()).abs().max() <= 2 ** -7 * ref.abs().max()


def test_emulated_bf16_training_step_matches_torch_autocast():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                                    multiple_of=16))
    x, y = torch.randint(0, 97, (4, 32)), torch.randint(0, 97, (4, 32))

    def step(ctx):
        model.zero_grad()
        with ctx:
            loss = lm_loss(model(x), y)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss32, g32 = step(torch.autocast("cpu", enabled=False))
    loss_ac, g_ac = step(torch.autocast("cpu", dtype=torch.bfloat16))
    loss_em, g_em = step(EmulatedBf16())
    assert abs(loss_em - loss32) < 1e-3 and abs(loss_em - loss_ac) < 1e-3
    for name in g32:
        assert g_em[name].dtype == torch.float32
        err_em = ((g_em[name] - g32[name]).norm() / g32[name].norm()).item()
        err_ac = ((g_ac[name] - g32[name]).norm() / g32[name].norm()).item()
        # Both are bf16 computations: errors of the same order (bf16 has 2^-8 relative precision).
        assert err_em < 3 * err_ac + 2e-3, (name, err_em, err_ac)


def test_policy_selection():
    assert compute_dtype("cpu", torch.float32) == torch.float32
    if native_bf16("cpu"):
        assert compute_dtype("cpu", torch.bfloat16) == torch.bfloat16
        wanted = Float32Attention if float32_attention_wanted("cpu") else torch.autocast
        assert type(autocast("cpu", torch.bfloat16)) is wanted
    else:
        assert compute_dtype("cpu", torch.bfloat16) == torch.float32
        assert isinstance(autocast("cpu", torch.bfloat16), EmulatedBf16)
    assert isinstance(autocast("cpu", torch.bfloat16, emulate=True), EmulatedBf16)


def test_auto_dtype_is_bf16_only_where_the_cpu_runs_it_natively(monkeypatch):
    import minigpt.train.mixed as mixed

    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(mixed, "native_bf16", lambda device_type="cpu", _n=native: _n)
        assert training_dtype("auto", "cpu") == expected
    assert training_dtype("float32", "cpu") == torch.float32
    assert training_dtype("bfloat16", "cpu") == torch.bfloat16  # asked for by name: emulated if need be
    TrainerConfig(max_steps=1, dtype="auto")
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        TrainerConfig(max_steps=1, dtype="fp8")


def test_emulated_bf16_trains_an_alibi_model():
    """ALiBi's additive bias reaches SDPA as a bf16 float mask; the float32 kernel of the emulation refused it
    (``Expected attn_mask dtype to be bool or float``), so bf16 training of such a model failed on AVX2 CPUs."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                                    multiple_of=16, pos_encoding="alibi"))
    x, y = torch.randint(0, 97, (2, 24)), torch.randint(0, 97, (2, 24))
    losses = []
    for ctx in (torch.autocast("cpu", dtype=torch.bfloat16), EmulatedBf16()):
        with ctx:
            loss = lm_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 1e-2


def _attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_float32_attention_computes_compiled_attention_in_float32_and_leaves_eager_calls_alone():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 48, 16).bfloat16() for h in (4, 2, 2))
    as_float32 = _attend(q.float(), k.float(), v.float()).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        as_bf16 = _attend(q, k, v)
    assert not torch.equal(as_float32, as_bf16)  # else the test could not tell them apart
    torch._dynamo.reset()
    with autocast("cpu", torch.bfloat16, emulate=False, float32_attention=True) as ctx:
        assert isinstance(ctx, Float32Attention) and torch.is_autocast_enabled("cpu")
        assert torch.equal(torch.compile(_attend, backend="eager", fullgraph=True)(q, k, v), as_float32)
        assert torch.equal(_attend(q, k, v), as_bf16)
        assert F.linear(q.float(), torch.randn(8, 16)).dtype == torch.bfloat16  # autocast's, as before
    assert not torch.is_autocast_enabled("cpu")


def test_compiled_attention_runs_in_float32_only_on_cpus_with_native_bf16_but_no_amx(monkeypatch):
    import minigpt.train.mixed as mixed

    for native, flags, wanted in ((True, {"avx512_bf16"}, True), (True, {"avx512_bf16", "amx_bf16"}, False),
                                  (False, set(), False)):
        monkeypatch.setattr(mixed, "native_bf16", lambda device_type="cpu", _n=native: _n)
        monkeypatch.setattr(mixed, "cpu_flags", lambda _f=frozenset(flags): _f)
        assert mixed.float32_attention_wanted("cpu") is wanted
        ctx = autocast("cpu", torch.bfloat16)
        assert type(ctx) is (Float32Attention if wanted else torch.autocast if native else EmulatedBf16)
    assert not mixed.float32_attention_wanted("cuda")
    assert type(autocast("cpu", torch.bfloat16, emulate=False, float32_attention=False)) is torch.autocast
