"""Greedy decoding through the int8 screen of a float LM head (minigpt.infer.fastpath.screen): the error bound
holds for every row, a certified token is the float argmax, an uncertifiable one is answered -1 and resolved from
the full logits, and compiled greedy generation gives the logits step's tokens (on a real checkpoint too)."""
import copy
import json

import pytest
import torch
from conftest import TINY_MODEL, random_model

from minigpt.infer.fastpath import FastPath, decode_linear, prepare
from minigpt.infer.fastpath.screen import SCREEN_K, HeadScreen, build_screen, resolve, screened_argmax
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_the_bound_covers_every_rows_error(scale):
    """|h . w_i - a_i| <= e_i for every row, with the exact product in float64 and ``a`` the screen's own float32
    product (its int8 words, as the compiled step reads them), over heads and hidden states of several
    magnitudes with outlier features; the bound is not vacuous (within 100x of the largest error)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3000, 96, generator=gen) * 0.05
    w[:, 7] *= 20  # an outlier column
    sc = HeadScreen(w)
    assert sc.proj.words is not None
    for trial in range(8):
        h = torch.randn(4, 96, generator=gen) * scale
        h[:, trial % 96] *= 50
        exact = h.double() @ w.double().T
        a = decode_linear(sc.proj, h[:, None])[:, 0].double()
        e = (h.norm(dim=-1, keepdim=True) * sc.bound).double()
        err = (a - exact).abs()
        assert (err <= e).all() and err.max() > 0 and e.max() < 100 * err.max()


def test_certified_tokens_are_the_float_argmax_and_near_ties_fall_back():
    """Random heads: every answer is -1 or the float argmax, most are certified. A head whose rows are copies of
    one row plus noise far below the screen's resolution cannot be certified (more than SCREEN_K rows reach the
    maximum): -1, and :func:`resolve` then gives the full logits' argmax."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(4000, 64, generator=gen)
    h = torch.randn(3, 5, 64, generator=gen)
    sc = HeadScreen(w)
    got = screened_argmax(w, sc.proj, sc.bound, h)
    want = (h @ w.T).argmax(-1)
    assert got.shape == want.shape and got.dtype == torch.int64
    assert ((got == want) | (got == -1)).all() and (got == want).float().mean() > 0.5

    twins = torch.randn(1, 64, generator=gen).repeat(500, 1) + 1e-4 * torch.randn(500, 64, generator=gen)
    sc = HeadScreen(twins)
    got = screened_argmax(twins, sc.proj, sc.bound, h)
    assert (got == -1).all()
    assert torch.equal(resolve(got, h, twins), (h @ twins.T).argmax(-1))


def test_no_screen_for_quantized_small_or_biased_heads():
    from minigpt.infer.fastpath import Proj

    w = torch.randn(SCREEN_K * 4, 32)
    assert build_screen(Proj(w[:SCREEN_K])) is None  # no fewer rows to read
    assert build_screen(Proj(w, bias=torch.zeros(w.shape[0]))) is None
    assert build_screen(Proj(w.to(torch.int8), scale=torch.ones(w.shape[0]))) is None
    assert build_screen(Proj(w)) is not None


GREEDY = SamplingParams(max_tokens=32, temperature=0)


@pytest.mark.slow
def test_compiled_greedy_generation_through_the_screen_gives_the_logits_steps_tokens():
    """A tiny fp32 model (vocab larger than SCREEN_K), compiled without a cache: 32 greedy tokens through
    decode_next equal those of the logits step, and the screen was used (its greedy step compiled)."""
    model = random_model(dict(TINY_MODEL, vocab_size=400), seed=3, noise=0.5)
    with_screen = prepare(copy.deepcopy(model), compile=True)
    with_screen.compile_cache = False
    without = FastPath(copy.deepcopy(model), compile=True, screen=False)
    without.compile_cache = False
    assert with_screen.screen is None  # built at the first greedy step
    assert with_screen.head_screen() is not None and without.head_screen() is None
    with torch.inference_mode():
        got = list(generate_tokens(with_screen, [5, 9, 2], GREEDY))
        want = list(generate_tokens(without, [5, 9, 2], GREEDY))
    assert got == want and len(set(want)) > 4
    assert any(key[-1] for key in with_screen._steps) and not any(key[-1] for key in without._steps)


