"""Prefix caching: the block store (keys, reference counts, LRU eviction under a budget) and the engine with the
cache on giving exactly what it gives with the cache off: greedy and seeded sampling, concurrent requests, requests
sharing a prompt admitted together, and a budget so small that blocks are evicted all the time."""
import random
from functools import partial

import pytest
import torch
from conftest import TINY_MODEL, random_model

from minigpt.infer.engine import Engine
from minigpt.infer.generate import generate_tokens
from minigpt.infer.kv_cache import SlotKVCache
from minigpt.infer.prefix_cache import PrefixCache, block_hashes
from minigpt.infer.sampling import SamplingParams

SHAPE = dict(vocab_size=320, **{**TINY_MODEL, "max_seq_len": 128})
tiny_model = partial(random_model, SHAPE, noise=0.5)  # varied greedy text, unlike a plain init
B = 8  # block size of these tests: prompts of a few dozen tokens span several blocks


def drain(req):
    out = []
    while not req.inbox.empty():
        out.append(req.inbox.get())
    return [t for e in out for t in e.token_ids], out[-1]


def shared_prompts(n, seed=0, prefix_len=37):
    """``n`` prompts opening with one ``prefix_len``-token "system prompt", then 1 to 20 tokens of their own."""
    rng = random.Random(seed)
    system = [rng.randrange(2, 320) for _ in range(prefix_len)]
    return [system + [rng.randrange(2, 320) for _ in range(rng.randrange(1, 20))] for _ in range(n)]


def run(model, prompts, params, **engine_kw):
    """Submit everything at once and drain: (token lists, engine)."""
    engine = Engine(model, stop_ids=[], block_size=B, **engine_kw)
    reqs = [engine.submit(p, pp) for p, pp in zip(prompts, params)]
    engine.run_until_idle()
    return [drain(r)[0] for r in reqs], engine


def run_in_rounds(model, rounds, make_params, **engine_kw):
    """One engine, several rounds of requests, each submitted after the previous round ended (so later rounds
    find earlier prompts and answers in the cache)."""
    engine = Engine(model, stop_ids=[], block_size=B, **engine_kw)
    out = []
    for prompts in rounds:
        reqs = [engine.submit(p, make_params(i)) for i, p in enumerate(prompts)]
        engine.run_until_idle()
        out.append([drain(r)[0] for r in reqs])
    if engine.prefix is not None:
        engine.prefix.check()
    return out, engine


def hits(engine):
    return engine.metrics.prefix_cache_hit_tokens.value()


# ------------------------------------------------------------------------------------------------ the block store
def store(budget_blocks, block=4, layers=2, heads=2, head_dim=4):
    c = PrefixCache(layers, heads, head_dim, torch.float32, "cpu", 0, block)
    c.__init__(layers, heads, head_dim, torch.float32, "cpu", budget_blocks * c.block_bytes, block)
    slots = SlotKVCache(layers, 2, heads, 64, head_dim)
    slots.k.normal_()
    slots.v.normal_()
    return c, slots


def test_blocks_are_keyed_by_the_whole_prefix_and_the_namespace():
    a = block_hashes(list(range(20)), 4)
    assert len(a) == 5 and block_hashes(list(range(19)), 4) == a[:4]
    assert block_hashes([99] + list(range(1, 20)), 4)[1] != a[1]  # same block tokens, other prefix: other key
    assert block_hashes(list(range(20)), 4, namespace=1)[0] != a[0]  # another adapter: other keys
    assert block_hashes(list(range(20)), 4, start=2, previous=a[:2]) == a


def test_insert_match_load_round_trip_copies_the_keys_and_values():
    c, slots = store(8)
    tokens = list(range(10))  # two full blocks and a partial one
    keys = c.hashes(tokens)
    assert c.insert(tokens, keys, slots, 0, owner=1) == 2 and c.n_blocks == 2
    c.release(1)
    found = c.match(tokens + [5, 5], c.hashes(tokens + [5, 5]), owner=2)
    assert len(found) == 2
    assert c.load(found, slots, 1) == 8
    assert torch.equal(slots.k[:, 1, :, :8], slots.k[:, 0, :, :8]) and torch.equal(slots.v[:, 1, :, :8],
                                                                                    slots.v[:, 0, :, :8])
    assert c.peek([0, 1, 2, 3, 9, 9, 9, 9], c.hashes([0, 1, 2, 3, 9, 9, 9, 9])) == 1
    c.check()


