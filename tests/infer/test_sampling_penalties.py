"""Logits adjustments (penalties, logit_bias, min_p), log-probabilities, and the engine's per-request sampling
state: seeds under load, the logits-processor hook, stop_token_ids, prompt logprobs equal to the model's."""
import math
from functools import partial

import pytest
import torch
from conftest import TINY_MODEL, random_model

from minigpt.infer.engine import Engine
from minigpt.infer.sampling import (
    InvalidRequest,
    SamplingParams,
    process_logits,
    prompt_logprobs,
    sampling_probs,
    token_logprobs,
)

SHAPE = dict(vocab_size=320, **{**TINY_MODEL, "max_seq_len": 128})
tiny_model = partial(random_model, SHAPE, noise=0.5)


def events_of(req):
    out = []
    while not req.inbox.empty():
        out.append(req.inbox.get())
    return out


def tokens_of(events):
    return [t for e in events for t in e.token_ids]


def test_penalties_and_bias_on_a_hand_computed_case():
    """logits [1, -1, 2, 0, 3], prompt [3], output [1, 1, 2]: the CTRL repetition penalty divides the positive and
    multiplies the negative logits of tokens 1, 2, 3 (prompt and output); OpenAI's penalties subtract
    count * frequency + presence for tokens 1 (twice) and 2 (once); logit_bias adds to token 4."""
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.0, 3.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0, logit_bias={4: -10})
    out = process_logits(logits, [p], [[3]], [[1, 1, 2]])
    expected = [1.0,                   # token 0: never seen
                -1.0 * 2 - 2 * 0.5 - 1.0,  # token 1: negative -> * 2, then two occurrences
                2.0 / 2 - 0.5 - 1.0,   # token 2: positive -> / 2, one occurrence
                0.0,                   # token 3: in the prompt only: 0 stays 0, no frequency/presence
                3.0 - 10]              # token 4: bias
    assert out[0].tolist() == pytest.approx(expected)
    assert logits[0].tolist() == [1.0, -1.0, 2.0, 0.0, 3.0]  # the input is not modified


def test_rows_are_independent_and_nothing_asked_returns_the_same_tensor():
    logits = torch.randn(3, 16)
    plain = SamplingParams()
    assert process_logits(logits, [plain] * 3, [[1]] * 3, [[2]] * 3) is logits
    params = [plain, SamplingParams(presence_penalty=-2), SamplingParams(logit_bias={7: 100})]
    out = process_logits(logits, params, [[1], [1], [1]], [[2, 2], [2, 2], []])
    assert torch.equal(out[0], logits[0])
    assert out[1, 2] == pytest.approx(float(logits[1, 2]) + 2) and torch.equal(out[1, :2], logits[1, :2])
    assert out[2].argmax() == 7


def test_repetition_penalty_and_min_p_match_transformers():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    logits = torch.randn(2, 50) * 3
    seen = [[3, 4, 4, 9], [0, 49]]
    ours = process_logits(logits, [SamplingParams(repetition_penalty=1.7)] * 2, [s[:2] for s in seen],
                          [s[2:] for s in seen])
    theirs = transformers.RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[3, 4, 4, 9], [0, 49, 0, 49]]),
                                                                logits.clone())
    torch.testing.assert_close(ours, theirs)
    # min_p after the temperature, as transformers' warper order and vLLM have it.
    params = SamplingParams(temperature=0.7, min_p=0.2)
    warped = transformers.MinPLogitsWarper(0.2)(None, logits / 0.7)
    torch.testing.assert_close(sampling_probs(logits, params), torch.softmax(warped, dim=-1))


