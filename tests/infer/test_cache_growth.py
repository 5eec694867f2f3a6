"""A generation whose compiled step serves every cache length starts its cache at the prompt and grows it as the
positions fill it (generate.grown_cache_for): the same tokens as with the whole cache at once, the held columns
carried over, a bucket or a quarter more columns each time, and the whole length at once for a step that serves
one length. The compiled case (an AOTInductor package, minutes to build) is in test_compile_aoti.py and
test_native.py, in the slow stage."""
import pytest
import torch
from conftest import random_model

from minigpt.infer.fastpath import FastPath, LayerKVCache
from minigpt.infer.generate import generate_tokens, grown_cache_for
from minigpt.infer.kv_cache import fitted_length
from minigpt.infer.sampling import SamplingParams
from minigpt.model.kv_cache import KVCache

SHAPE = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=1024, multiple_of=16)


@pytest.mark.parametrize("kind", [KVCache, LayerKVCache])
def test_copy_prefix_carries_the_first_columns_of_every_layer_and_row_and_nothing_else(kind):
    short, long = kind(3, 2, 2, 8, 4), kind(3, 2, 2, 20, 4)
    for t in list(short.k) + list(short.v):
        t.normal_()
    long.copy_prefix(short, 5)
    for a, b in zip(list(short.k) + list(short.v), list(long.k) + list(long.v)):
        assert torch.equal(b[:, :, :5], a[:, :, :5])
        assert not b[:, :, 5:].any()
    with pytest.raises(ValueError, match="cannot copy 9 positions"):
        long.copy_prefix(short, 9)
    with pytest.raises(ValueError, match="cannot copy a cache of 3 layers"):
        kind(3, 1, 2, 20, 4).copy_prefix(short, 2)


def test_fitted_lengths_round_up_to_64_columns_or_a_quarter_of_the_power_of_two_below():
    assert [fitted_length(n) for n in (1, 64, 65, 256, 257, 511, 513, 1024, 1025, 3000)] == \
        [64, 64, 128, 256, 320, 512, 640, 1024, 1280, 3072]
    for n in range(1, 5000, 7):
        assert n <= fitted_length(n) <= max(n + 63, n * 1.25)


def test_a_step_that_serves_every_length_grows_by_a_bucket_or_a_quarter_and_one_that_does_not_takes_all(tmp_path):
    fp = FastPath(random_model(SHAPE, noise=0.5), compile=True, aoti=True, compile_cache=tmp_path)
    assert fp.any_cache_length  # nothing compiled yet: the package it is about to build serves every length
    lengths, cache = [], fp.new_kv_cache(1, 2)
    for t in cache.k + cache.v:
        t.normal_()
    first = [t.clone() for t in cache.k + cache.v]
    while cache.max_seq_len < 900:
        pos = cache.max_seq_len
        cache = grown_cache_for(fp, cache, pos, 900)
        lengths.append(cache.max_seq_len)
    # 64 columns at a time up to 512, then 128 (a quarter of 512); at most the 900 asked, rounded up to the bucket
    assert lengths == [128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 960]
    for before, after in zip(first, cache.k + cache.v):
        assert torch.equal(after[:, :, :64], before) and not after[:, :, 64:].any()
    assert not FastPath(random_model(SHAPE), compile=True, aoti=True, compile_cache=False).any_cache_length
    assert not FastPath(random_model(SHAPE), compile=True, aoti=False).any_cache_length
    assert not FastPath(random_model(SHAPE)).any_cache_length
    eager = FastPath(random_model(SHAPE))
    assert grown_cache_for(eager, eager.new_kv_cache(1, 10), 10, 300).max_seq_len == 300


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=150, temperature=0),
                                    SamplingParams(max_tokens=150, temperature=0.9, top_k=20, seed=3)],
                         ids=["greedy", "sampled"])
def test_a_grown_cache_gives_the_tokens_of_the_whole_cache(params, monkeypatch):
    """The eager fast path, told that its step serves every length, grows its cache the compiled way: the
    tokens, and the lengths it went through."""
    fp = FastPath(random_model(SHAPE, noise=0.5))
    prompt = [3, 14, 15, 9, 26]
    whole = list(generate_tokens(fp, prompt, params))
    lengths, real = [], FastPath.new_kv_cache

    def spy(self, batch, length=None, dtype=None):
        lengths.append(length)
        return real(self, batch, length, dtype)

    monkeypatch.setattr(FastPath, "any_cache_length", property(lambda self: True))
    monkeypatch.setattr(FastPath, "new_kv_cache", spy)
    assert list(generate_tokens(fp, prompt, params)) == whole and len(set(whole)) > 5
    assert lengths == [6, 64, 128, 155]  # prompt + 1 (eager: not rounded up), then fitted_length, capped
    lengths.clear()
    given = real(fp, 1, 155)  # a caller's cache is used as it is
    assert list(generate_tokens(fp, prompt, params, cache=given)) == whole and lengths == []
