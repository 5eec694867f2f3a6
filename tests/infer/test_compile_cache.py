"""Ahead-of-time compiled decode steps saved on disk (minigpt.infer.fastpath.aot): a step compiled by one model and
loaded by the next gives the tokens of the eager fast path, holds no weights, and a bad or foreign file is compiled
again rather than trusted."""
from functools import partial

import pytest
import torch
from conftest import random_model

from minigpt.infer import fastpath
from minigpt.infer.fastpath import FastPath, aot
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams

torch.set_num_threads(1)

SHAPE = dict(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, multiple_of=16)
make = partial(random_model, SHAPE, noise=0.05)
GREEDY = SamplingParams(max_tokens=32, temperature=0)
PROMPT = [3, 14, 15, 9, 26]


def greedy_tokens(model, **kw) -> list[int]:
    return list(generate_tokens(FastPath(model, **kw), PROMPT, GREEDY))


def forbid_compiling(monkeypatch):
    def no_compile(*a, **k):
        raise AssertionError("compiled again instead of loading the saved step")

    monkeypatch.setattr(aot, "compile_step", no_compile)


@pytest.mark.slow
def test_saved_step_is_loaded_by_the_next_model_and_gives_the_eager_tokens(tmp_path, monkeypatch):
    eager = greedy_tokens(make())
    first = FastPath(make(), compile=True, compile_cache=tmp_path)
    assert list(generate_tokens(first, PROMPT, GREEDY)) == eager
    assert first.compile_sources == {"saved": 1}
    assert len(list(tmp_path.glob("*.step"))) == 1

    forbid_compiling(monkeypatch)
    again = FastPath(make(), compile=True, compile_cache=tmp_path)
    assert list(generate_tokens(again, PROMPT, GREEDY)) == eager
    assert again.compile_sources == {"loaded": 1}
    # The file holds code, not weights: other weights of the same shapes load it and get their own tokens.
    other = make(seed=1)
    other_eager = greedy_tokens(make(seed=1))
    assert other_eager != eager
    loaded = FastPath(other, compile=True, compile_cache=tmp_path)
    assert list(generate_tokens(loaded, PROMPT, GREEDY)) == other_eager
    assert loaded.compile_sources == {"loaded": 1}


def test_another_shape_precision_or_mode_gets_its_own_file():
    fp = FastPath(make(), compile=True)
    int8 = fastpath.prepare(make(), compile=True, quantize="int8")
    keys = {aot.step_key(fp, 1, 1, 64), aot.step_key(int8, 1, 1, 64), aot.step_key(fp, 2, 1, 64),
            aot.step_key(fp, 1, 4, 64), aot.step_key(fp, 1, 1, 128)}
    with torch.inference_mode():
        keys.add(aot.step_key(fp, 1, 1, 64))
    assert len(keys) == 6
    assert aot.step_key(FastPath(make(seed=3), compile=True), 1, 1, 64) == aot.step_key(fp, 1, 1, 64)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["garbage", "foreign"])
def test_a_corrupt_or_untrusted_file_is_compiled_again(tmp_path, damage):
    eager = greedy_tokens(make())
    first = FastPath(make(), compile=True, compile_cache=tmp_path)
    assert list(generate_tokens(first, PROMPT, GREEDY)) == eager
    (path,) = tmp_path.glob("*.step")
    if damage == "garbage":
        path.write_bytes(b"\x80\x04not a pickle")
    else:
        path.chmod(0o666)  # writable by anyone: never loaded
    with pytest.warns(RuntimeWarning, match="ignoring the saved compiled step"):
        again = FastPath(make(), compile=True, compile_cache=tmp_path)
        assert list(generate_tokens(again, PROMPT, GREEDY)) == eager
    assert again.compile_sources == {"saved": 1}
    assert path.stat().st_mode & 0o022 == 0  # replaced by a private file