def test_screened_greedy_equals_the_reference_on_stories260k(shared_data):
    """Karpathy's trained stories260K (vocab 512, dim 64), fp32, compiled: 64 greedy tokens from BOS through the
    screen equal the reference continuation shipped with the checkpoint."""
    folder = shared_data / "models" / "stories260K"
    if not (folder / "hf" / "config.json").is_file():
        pytest.skip(f"stories260K is not in {folder}")
    from minigpt.checkpoint.native import load_model

    ref = json.loads((folder / "reference_outputs.json").read_text())["greedy"]["generated_ids"]
    fp = prepare(load_model(folder / "hf"), compile=True)
    fp.compile_cache = False
    assert fp.head_screen() is not None
    n = min(64, len(ref))
    with torch.inference_mode():
        got = list(generate_tokens(fp, [1], SamplingParams(max_tokens=n, temperature=0)))
    assert got == ref[:n]


def test_the_greedy_step_has_its_own_saved_file_name():
    """The greedy and logits steps of one FastPath are different programs: their saved files (and packages)
    must not share a name, or a later process would load the one in place of the other."""
    from minigpt.infer.fastpath.aot import step_key

    fp = prepare(random_model(dict(TINY_MODEL, vocab_size=400), seed=3), compile=True)
    assert fp.head_screen() is not None
    cache = fp.new_kv_cache(1, 16)
    args = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
            cache.k, cache.v)
    assert step_key(fp, 1, 1, None, args, greedy=True) != step_key(fp, 1, 1, None, args)
    assert step_key(fp, 1, 1, 16, args, greedy=True) != step_key(fp, 1, 1, 16, args)
    assert step_key(fp, 1, 1, 16, args) == step_key(fp, 1, 1, 16, args, greedy=False)


@pytest.mark.slow
def test_a_failed_ahead_of_time_compile_is_not_retried_for_the_other_step(tmp_path, failing_aot_compile):
    """When the AOT API fails for the greedy step, the logits step goes straight to torch.compile too: one try,
    one warning, both steps' tokens as without the screen."""
    tries = failing_aot_compile
    model = random_model(dict(TINY_MODEL, vocab_size=400), seed=3, noise=0.5)
    fp = prepare(copy.deepcopy(model), compile=True)
    fp.compile_cache = tmp_path
    assert fp.head_screen() is not None
    with pytest.warns(RuntimeWarning, match="ahead-of-time compilation failed") as caught:
        with torch.inference_mode():
            got = list(generate_tokens(fp, [5, 9, 2], GREEDY))
            cache = fp.new_kv_cache(1, 8)
            fp(torch.tensor([[5, 9]]), 0, cache)
            logits = fp.decode_step(torch.tensor([[2]]), 2, cache)
    assert len(tries) == 1 and sum("ahead-of-time" in str(w.message) for w in caught) == 1
    assert fp.compile_sources == {"jit": 2} and set(fp._step_fns) == {True, False}
    with torch.inference_mode():
        assert got == list(generate_tokens(prepare(copy.deepcopy(model)), [5, 9, 2], GREEDY))
        torch.testing.assert_close(logits, model(torch.tensor([[5, 9, 2]]))[:, -1], atol=1e-4, rtol=0)


def test_building_the_screen_counts_as_set_up_not_decoding(monkeypatch):
    """The screen's build (on a machine's first greedy call it builds its C++ kernel, ~16 s) is added to
    compile_seconds, which --stats subtracts from the decode time, once."""
    import time

    from minigpt.infer.fastpath import wrapper

    real = wrapper.build_screen
    monkeypatch.setattr(wrapper, "build_screen", lambda head: (time.sleep(0.2), real(head))[1])
    fp = prepare(random_model(dict(TINY_MODEL, vocab_size=400), seed=3), compile=True)
    assert fp.compile_seconds == 0.0
    assert fp.head_screen() is not None and fp.compile_seconds >= 0.2
    spent = fp.compile_seconds
    assert fp.head_screen() is not None and fp.compile_seconds == spent
