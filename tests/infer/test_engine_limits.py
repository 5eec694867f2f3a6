"""The engine's KV cache is sized by `context` and a memory budget, checked before anything is allocated, and
sampling never produces NaN for temperatures or top_p values that underflow (issue 21)."""
import pytest
import torch
from conftest import TINY_MODEL, random_model

from minigpt.errors import MiniGPTError
from minigpt.infer import engine as engine_module
from minigpt.infer.engine import Engine
from minigpt.infer.request import kv_cache_bytes, plan_context
from minigpt.infer.sampling import MIN_TEMPERATURE, SamplingParams, sample, sampling_probs

# A model that claims a long context; its cache for 4 slots would be 4 * 2 layers * 2 * 2 heads * 8 * 4 B = 1 KiB
# per token, 64 MiB in all.
LONG = {**TINY_MODEL, "max_seq_len": 65536}


def test_context_caps_the_kv_cache_and_the_requests():
    engine = Engine(random_model(TINY_MODEL), max_batch_size=4, context=32, stop_ids=[])
    c = engine.model.config
    assert engine.cache.k.shape == (c.n_layers, 4, c.n_kv_heads, 32, c.head_dim)
    assert engine.max_seq_len == 32 and engine.model_context == 64
    assert engine.kv_cache_bytes == kv_cache_bytes(c.n_layers, c.n_kv_heads, c.head_dim, 4, 32, torch.float32)
    assert engine.validate(20, None) == 12  # the rest of the 32-token context
    with pytest.raises(ValueError, match="context of 32"):
        engine.validate(20, 13)


def test_default_context_fits_the_memory_budget():
    per_token = kv_cache_bytes(2, 2, 8, 4, 1, torch.float32)
    engine = Engine(random_model(LONG), max_batch_size=4, memory_budget=per_token * 1000, stop_ids=[])
    assert engine.max_seq_len == 1000 and engine.kv_cache_bytes == per_token * 1000
    assert Engine(random_model(TINY_MODEL), max_batch_size=4, stop_ids=[]).max_seq_len == 64  # fits: the model's


@pytest.mark.parametrize("kwargs, message", [
    ({"context": 65537}, "exceeds the model's context of 65536"),
    ({"context": 1}, "at least 2"),
    ({"context": 4096, "memory_budget": 1 << 20}, "more than the 1.0 MiB budget"),
    ({"memory_budget": 100}, "does not fit"),
])
def test_bad_sizes_are_refused_before_any_allocation(monkeypatch, kwargs, message):
    model = random_model(LONG)

    def no_allocation(*args, **kw):
        raise AssertionError("the KV cache was allocated")

    monkeypatch.setattr(engine_module, "SlotKVCache", no_allocation)
    with pytest.raises(MiniGPTError, match=message):
        Engine(model, max_batch_size=4, stop_ids=[], **kwargs)


def test_plan_context_never_exceeds_the_model():
    assert plan_context(512, 10, None, 10**12) == 512
    assert plan_context(512, 10, None, 1000) == 100
    assert plan_context(512, 10, 300, None) == 300


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-40), SamplingParams(temperature=5e-324), SamplingParams(top_p=5e-324),
    SamplingParams(temperature=5e-324, top_p=5e-324, top_k=3), SamplingParams(temperature=MIN_TEMPERATURE / 2),
])
def test_underflowing_temperature_and_top_p_never_give_nan(params):
    logits = torch.tensor([[30.0, 29.0, -5.0, 0.0], [-1.0, 2.0, 2.5, 0.0]])
    probs = sampling_probs(logits, params)
    assert not probs.isnan().any() and torch.allclose(probs.sum(-1), torch.ones(2))
    assert sample(logits, params, torch.Generator().manual_seed(0)).tolist() == [0, 2]  # the argmax
    assert params.greedy == (params.temperature < MIN_TEMPERATURE)


def test_smallest_sampling_temperature_stays_finite():
    logits = torch.tensor([[30.0, 29.0, -5.0, 0.0]])
    probs = sampling_probs(logits, SamplingParams(temperature=MIN_TEMPERATURE))
    assert not probs.isnan().any() and probs[0, 0] == 1.0
