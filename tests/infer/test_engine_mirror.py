"""Running requests decode over a mirror of their slots (minigpt.infer.mirror, `serve --compile`): alone, or up to
``mirror_rows`` together, right-aligned with left padding; the same tokens as each prompt alone while requests join,
leave, share prefixes, sample or are cancelled.

Most tests run the mirror's bookkeeping with the FastPath's steps eager (``compiled`` switched off after the engine
is built: the same function over the same mirror cache, no compilation); one slow test runs the compiled step."""
from functools import partial

import pytest
import torch
from conftest import TINY_MODEL, random_model

from minigpt.infer.engine import Engine
from minigpt.infer.fastpath import FastPath
from minigpt.infer.generate import generate_tokens
from minigpt.infer.kv_cache import LayerKVCache
from minigpt.infer.mirror import MirrorDecode, batch_sizes, plain_greedy
from minigpt.infer.sampling import SamplingParams

SHAPE = dict(vocab_size=320, **{**TINY_MODEL, "max_seq_len": 512})
tiny_model = partial(random_model, SHAPE, noise=0.3)  # weights far from init: every cached column matters


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0)


def events_of(req):
    out = []
    while not req.inbox.empty():
        out.append(req.inbox.get())
    return out


def tokens_of(req):
    return [t for e in events_of(req) for t in e.token_ids]


def logprobs_of(req):
    """The chosen tokens' logprobs (to 4 decimals): they move with any cached key or value."""
    return [(lp.token_id, round(lp.logprob, 4)) for e in events_of(req) for lp in e.logprobs]


def mirror_engine(model, **kw):
    """An engine over ``model``'s compiled FastPath whose steps then run eagerly; returns it and a list that
    collects the steps run through the mirror: a lone request's length, or the lengths of a group's requests."""
    engine = Engine(FastPath(model, compile=True, screen=False), stop_ids=[], **kw)
    assert engine.mirror is not None
    engine.model.compiled = False
    steps = []
    decode = engine.mirror.decode

    def spy(reqs):
        lengths = reqs[0].length if len(reqs) == 1 else tuple(r.length for r in reqs)
        out = decode(reqs)  # raising, it would fall back to the eager batch: only steps that ran are counted
        steps.append(lengths)
        assert isinstance(engine.mirror.cache, LayerKVCache)
        return out

    engine.mirror.decode = spy
    return engine, steps


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 320, (n,), generator=g).tolist()


# 256 columns, doubled when the request passed them; over a step that serves every length (as an AOTInductor
# package's) 256 columns for the 250-token prompt, then 320 (kv_cache.fitted_length), not 512.
@pytest.mark.parametrize("fitted, grown_to", [(False, 512), (True, 320)], ids=["powers-of-two", "fitted"])
def test_a_lone_request_decodes_in_the_mirror_which_grows_past_256_columns(fitted, grown_to, monkeypatch):
    if fitted:
        monkeypatch.setattr(FastPath, "any_cache_length", property(lambda self: True))
    model = tiny_model()
    engine, steps = mirror_engine(model, max_batch_size=2)
    p = prompt(250)
    req = engine.submit(p, greedy(20))
    engine.run_until_idle()
    assert tokens_of(req) == list(generate_tokens(model, p, greedy(20)))
    assert steps == list(range(250, 269)), "every step after the first token ran through the mirror"
    assert engine.mirror.cache.max_seq_len == grown_to


def test_the_slot_is_synced_before_others_join_and_before_the_prefix_cache_remembers():
    """A decodes alone, B joins (batched steps read A's slot), B leaves (A alone again: the mirror is refilled from
    the slot), A ends (the prefix cache keeps its columns, decoded in the mirror), then C, whose prompt is A's
    prompt and answer, reuses those columns."""
    model = tiny_model()
    engine, steps = mirror_engine(model, max_batch_size=2, block_size=4)
    pa, pb = prompt(30, 1), prompt(12, 2)
    a = engine.submit(pa, greedy(40))
    for _ in range(10):
        engine.step()
    b = engine.submit(pb, greedy(8))
    engine.run_until_idle()
    out_a, out_b = tokens_of(a), tokens_of(b)
    assert out_a == list(generate_tokens(model, pa, greedy(40)))
    assert out_b == list(generate_tokens(model, pb, greedy(8)))
    # A alone at lengths 30..39; with B (prefilled, then 7 batched steps) at 40..46; alone again from 47 to its end.
    assert steps == list(range(30, 40)) + list(range(47, 69))

    pc = pa + out_a[:-1]
    runs = []
    for e in (engine, Engine(model, stop_ids=[], prefix_cache_bytes=0)):
        c = e.submit(pc, SamplingParams(max_tokens=6, temperature=0, logprobs=0))
        e.run_until_idle()
        runs.append(logprobs_of(c))
        if e is engine:
            assert c.cached > len(pa), "C's prompt reused columns that A decoded in the mirror"
    assert runs[0] == runs[1]


def test_seeded_sampling_and_logprobs_through_the_mirror_match_the_batched_engine():
    model = tiny_model()
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, seed=7, logprobs=2)
    p = prompt(20, 3)
    runs = []
    for engine in (Engine(model, stop_ids=[]), mirror_engine(model)[0]):
        req = engine.submit(p, params)
        engine.run_until_idle()
        runs.append(logprobs_of(req))
    assert runs[0] == runs[1]
    assert not plain_greedy(req)