def test_eviction_is_lru_from_the_leaves_and_never_touches_held_blocks():
    c, slots = store(3)
    a, b = [1] * 8, [1] * 4 + [2] * 4  # share their first block
    c.insert(a, c.hashes(a), slots, 0, owner=1)
    c.insert(b, c.hashes(b), slots, 0, owner=2)
    c.check()
    assert c.n_blocks == 3
    c.release(1)
    c.release(2)
    c.match(b, c.hashes(b), owner=3)  # b's leaf is now the most recently used
    c.release(3)
    d = [7] * 4
    c.insert(d, c.hashes(d), slots, 0, owner=4)  # room for one: a's leaf goes (LRU), not the shared root
    assert c.peek(a, c.hashes(a)) == 1 and c.peek(b, c.hashes(b)) == 2 and c.evictions == 1
    c.check()
    # Everything held: nothing can go, the new block is not cached.
    e = [8] * 4
    c.match(b, c.hashes(b), owner=5)
    assert c.insert(e, c.hashes(e), slots, 0, owner=6) == 0 and c.peek(e, c.hashes(e)) == 0
    c.check()
    # A root with a child is referenced by it: the leaf goes first, then the root.
    c.release(4)
    c.release(5)
    c.clear()
    assert c.n_blocks == 0
    c.check()


def test_a_hash_collision_is_a_miss_not_a_wrong_hit():
    c, slots = store(4)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    c.insert(a, c.hashes(a), slots, 0, owner=1)
    assert c.peek(b, c.hashes(a)) == 0 and c.match(b, c.hashes(a), owner=2) == []
    assert c.insert(b, c.hashes(a), slots, 1, owner=2) == 0  # b under a's key: left alone
    c.check()


# ------------------------------------------------------------------------------------------------ the engine
@pytest.mark.parametrize("budget", [None, 3 * 1024], ids=["default", "evicting"])
def test_greedy_outputs_equal_cache_off_concurrent_and_across_rounds(budget):
    model = tiny_model()
    rounds = [shared_prompts(6, seed=1), shared_prompts(6, seed=1)[::-1], shared_prompts(4, seed=2)]
    params = lambda i: SamplingParams(max_tokens=12, temperature=0)  # noqa: E731
    on, engine = run_in_rounds(model, rounds, params, max_batch_size=3, prefix_cache_bytes=budget)
    off, _ = run_in_rounds(model, rounds, params, max_batch_size=3, prefix_cache_bytes=0)
    assert on == off
    for prompts, outs in zip(rounds, on):
        for p, out in zip(prompts, outs):
            assert out == list(generate_tokens(model, p, SamplingParams(max_tokens=12, temperature=0)))
    assert hits(engine) > 0
    if budget is not None:
        assert engine.prefix.evictions > 0 and engine.prefix.nbytes <= budget


def test_seeded_sampling_equals_cache_off():
    model = tiny_model()
    rounds = [shared_prompts(5, seed=3), shared_prompts(5, seed=3)]
    params = lambda i: SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=100 + i)  # noqa: E731
    on, engine = run_in_rounds(model, rounds, params, max_batch_size=4)
    off, _ = run_in_rounds(model, rounds, params, max_batch_size=4, prefix_cache_bytes=0)
    assert on == off and on[0] == on[1]
    assert hits(engine) >= sum(len(p) - 1 for p in rounds[1]) - len(rounds[1]) * B  # round 2 almost all cached