@pytest.mark.slow  # a whole in-process compile (~20-30 s on 2 cores); CI's slow stage runs it
def test_cache_off_compiles_in_process(tmp_path, monkeypatch):
    monkeypatch.setenv(aot.ENV, "off")
    assert aot.cache_dir() is None
    fp = FastPath(make(), compile=True)
    assert list(generate_tokens(fp, PROMPT, GREEDY)) == greedy_tokens(make())
    assert fp.compile_sources == {"jit": 1}
    monkeypatch.setenv(aot.ENV, str(tmp_path / "here"))
    assert aot.cache_dir() == tmp_path / "here"


@pytest.mark.slow
def test_a_failed_ahead_of_time_compile_is_not_retried_for_the_next_shape(tmp_path, failing_aot_compile):
    """The AOT API is experimental: when it fails, the FastPath warns once and every shape, this one and the next,
    runs through one ordinary torch.compile'd function that gives the eager tokens."""
    tries = failing_aot_compile
    fp = FastPath(make(), compile=True, compile_cache=tmp_path)
    with pytest.warns(RuntimeWarning, match="ahead-of-time compilation failed") as caught:
        assert list(generate_tokens(fp, PROMPT, GREEDY)) == greedy_tokens(make())
        with torch.inference_mode():
            cache = fp.new_kv_cache(2, 8)
            fp(torch.tensor([PROMPT, PROMPT]), 0, cache)
            two = fp.decode_step(torch.tensor([[4], [4]]), len(PROMPT), cache)
    assert len(tries) == 1 and sum("ahead-of-time" in str(w.message) for w in caught) == 1
    assert fp.compile_sources == {"jit": 2} and len(fp._compiled_shapes) == 2
    with torch.inference_mode():
        want = make()(torch.tensor([PROMPT + [4]]))[:, -1]
    torch.testing.assert_close(two, want.expand(2, -1), atol=1e-4, rtol=0)
    assert not list(tmp_path.glob("*.step"))