def test_logprobs_are_the_raw_log_softmax():
    torch.manual_seed(1)
    logits = torch.randn(3, 20)
    got = token_logprobs(logits, [4, 0, 19], [2, 0, 5])
    logp = torch.log_softmax(logits, dim=-1)
    for row, entry in enumerate(got):
        assert entry.logprob == pytest.approx(float(logp[row, entry.token_id]), abs=1e-6)
        top = logp[row].topk(len(entry.top))
        assert [i for i, _ in entry.top] == top.indices.tolist()
    assert [len(e.top) for e in got] == [2, 0, 5]
    scored = prompt_logprobs(logits, [7, 4, 0], 1)
    assert scored[0] is None and scored[1].token_id == 4
    assert scored[2].logprob == pytest.approx(float(logp[1, 0]), abs=1e-6)  # row t predicts token t + 1


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", True),
    ("repetition_penalty", 1e-300), ("repetition_penalty", 1e300), ("min_p", 1.1),
    ("logit_bias", {5: 101}), ("logit_bias", {-1: 1}), ("logit_bias", {"5": 1}), ("stop_token_ids", (-1,)),
    ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 1.0),
])
def test_new_sampling_fields_refuse_out_of_range_values(field, value):
    with pytest.raises(InvalidRequest, match=field) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_engine_greedy_with_penalties_equals_a_reference_loop():
    """Each request's penalties see its own prompt and output only, also batched with others."""
    model = tiny_model()
    prompts = [[5, 6, 7, 5], [9, 9, 9], [11, 12]]
    params = [SamplingParams(max_tokens=12, temperature=0, frequency_penalty=1.5, presence_penalty=0.5),
              SamplingParams(max_tokens=12, temperature=0, repetition_penalty=3.0, logit_bias={3: 2.5}),
              SamplingParams(max_tokens=12, temperature=0)]
    engine = Engine(model, max_batch_size=3, stop_ids=[])
    reqs = [engine.submit(p, s) for p, s in zip(prompts, params)]
    engine.run_until_idle()
    for req, prompt, p in zip(reqs, prompts, params):
        out: list[int] = []
        with torch.no_grad():
            for _ in range(p.max_tokens):
                logits = model(torch.tensor([prompt + out]))[:, -1]
                out.append(int(process_logits(logits, [p], [prompt], [out]).argmax()))
        assert tokens_of(events_of(req)) == out


def test_seeded_sampling_is_the_same_alone_and_under_load():
    model = tiny_model()
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, min_p=0.05, presence_penalty=0.3, seed=42)

    def run(n_others: int) -> list[int]:
        engine = Engine(model, max_batch_size=4, stop_ids=[])
        others = [engine.submit([3 + i] * (i + 2), SamplingParams(max_tokens=5 + 3 * i, temperature=1.2))
                  for i in range(n_others)]
        req = engine.submit([5, 6, 7], params)
        later = [engine.submit([8, 9], SamplingParams(max_tokens=9, temperature=0.8)) for _ in range(n_others)]
        engine.run_until_idle()
        assert all(events_of(r)[-1].finish_reason == "length" for r in others + later)
        return tokens_of(events_of(req))

    alone = run(0)
    assert len(alone) == 20
    assert run(0) == alone and run(3) == alone and run(6) == alone
    engine = Engine(model, max_batch_size=4, stop_ids=[])
    other = engine.submit([5, 6, 7], params.replace(seed=43))
    engine.run_until_idle()
    assert tokens_of(events_of(other)) != alone


