"""Many LoRA adapters over one base in one engine: each request's output equals serving its adapter's merged model
alone (greedy tokens; fp32 logits within 1e-5), with rows of different adapters in the same forward, and the
prefix cache keeping adapters apart."""
import copy
import random

import pytest
import torch
from conftest import TINY_MODEL, random_model

from minigpt.checkpoint.adapter import load_adapter, read_adapter, save_adapter
from minigpt.infer.engine import Engine
from minigpt.infer.fastpath import FastPath
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import InvalidRequest, SamplingParams
from minigpt.model.lora import WithAdapters, apply_lora, merge_lora

SHAPE = dict(vocab_size=320, **{**TINY_MODEL, "max_seq_len": 128})
# (targets, rank, rslora) of the adapters: different targets and ranks, so the stacks need padding.
ADAPTERS = {"qv": ("q_proj,v_proj", 4, False), "all": ("all-linear", 2, True), "ffn": ("down_proj,up_proj", 3, False)}


def make_adapter(base, targets, rank, rslora, path, seed):
    model = copy.deepcopy(base)
    apply_lora(model, rank, 2 * rank, targets=targets, use_rslora=rslora)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)  # B != 0: the adapter changes the outputs
    return save_adapter(model, path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base, {name: weights}, {name: merged model}) for each architecture variant."""
    out = {}
    for variant in ({}, {"pos_encoding": "alibi"}):
        base = random_model(SHAPE, noise=0.5, **variant)
        weights, merged = {}, {}
        for i, (name, spec) in enumerate(ADAPTERS.items()):
            path = make_adapter(base, *spec, tmp_path_factory.mktemp(name) / "a", seed=i)
            weights[name] = read_adapter(base, path)
            m = copy.deepcopy(base)
            load_adapter(m, path)
            merged[name] = merge_lora(m).eval()
        out["alibi" if variant else "rope"] = (base, weights, merged)
    return out


def tokens(req):
    events = []
    while not req.inbox.empty():
        events.append(req.inbox.get())
    return [t for e in events for t in e.token_ids]


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 320) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


@pytest.mark.parametrize("arch", ["rope", "alibi"])  # the fast path, and a model running its own forward
def test_mixed_adapter_batches_equal_each_merged_model_alone(setup, arch):
    base, weights, merged = setup[arch]
    engine = Engine(copy.deepcopy(base), max_batch_size=4, stop_ids=[], adapters=weights)
    names = [None, "qv", "all", "ffn"] * 3
    ps = prompts(len(names), seed=1)
    reqs = [engine.submit(p, SamplingParams(max_tokens=10, temperature=0), adapter=a) for p, a in zip(ps, names)]
    engine.run_until_idle()
    sizes, _, count = engine.metrics.batch_size.snapshot()
    assert sizes[0][1] < count, "rows of different adapters must have decoded together"
    for req, p, a in zip(reqs, ps, names):
        out = tokens(req)
        ref_model = base if a is None else merged[a]
        assert out == list(generate_tokens(ref_model, p, SamplingParams(max_tokens=10, temperature=0))), a


def test_logits_of_a_mixed_forward_equal_the_merged_models(setup):
    base, weights, merged = setup["rope"]
    engine = Engine(copy.deepcopy(base), max_batch_size=4, stop_ids=[], adapters=weights)
    alone = {None: FastPath(copy.deepcopy(base)), **{a: FastPath(copy.deepcopy(m)) for a, m in merged.items()}}
    x = torch.tensor(prompts(1, seed=2)[0][:12])[None].repeat(4, 1)
    with torch.no_grad():
        for ids in ([0, 1, 2, 3], [2, 2, 2, 2]):
            engine.adapters.set_rows(ids)
            got = engine.model(x)
            for row, i in enumerate(ids):
                ref = alone[None if i == 0 else engine.adapter_names[i - 1]](x)[row]  # same batch shape
                # 1e-5 of the logits' scale (|logits| ~ 10 here): float32 rounding of W + BA vs W x + B(A x).
                torch.testing.assert_close(got[row], ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
        engine.adapters.set_rows([0, 0, 0, 0])
        assert torch.equal(engine.model(x), Engine(copy.deepcopy(base), max_batch_size=1).model(x))


def test_the_prefix_cache_keeps_adapters_apart(setup):
    base, weights, merged = setup["rope"]
    engine = Engine(copy.deepcopy(base), max_batch_size=2, stop_ids=[], adapters=weights, block_size=4)
    p = prompts(1, seed=3)[0] + list(range(2, 30))
    for _ in range(2):  # round 2: each adapter's prompt is in the cache, under its own keys
        reqs = {a: engine.submit(p, SamplingParams(max_tokens=6, temperature=0), adapter=a) for a in (None, "qv")}
        engine.run_until_idle()
        for a, req in reqs.items():
            ref = base if a is None else merged[a]
            assert tokens(req) == list(
                generate_tokens(ref, p, SamplingParams(max_tokens=6, temperature=0)))
    assert engine.metrics.prefix_cache_hit_tokens.value() >= 2 * (len(p) - 4)


def test_an_unknown_adapter_is_refused(setup):
    base, weights, _ = setup["rope"]
    engine = Engine(copy.deepcopy(base), max_batch_size=1, stop_ids=[], adapters=weights)
    with pytest.raises(InvalidRequest) as e:
        engine.submit([1, 2], SamplingParams(max_tokens=2), adapter="nope")
    assert e.value.param == "model" and "nope" in str(e.value)


def test_only_adapted_projections_are_wrapped(setup):
    """Without adapters the fast path's projections are untouched (the single-model path costs nothing); with an
    adapter on q and v only, just the fused qkv projection carries the per-row updates."""
    base, weights, _ = setup["rope"]
    plain = Engine(copy.deepcopy(base), max_batch_size=1)
    assert plain.adapters is None
    assert not any(isinstance(p, WithAdapters) for lw in plain.model.layers for p in (lw.wqkv, lw.wo, lw.w13, lw.w2))
    qv = Engine(copy.deepcopy(base), max_batch_size=1, adapters={"qv": weights["qv"]})
    for lw in qv.model.layers:
        assert isinstance(lw.wqkv, WithAdapters) and not any(isinstance(p, WithAdapters)
                                                               for p in (lw.wo, lw.w13, lw.w2))
