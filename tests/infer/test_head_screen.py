"""Greedy decoding through the int8 screen of a float LM head (minigpt.infer.fastpath.screen): the error bound
holds for every row, a certified token is the float argmax, an uncertifiable one is answered -1 and resolved from
the full logits, and compiled greedy generation gives the logits step's tokens (on a real checkpoint too)."""
import copy
import json

import pytest
import torch
from conftest import TINY_MODEL, random_model

from minigpt.infer.fastpath import decode_linear, prepare
from minigpt.infer.fastpath.library import w8a8_available, w8a8_layout
from minigpt.infer.fastpath.screen import SCREEN_K, HeadScreen, build_screen, resolve, screened_argmax
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams

needs_vnni = pytest.mark.skipif(not w8a8_available(), reason="the screen's int8 product needs AVX512-VNNI")


def _screen(w: torch.Tensor) -> HeadScreen:
    sc = HeadScreen(w)
    assert w8a8_layout(sc.proj)
    return sc


@needs_vnni
@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_the_bound_covers_every_rows_error(scale):
    """|h . w_i - a_i| <= e_i for every row, with the exact product in float64, over heads and hidden states of
    several magnitudes, one with an outlier feature (which coarsens the activations' rounding step)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3000, 96, generator=gen) * 0.05
    w[:, 7] *= 20  # an outlier column
    sc = _screen(w)
    for trial in range(8):
        h = torch.randn(4, 96, generator=gen) * scale
        h[:, trial % 96] *= 50
        exact = h.double() @ w.double().T
        a = decode_linear(sc.proj, h[:, None], w8a8=True)[:, 0].double()
        s_h = h.abs().amax(-1, keepdim=True) / 127
        e = (h.norm(dim=-1, keepdim=True) * sc.bound + s_h * sc.spread).double()
        assert ((a - exact).abs() <= e).all()
        assert (a - exact).abs().max() > 0  # the screen does round


def test_the_weight_only_screen_certifies_the_float_argmax():
    """Without VNNI the screen multiplies its int8 weights by float activations (the step's int8 loops read
    them as words); eagerly that is the dequantized product, whose error the same bound covers."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(2000, 64, generator=gen)
    h = torch.randn(2, 3, 64, generator=gen)
    sc = HeadScreen(w, w8a8=False)
    assert sc.proj.words is not None and not sc.w8a8
    exact = h.double() @ w.double().T
    a = (h @ (sc.proj.weight.float() * sc.proj.scale[:, None]).T).double()
    e = (h.norm(dim=-1, keepdim=True) * sc.bound).double()  # the weight term alone bounds it here
    assert ((a - exact).abs() <= e).all()
    got = screened_argmax(w, sc.proj, sc.bound, sc.spread, h, w8a8=False)
    assert ((got == exact.argmax(-1)) | (got == -1)).all() and (got >= 0).any()


@needs_vnni
def test_certified_tokens_are_the_float_argmax_and_near_ties_fall_back():
    """Random heads: every answer is -1 or the float argmax. A head whose rows are copies of one row plus noise far
    below the screen's resolution cannot be certified (more than SCREEN_K rows reach the maximum): -1, and
    :func:`resolve` then gives the full logits' argmax."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(4000, 64, generator=gen)
    h = torch.randn(3, 5, 64, generator=gen)
    sc = _screen(w)
    got = screened_argmax(w, sc.proj, sc.bound, sc.spread, h)
    want = (h @ w.T).argmax(-1)
    assert got.shape == want.shape and got.dtype == torch.int64
    assert ((got == want) | (got == -1)).all() and (got == want).float().mean() > 0.5

    twins = torch.randn(1, 64, generator=gen).repeat(500, 1) + 1e-4 * torch.randn(500, 64, generator=gen)
    sc = _screen(twins)
    got = screened_argmax(twins, sc.proj, sc.bound, sc.spread, h)
    assert (got == -1).all()
    assert torch.equal(resolve(got, h, twins), (h @ twins.T).argmax(-1))


def test_no_screen_for_quantized_small_or_biased_heads():
    from minigpt.infer.fastpath import Proj

    w = torch.randn(SCREEN_K * 4, 32)
    assert build_screen(Proj(w), enabled=False) is None
    assert build_screen(Proj(w[:SCREEN_K]), enabled=True) is None  # no fewer rows to read
    assert build_screen(Proj(w, bias=torch.zeros(w.shape[0])), enabled=True) is None
    assert build_screen(Proj(w.to(torch.int8), scale=torch.ones(w.shape[0])), enabled=True) is None
    assert build_screen(Proj(w), enabled=True) is not None


GREEDY = SamplingParams(max_tokens=32, temperature=0)


@pytest.mark.parametrize("woq_kernel", ["auto", "words"])
def test_compiled_greedy_generation_through_the_screen_gives_the_logits_steps_tokens(woq_kernel):
    """A tiny fp32 model (vocab larger than SCREEN_K), compiled without a cache: 32 greedy tokens through
    decode_next equal those of the logits step, and the screen was used (its greedy step compiled): int8 x int8
    where the CPU has AVX512-VNNI, and (``words``, as on other CPUs) int8 weights on float activations."""
    model = random_model(dict(TINY_MODEL, vocab_size=400), seed=3, noise=0.5)
    with_screen = prepare(copy.deepcopy(model), compile=True, woq_kernel=woq_kernel)
    with_screen.compile_cache = False
    without = prepare(copy.deepcopy(model), compile=True)
    without.compile_cache, without.screen = False, None
    assert with_screen.screen is not None
    assert with_screen.screen.w8a8 == (woq_kernel == "auto" and w8a8_available())
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
    assert fp.screen is not None
    n = min(64, len(ref))
    with torch.inference_mode():
        got = list(generate_tokens(fp, [1], SamplingParams(max_tokens=n, temperature=0)))
    assert got == ref[:n]


def test_the_greedy_step_has_its_own_saved_file_name():
    """The greedy and logits steps of one FastPath are different programs: their saved files (and packages)
    must not share a name, or a later process would load the one in place of the other."""
    from minigpt.infer.fastpath.aot import step_key

    fp = prepare(random_model(dict(TINY_MODEL, vocab_size=400), seed=3), compile=True)
    assert fp.screen is not None
    cache = fp.new_kv_cache(1, 16)
    args = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
            cache.k, cache.v)
    assert step_key(fp, 1, 1, None, args, greedy=True) != step_key(fp, 1, 1, None, args)
    assert step_key(fp, 1, 1, 16, args, greedy=True) != step_key(fp, 1, 1, 16, args)
    assert step_key(fp, 1, 1, 16, args) == step_key(fp, 1, 1, 16, args, greedy=False)