def test_logits_processor_hook_and_stop_token_ids():
    """A request's processors see its generated ids and change only its row; one that raises fails only its
    request; stop_token_ids end a generation like EOS (the id is not part of the text)."""
    model = tiny_model()
    seen: list[list[int]] = []

    def only_even(ids, logits):
        seen.append(list(ids))
        logits[1::2] = -math.inf
        return logits

    def broken(ids, logits):
        raise RuntimeError("grammar bug")

    engine = Engine(model, max_batch_size=3, stop_ids=[])
    greedy = SamplingParams(max_tokens=8, temperature=0)
    masked = engine.submit([5, 6], greedy, logits_processors=[only_even])
    sampled = engine.submit([5, 6], greedy.replace(temperature=1.0, seed=0), logits_processors=[only_even])
    failing = engine.submit([5, 6], greedy, logits_processors=[broken])
    plain = engine.submit([5, 6], greedy)
    engine.run_until_idle()
    out = tokens_of(events_of(masked))
    assert len(out) == 8 and all(t % 2 == 0 for t in out)
    assert all(t % 2 == 0 for t in tokens_of(events_of(sampled)))
    assert seen[0] == [] and [5, 6] not in seen and any(len(s) == 7 for s in seen)
    last = events_of(failing)[-1]
    assert last.finish_reason == "error" and "grammar bug" in last.error
    free = tokens_of(events_of(plain))
    assert any(t % 2 for t in free), "the unmasked request is not restricted"
    # stop_token_ids: stop at the plain request's 3rd token.
    engine = Engine(model, max_batch_size=2, stop_ids=[])
    stopped = engine.submit([5, 6], greedy.replace(stop_token_ids=[free[2]]))
    engine.run_until_idle()
    events = events_of(stopped)
    assert tokens_of(events) == free[:free.index(free[2])] and events[-1].finish_reason == "stop"


def test_engine_logprobs_equal_the_models_log_softmax():
    """Generated tokens' logprobs (with their alternatives) and prompt logprobs are the model's own log-softmax
    of a full forward, within 1e-5 in float32, whatever the sampling settings."""
    model = tiny_model()
    prompt = [4, 17, 9, 33, 2]
    params = SamplingParams(max_tokens=6, temperature=0.5, seed=3, logprobs=3, prompt_logprobs=2,
                            frequency_penalty=1.0)
    engine = Engine(model, max_batch_size=2, stop_ids=[])
    req = engine.submit(prompt, params)
    engine.submit([1, 2, 3], SamplingParams(max_tokens=4))  # a batch-mate
    engine.run_until_idle()
    events = events_of(req)
    out = tokens_of(events)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + out]))[0].float(), dim=-1)
    entries = [e for ev in events for e in ev.logprobs]
    assert [e.token_id for e in entries] == out
    for i, e in enumerate(entries):
        row = logp[len(prompt) - 1 + i]
        assert e.logprob == pytest.approx(float(row[e.token_id]), abs=1e-5)
        assert [t for t, _ in e.top] == row.topk(3).indices.tolist()
    first = events[0].prompt_logprobs
    assert first[0] is None and len(first) == len(prompt)
    for t in range(1, len(prompt)):
        assert first[t].token_id == prompt[t]
        assert first[t].logprob == pytest.approx(float(logp[t - 1, prompt[t]]), abs=1e-5)
        assert len(first[t].top) == 2
    assert all(ev.prompt_logprobs is None for ev in events[1:])


def test_engine_equals_generate_tokens_with_every_adjustment_and_a_seed():
    """The engine and the one-prompt loop apply the same adjustments in the same order, so a seeded request with
    penalties, bias, min_p and stop_token_ids draws the same tokens in both."""
    from minigpt.infer.generate import generate_tokens

    model = tiny_model()
    prompt = [7, 8, 9, 7, 8]
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=5, presence_penalty=0.7, frequency_penalty=0.2,
                            repetition_penalty=1.3, min_p=0.02, logit_bias={3: 1.5})
    expected = list(generate_tokens(model, prompt, params))
    assert len(expected) == 16
    engine = Engine(model, max_batch_size=2, stop_ids=[])
    req = engine.submit(prompt, params)
    engine.submit([1, 2], SamplingParams(max_tokens=10, temperature=1.0))
    engine.run_until_idle()
    assert tokens_of(events_of(req)) == expected
    stop_at = params.replace(stop_token_ids=[expected[4]])
    assert list(generate_tokens(model, prompt, stop_at)) == expected[:expected.index(expected[4])]