def test_a_cancelled_lone_request_frees_its_slot_for_the_next():
    model = tiny_model()
    engine, steps = mirror_engine(model, max_batch_size=1)
    a = engine.submit(prompt(10, 4), greedy(50))
    for _ in range(5):
        engine.step()
    engine.cancel(a)
    p = prompt(8, 5)
    b = engine.submit(p, greedy(10))
    engine.run_until_idle()
    assert a.finish_reason == "cancelled"
    assert tokens_of(b) == list(generate_tokens(model, p, greedy(10)))
    assert steps[-9:] == list(range(8, 17))


def test_adapters_or_an_uncompiled_model_keep_the_batched_path():
    model = tiny_model()
    assert Engine(model).mirror is None
    assert Engine(FastPath(model)).mirror is None
    with pytest.raises(ValueError, match="compile=True"):
        MirrorDecode(FastPath(model), Engine(model).cache, 64)


@pytest.mark.slow
def test_the_compiled_step_serves_a_lone_request_as_the_eager_engine():
    model = tiny_model()
    engine = Engine(FastPath(model, compile=True), stop_ids=[], max_batch_size=2)
    assert engine.warm_up() > 0
    p = prompt(40, 6)
    req = engine.submit(p, greedy(24))
    engine.run_until_idle()
    assert tokens_of(req) == list(generate_tokens(model, p, greedy(24)))
    assert engine.mirror.cache is not None and engine.model.compile_sources


def test_batch_sizes_are_powers_of_two_then_the_most_rows():
    assert batch_sizes(1) == (1,)
    assert batch_sizes(4) == (1, 2, 4)
    assert batch_sizes(6) == (1, 2, 4, 6)
    with pytest.raises(ValueError, match="at least 1"):
        batch_sizes(0)


def test_up_to_mirror_rows_requests_decode_together_right_aligned():
    """Three requests of different lengths join one by one (rows 1, 2, then 3 in a batch of 4 with a spare row),
    a fourth pushes the running set past ``mirror_rows`` (the eager batch), and they leave one by one: every answer
    is the prompt's own, and the group steps ran with the rows at their own lengths."""
    model = tiny_model()
    engine, steps = mirror_engine(model, max_batch_size=4, mirror_rows=3)
    assert engine.mirror.sizes == (1, 2, 3)
    lengths, budgets = (30, 9, 17, 5), (30, 24, 12, 6)
    prompts = [prompt(n, 10 + i) for i, n in enumerate(lengths)]
    reqs = []
    for p, n in zip(prompts, budgets):
        reqs.append(engine.submit(p, greedy(n)))
        for _ in range(4):
            engine.step()
    engine.run_until_idle()
    for req, p, n in zip(reqs, prompts, budgets):
        assert tokens_of(req) == list(generate_tokens(model, p, greedy(n)))
    groups = [s for s in steps if isinstance(s, tuple)]
    assert {len(g) for g in groups} == {2, 3}, "steps of two and of three rows went through the mirror"
    assert any(len(set(g)) == len(g) for g in groups), "rows of different lengths in one step"
    assert len(steps) < sum(budgets) - len(budgets), "some steps (four running) decoded in the eager batch"


def test_sampled_and_greedy_rows_together_match_the_batched_engine():
    """A seeded sampled request with logprobs and a greedy one in one group (the logits step, each row's own
    generator) give what the eager engine gives them, logprobs to 4 decimals."""
    model = tiny_model()
    sampled = SamplingParams(max_tokens=14, temperature=0.9, top_k=50, seed=7, logprobs=2)
    plain = SamplingParams(max_tokens=10, temperature=0, logprobs=0)
    pa, pb = prompt(21, 3), prompt(6, 4)
    runs = []
    for engine in (Engine(model, stop_ids=[]), mirror_engine(model, mirror_rows=2)[0]):
        a = engine.submit(pa, sampled)
        engine.step()
        b = engine.submit(pb, plain)
        engine.run_until_idle()
        runs.append((logprobs_of(a), logprobs_of(b)))
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_compiled_steps_serve_requests_together_as_the_eager_engine():
    """The compiled steps of batch 1 and 2 (the greedy one through the head screen, the logits one for a sampled
    row) over the right-aligned mirror give the eager engine's tokens."""
    model = tiny_model()
    engine = Engine(FastPath(model, compile=True), stop_ids=[], max_batch_size=2, mirror_rows=2)
    assert engine.warm_up() > 0
    groups = []
    decode = engine.mirror.decode

    def spy(reqs):
        out = decode(reqs)
        groups.append(len(reqs))
        return out

    engine.mirror.decode = spy
    sampled = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, seed=3)
    for params in (greedy(12), sampled):
        pa, pb = prompt(40, 6), prompt(13, 7)
        a = engine.submit(pa, greedy(24))
        engine.step()
        b = engine.submit(pb, params)
        engine.run_until_idle()
        assert tokens_of(a) == list(generate_tokens(model, pa, greedy(24)))
        assert tokens_of(b) == list(generate_tokens(model, pb, params))
    assert groups.count(2) >= 18 and engine.model.compile_sources
