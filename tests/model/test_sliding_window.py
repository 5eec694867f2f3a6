"""Sliding-window attention (``ModelConfig.sliding_window``, Mistral's): the mask is transformers' rule, the three
attention implementations agree on it (values and gradients), and every way of running a model keeps it: cached
decoding, the serving engine's rows of different lengths (gapped cache columns), packed training rows and the
inference fast path's fallback.
Parity with transformers' Mistral and Qwen2 is in tests/interop/test_architectures.py."""
import dataclasses
import random
from functools import partial

import pytest
import torch
from conftest import random_model

from minigpt.infer.engine import Engine
from minigpt.infer.fastpath import FastPath, supports
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.model.attention import causal_mask, padded_causal_mask
from minigpt.model.transformer import Transformer
from minigpt.posttrain.packing import packed_forward

torch.set_num_threads(1)

WINDOW = 5
SHAPE = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48, sliding_window=WINDOW)
random_model = partial(random_model, SHAPE, noise=0.3, norm_noise=0.1)


def test_mask_is_transformers_sliding_window_rule():
    masking = pytest.importorskip("transformers.masking_utils", reason="transformers is a test-only dependency")
    rule = masking.sliding_window_causal_mask_function(WINDOW)
    for q_len, kv_len in ((12, 12), (1, 12), (4, 12), (1, 3)):
        offset = kv_len - q_len  # the queries are the last q_len positions
        zero = torch.tensor(0)
        expected = rule(zero, zero, torch.arange(q_len)[:, None] + offset, torch.arange(kv_len)[None, :])
        assert torch.equal(causal_mask(q_len, kv_len, window=WINDOW), expected), (q_len, kv_len)
        # a query sees itself and the WINDOW - 1 keys before it
        assert causal_mask(q_len, kv_len, window=WINDOW).sum(-1).tolist() == \
            [min(WINDOW, offset + i + 1) for i in range(q_len)]


def with_config(model: Transformer, **changes) -> Transformer:
    other = Transformer(dataclasses.replace(model.config, **changes)).eval()
    other.load_state_dict(model.state_dict())
    return other


def test_implementations_agree_in_values_and_gradients():
    model = random_model()
    tokens = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(0))
    results = []
    for impl in ("sdpa", "naive", "flash_reference"):
        m = with_config(model, attention_impl=impl, attention_block_size=8)
        m.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        results.append((m(tokens).detach(), m.layers[0].attention.wq.weight.grad))
    for logits, grad in results[1:]:
        torch.testing.assert_close(logits, results[0][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(grad, results[0][1], atol=1e-5, rtol=1e-4)
    # and the window is in effect: full attention is another function
    assert (with_config(model, sliding_window=None)(tokens) - results[0][0]).abs().max() > 1e-2


@torch.no_grad()
def test_cached_decoding_equals_the_whole_sequence():
    model = random_model()
    tokens = torch.randint(0, 61, (1, 30), generator=torch.Generator().manual_seed(1))
    cache = model.new_kv_cache(1, 30)
    steps = [model(tokens[:, :3], 0, cache)] + [model(tokens[:, i:i + 1], i, cache) for i in range(3, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), model(tokens), atol=1e-5, rtol=0)


@torch.no_grad()
def test_window_counts_tokens_not_cache_columns():
    """The serving engine decodes rows of different lengths together: a short row's new token sits at the batch's
    common column, after a gap of padding columns. Its window must count its own tokens, as if it ran alone."""
    model = random_model()
    row = torch.randint(0, 61, (1, 14), generator=torch.Generator().manual_seed(2))
    alone = model(row)[0, -1]
    gap = 6  # columns 13 .. 18 are padding, the last token goes to column 19
    cache = model.new_kv_cache(1, 20)
    prompt = torch.cat([row[:, :13], torch.zeros(1, gap, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 13), torch.zeros(1, gap)], dim=1).long()
    model(prompt, 0, cache, mask)
    last = model(row[:, 13:], 13 + gap, cache, torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], dim=1))[0, -1]
    torch.testing.assert_close(last, alone, atol=1e-5, rtol=0)
    # the mask itself: the new token sees its own WINDOW tokens, none of the padding
    allowed = padded_causal_mask(torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], dim=1), 1, WINDOW)
    assert allowed[0, 0, 0].nonzero().flatten().tolist() == [9, 10, 11, 12, 19]


def test_engine_rows_of_different_lengths_equal_each_alone():
    model = random_model()
    engine = Engine(model, max_batch_size=3, stop_ids=[])
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 61) for _ in range(n)] for n in (3, 17, 9, 12, 6)]
    greedy = SamplingParams(max_tokens=20, temperature=0)
    reqs = [engine.submit(p, greedy) for p in prompts]
    engine.run_until_idle()
    for req, prompt in zip(reqs, prompts):
        events = []
        while not req.inbox.empty():
            events.append(req.inbox.get())
        assert [t for e in events for t in e.token_ids] == list(generate_tokens(model, prompt, greedy))


@torch.no_grad()
def test_packed_rows_keep_the_window():
    model = random_model()
    a, b = (torch.randint(0, 61, (n,), generator=torch.Generator().manual_seed(n)) for n in (17, 12))
    tokens = torch.cat([a, b])[None]
    position_ids = torch.cat([torch.arange(17), torch.arange(12)])[None]
    doc_ids = torch.cat([torch.zeros(17), torch.ones(12)]).long()[None]
    packed = packed_forward(model, tokens, position_ids, doc_ids)[0]
    torch.testing.assert_close(packed[:17], model(a[None])[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[17:], model(b[None])[0], atol=1e-5, rtol=0)


@torch.no_grad()
def test_fast_path_hands_a_sliding_model_to_its_forward():
    model = random_model()
    assert supports(model.config) == "sliding-window attention"
    fast = FastPath(model, compile=True)
    assert fast.reason == "sliding-window attention" and not fast.compiled
    tokens = torch.randint(0, 61, (1, 20), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(fast(tokens), model(tokens), atol=0, rtol=0)
    # a window covering the whole context is full attention, which the fast path computes itself
    wide = random_model(sliding_window=SHAPE["max_seq_len"])
    assert supports(wide.config) is None
    expected = with_config(wide, sliding_window=None)(tokens)
    torch.testing.assert_close(FastPath(wide)(tokens), expected, atol=1e-5, rtol=0)