def test_requests_sharing_a_prompt_admitted_together_prefill_it_once():
    """``n`` samples of one prompt: the first is prefilled, the others copy its slot in the same step."""
    model = tiny_model()
    prompt = shared_prompts(1, seed=4)[0]
    for budget in (None, 0):  # also with the cache off: the copy comes from the sibling's slot
        engine = Engine(model, stop_ids=[], block_size=B, max_batch_size=4, prefix_cache_bytes=budget)
        reqs = [engine.submit(prompt, SamplingParams(max_tokens=8, temperature=0.9, seed=i)) for i in range(4)]
        engine.step()
        assert hits(engine) == 3 * (len(prompt) - 1)
        assert engine.metrics.prompt_tokens.value() == 4 * len(prompt)
        engine.run_until_idle()
        for i, req in enumerate(reqs):
            alone = list(generate_tokens(model, prompt, SamplingParams(max_tokens=8, temperature=0.9, seed=i)))
            assert drain(req)[0] == alone


# The fast path, and models that run their own forward (the prefill's gaps between cached and new columns).
VARIANTS = [{}, {"pos_encoding": "alibi"}, {"pos_encoding": "learned"}, {"sliding_window": 12},
            {"n_experts": 4, "n_experts_per_token": 2}]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) or "rope")
def test_one_prefill_mixing_cached_and_uncached_rows(variant):
    """Rows with different cached lengths (a hit, a sibling copy, nothing) share one forward."""
    model = tiny_model(**variant)
    prompts = shared_prompts(3, seed=5, prefix_len=30)
    engine = Engine(model, stop_ids=[], block_size=B, max_batch_size=4)
    first = engine.submit(prompts[0], SamplingParams(max_tokens=4, temperature=0))
    engine.run_until_idle()
    fresh = [9] * 5 + prompts[1][5:]  # shares nothing
    later = [engine.submit(p, SamplingParams(max_tokens=10, temperature=0)) for p in (prompts[1], fresh, prompts[2])]
    engine.run_until_idle()
    assert drain(first)[0] == list(generate_tokens(model, prompts[0], SamplingParams(max_tokens=4, temperature=0)))
    for req, p in zip(later, (prompts[1], fresh, prompts[2])):
        assert drain(req)[0] == list(generate_tokens(model, p, SamplingParams(max_tokens=10, temperature=0)))
    assert hits(engine) >= 2 * 24


def test_a_whole_prompt_in_the_cache_still_prefills_its_last_token():
    model = tiny_model()
    prompt = list(range(3, 3 + 4 * B))  # exactly four blocks
    out, engine = run_in_rounds(model, [[prompt], [prompt]], lambda i: SamplingParams(max_tokens=5, temperature=0))
    assert out[0] == out[1] and hits(engine) == len(prompt) - 1


def test_metrics_expose_the_hit_rate():
    model = tiny_model()
    prompt = shared_prompts(1, seed=6)[0]
    _, engine = run_in_rounds(model, [[prompt], [prompt]], lambda i: SamplingParams(max_tokens=3, temperature=0))
    text = engine.metrics.render()
    rate = (len(prompt) - 1) / (2 * len(prompt))
    assert f"minigpt_prefix_cache_hit_rate {rate!r}" in text
    assert "minigpt_prefix_cache_bytes " in text and "minigpt_prefix_cache_hit_tokens_total" in text


def test_prompt_logprobs_are_computed_whole_even_when_the_prompt_is_cached():
    """``echo`` scores need every prompt position's logits: such a request is prefilled whole, cache or not."""
    model = tiny_model()
    prompt = shared_prompts(1, seed=7)[0]
    scored = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    engine = Engine(model, stop_ids=[], block_size=B, max_batch_size=2)
    first = engine.submit(prompt, SamplingParams(max_tokens=2, temperature=0))
    engine.run_until_idle()
    before = hits(engine)
    req = engine.submit(prompt, scored)
    engine.run_until_idle()
    events = []
    while not req.inbox.empty():
        events.append(req.inbox.get())
    assert hits(engine) == before and drain(first)[0] == [t for e in events for t in e.token_ids]
    off = Engine(model, stop_ids=[], block_size=B, max_batch_size=2, prefix_cache_bytes=0)
    ref = off.submit(prompt, scored)
    off.run_until_idle()
    ref_events = []
    while not ref.inbox.empty():
        ref_events.append(ref.inbox.get())
    got, want = events[0].prompt_logprobs, ref_events[0].prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=1e-5)
