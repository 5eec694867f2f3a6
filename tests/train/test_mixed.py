"""Emulated bf16 mixed precision (minigpt.train.mixed): the numerics of bf16 autocast with fp32 kernels -- a linear layer
is exactly a bf16 GEMM with float32 accumulation, and a training step's loss and gradients are as close to
torch.autocast's as two bf16 runs can be."""
import pytest
import torch
import torch.nn.functional as F

from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer, lm_loss
from minigpt.train.config import TrainerConfig
from minigpt.train.mixed import EmulatedBf16, autocast, compute_dtype, native_bf16, training_dtype

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
        assert isinstance(autocast("cpu", torch.bfloat16), torch.autocast)
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