def _decode_columns(fp, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """Prefill ``tokens[:, :start]``, then one decode step per remaining column, each token a column *view* of
    ``tokens`` (strides ``(tokens.shape[1], 1)``); the logits ``[batch, steps, vocab]``."""
    cache = fp.new_kv_cache(tokens.shape[0], 64)
    with torch.inference_mode():
        fp(tokens[:, :start], 0, cache)
        return torch.stack([fp.decode_step(tokens[:, i:i + 1], i, cache) for i in range(start, tokens.shape[1])], 1)


@pytest.mark.slow
def test_a_saved_step_is_right_for_token_views_of_other_strides(tmp_path):
    """Found with the w8a8 head's tests: a step saved while decoding column views of a ``[2, 12]`` token matrix,
    loaded for views of a ``[2, 16]`` one (same shapes, other strides), read the wrong tokens -- logits 0.78 off
    (relative), and an index-out-of-bounds error the other way round -- because a saved step runs without Dynamo's
    guards. Tokens are now made contiguous before the step."""
    g = torch.Generator().manual_seed(1)
    short, long = torch.randint(0, 61, (2, 12), generator=g), torch.randint(0, 61, (2, 16), generator=g)
    saved = FastPath(make(), compile=True, compile_cache=tmp_path)
    _decode_columns(saved, short, 6)
    assert saved.compile_sources == {"saved": 1}
    loaded = FastPath(make(), compile=True, compile_cache=tmp_path)
    got = _decode_columns(loaded, long, 8)
    assert loaded.compile_sources == {"loaded": 1}
    want = _decode_columns(FastPath(make()), long, 8)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_weights_of_another_memory_layout_get_their_own_file():
    """Same shapes, one weight stored transposed (a strided view): the compiled code reads memory by strides, so
    the saved step of the contiguous model must not be loaded for it."""
    fp = FastPath(make(), compile=True)
    other = FastPath(make(), compile=True)
    other.final_norm = other.final_norm.clone()
    assert aot.step_key(other, 1, 1, 64) == aot.step_key(fp, 1, 1, 64)
    w = other.layers[0].wo.weight
    other.layers[0].wo.weight = w.T.contiguous().T  # the same values, column-major
    assert torch.equal(other.layers[0].wo.weight, w)
    assert aot.step_key(other, 1, 1, 64) != aot.step_key(fp, 1, 1, 64)


def test_the_arguments_dtypes_are_part_of_the_key():
    """A KV cache of another dtype (``new_kv_cache(dtype=...)``) gets its own step."""
    fp = FastPath(make(), compile=True)
    args = [(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
             [torch.zeros(1, 2, 64, 16, dtype=dt)] * 2, [torch.zeros(1, 2, 64, 16, dtype=dt)] * 2)
            for dt in (torch.float32, torch.bfloat16)]
    keys = {aot.step_key(fp, 1, 1, 64, a) for a in args}
    assert len(keys) == 2 and aot.step_key(fp, 1, 1, 64) not in keys


def test_the_loops_vector_width_by_cpu_and_setting_enters_the_key(monkeypatch):
    """The step's loops are compiled for 256-bit vectors on Intel CPUs with AVX-512 and for 512-bit ones on AMD's
    (the widths measured best on a Xeon and a Zen 4 EPYC, docs/benchmarks.md), the widest under
    ``MINIGPT_STEP_SIMDLEN=native``; a bad value
    is refused by name; the width is part of the saved step's key, so a step saved under one setting is not loaded
    under another."""
    from minigpt.infer.fastpath import step

    monkeypatch.setattr(step, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    monkeypatch.delenv(step.SIMDLEN_ENV, raising=False)
    monkeypatch.setattr(step, "cpu_vendor", lambda: "AuthenticAMD")
    assert step.simd_options() == {"cpp.simdlen": 512}
    monkeypatch.setattr(step, "cpu_vendor", lambda: "GenuineIntel")
    assert step.simd_options() == {"cpp.simdlen": 256}
    fp = FastPath(make(), compile=True)
    default = aot.step_key(fp, 1, 1, 64)
    for value, want in [("512", {"cpp.simdlen": 512}), ("native", {})]:
        monkeypatch.setenv(step.SIMDLEN_ENV, value)
        assert step.simd_options() == want
        assert aot.step_key(fp, 1, 1, 64) != default
    monkeypatch.setenv(step.SIMDLEN_ENV, "wide")
    with pytest.raises(ValueError, match="MINIGPT_STEP_SIMDLEN"):
        step.simd_options()
    monkeypatch.setenv(step.SIMDLEN_ENV, "256")
    monkeypatch.setattr(step, "cpu_flags", lambda: frozenset({"avx2"}))  # AVX2 only: Inductor's own choice
    assert step.simd_options() == {}


@pytest.mark.parametrize("capability, gone, kept", [("avx2", ("avx512f", "avx512_vnni", "amx_int8", "avx_vnni"),
                                                             ("avx2", "fma")),
                                                    ("default", ("avx2", "avx512f", "fma", "f16c"), ("sse4_2",)),
                                                    ("", (), ("avx2", "avx512f"))])
def test_aten_cpu_capability_caps_minigpts_reading_of_the_cpu_flags(monkeypatch, tmp_path, capability, gone, kept):
    """``ATEN_CPU_CAPABILITY`` (PyTorch's switch for running as on an older CPU) drops the flags above it, so that
    MiniGPT's kernel choices follow ATen's and Inductor's."""
    from minigpt import runtime

    cpuinfo = "processor: 0\nflags\t\t: sse4_2 avx avx2 fma f16c avx_vnni avx512f avx512_vnni amx_int8\n"
    real_read = runtime.Path.read_text
    monkeypatch.setattr(runtime.Path, "read_text",
                        lambda self, *a, **k: cpuinfo if str(self) == "/proc/cpuinfo" else real_read(self, *a, **k))
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    runtime.cpu_flags.cache_clear()
    try:
        flags = runtime.cpu_flags()
    finally:
        monkeypatch.undo()
        runtime.cpu_flags.cache_clear()
    assert not set(gone) & flags and set(kept) <= flags
