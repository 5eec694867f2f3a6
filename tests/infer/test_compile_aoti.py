"""Compiled decode steps saved as AOTInductor packages (minigpt.infer.fastpath.aoti): the package gives the eager
fast path's tokens, is loaded by the next model (also by a fresh process, without importing Dynamo or Inductor),
holds code and not weights, a bad file is compiled again, and a failed packaging falls back to the torch.compile
step. Compiling a package takes ~20-40 s on 2 cores, so the tests that do are marked slow."""
import json
import os
import subprocess
import sys
from functools import partial

import pytest
import torch
from conftest import random_model

from minigpt.infer.fastpath import FastPath, aot, aoti, prepare
from minigpt.infer.fastpath import step as step_module
from minigpt.infer.fastpath.float_mv import FLOAT_MV_ENV, float_mv_kernel
from minigpt.infer.fastpath.library import w8a8_available
from minigpt.infer.fastpath.step import static_step
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams

torch.set_num_threads(1)

SHAPE = dict(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, multiple_of=16)
make = partial(random_model, SHAPE, noise=0.05)
GREEDY = SamplingParams(max_tokens=24, temperature=0)
PROMPT = [3, 14, 15, 9, 26]


def greedy(fp) -> list[int]:
    return list(generate_tokens(fp, PROMPT, GREEDY))


def _step_args(fp, cache_len: int = 64):
    """A step's arguments at position 3, the caches filled with random keys and values (so that a write to the
    wrong column, or a read of one, shows)."""
    cache = fp.new_kv_cache(1, cache_len)
    for t in cache.k + cache.v:
        t.normal_(generator=torch.Generator().manual_seed(t.numel() + len(t.shape)))
    zero = torch.zeros(1, dtype=torch.long)
    return (torch.tensor([[7]]), zero + 3, zero, list(cache.k), list(cache.v))


def _copy_args(args):
    token, pos, pad, k, v = args
    return (token, pos, pad, [t.clone() for t in k], [t.clone() for t in v])


def _assert_written(args_before, args_after, new_k, new_v, **tol):
    """The caches of ``args_after`` are those of ``args_before`` with the step's new keys and values at its
    position and nothing else changed."""
    pos = int(args_before[1])
    for before, after, new in zip(args_before[3] + args_before[4], args_after[3] + args_after[4], new_k + new_v):
        want = before.clone()
        want[:, :, pos:pos + new.shape[2]] = new
        torch.testing.assert_close(after, want, **tol)


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_the_step_module_reads_the_fastpaths_own_tensors_and_computes_its_step(quantize):
    """What export traces: every tensor the step reads is a buffer of StepModule under one stable name -- the
    FastPath's tensor itself, never a copy (the package gets them by these names) -- and its forward is the step."""
    fp = prepare(make(), quantize=quantize, compile=True)
    named = aoti.step_tensors(fp)
    module = aoti.StepModule(fp)
    assert dict(module.named_buffers()).keys() == named.keys()
    assert all(buf is named[name] for name, buf in module.named_buffers())
    assert named["l1_wqkv_" + ("weight" if fp.layers[1].wqkv.words is None else "words")] is (
        fp.layers[1].wqkv.weight if fp.layers[1].wqkv.words is None else fp.layers[1].wqkv.words)
    args = _step_args(fp)
    mutated = _copy_args(args)
    with torch.inference_mode():
        want, got = static_step(fp, *args), module(*mutated)
    # The module returns the logits alone and writes the new keys and values into the caches it was given.
    assert len(got) == 1
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    _assert_written(args, mutated, want[1], want[2], atol=0, rtol=0)


# The greedy step's head screen builds its C++ kernel first (~20 s on a fresh machine): that case runs in the slow stage.
@pytest.mark.parametrize("greedy", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_export_calls_the_layers_inline_and_computes_the_step(greedy, monkeypatch):
    """export traces a nested compile region by running Dynamo over it at every call (a 30-layer step: 30 times,
    about a fifth of a package's compile); the package's export calls the layers inline, and the exported program
    is still the step, for every cache length."""
    # The greedy step's head screen needs more rows than it keeps (SCREEN_K).
    fp = prepare(random_model({**SHAPE, "vocab_size": 512}, noise=0.05) if greedy else make(), compile=True)
    assert not greedy or fp.head_screen() is not None
    through_regions = []
    region = step_module.step_layer
    monkeypatch.setattr(step_module, "step_layer", lambda *a: through_regions.append(1) or region(*a))
    exported = aoti.export_step(fp, _step_args(fp), greedy=greedy)
    assert not through_regions  # through them, export runs Dynamo over each layer
    step = exported.module()
    for length in (64, 40):
        args = _step_args(fp, length)
        mutated = _copy_args(args)
        with torch.inference_mode():
            want = (aoti.static_greedy_step if greedy else static_step)(fp, *args)
            got = step(*mutated)
        assert len(got) == len(want) - 2  # the step's own outputs; the caches are written in place
        torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
        if greedy:
            torch.testing.assert_close(got[1], want[3], atol=1e-6, rtol=1e-5)
        _assert_written(args, mutated, want[1], want[2], atol=1e-6, rtol=1e-5)


def test_a_killed_compiles_leftover_is_removed_once_stale_and_a_fresh_one_kept(tmp_path):
    stale, fresh, package = (tmp_path / ".partial-a.pt2", tmp_path / ".partial-b.pt2", tmp_path / "k.pt2")
    for f in (stale, fresh, package):
        f.write_bytes(b"x")
    old = os.stat(stale).st_mtime - aoti.PARTIAL_MAX_AGE_S - 60
    os.utime(stale, (old, old))
    os.utime(package, (old, old))  # a finished package of any age stays
    assert aoti.remove_stale_partials(tmp_path) == [stale]
    assert not stale.exists() and fresh.exists() and package.exists()


@pytest.mark.slow
def test_a_package_is_saved_loaded_by_the_next_model_and_gives_the_eager_tokens(tmp_path, monkeypatch):
    eager = greedy(FastPath(make()))
    first = FastPath(make(), compile=True, compile_cache=tmp_path, aoti=True)
    assert greedy(first) == eager
    assert first.compile_sources == {"aoti-saved": 1}
    (package,) = tmp_path.glob("*" + aoti.SUFFIX)
    assert package.stat().st_mode & 0o077 == 0 and not list(tmp_path.glob("*.step"))

    def no_compile(*a, **k):
        raise AssertionError("compiled again instead of loading the saved package")

    monkeypatch.setattr(aot, "export_package", no_compile)
    monkeypatch.setattr(aot, "compile_step", no_compile)
    again = FastPath(make(), compile=True, compile_cache=tmp_path, aoti=True)
    assert greedy(again) == eager
    assert again.compile_sources == {"aoti-loaded": 1}
    # The package holds code, not weights: other weights of the same shapes load it and get their own tokens.
    other_eager = greedy(FastPath(make(seed=1)))
    assert other_eager != eager
    other = FastPath(make(seed=1), compile=True, compile_cache=tmp_path, aoti=True)
    assert greedy(other) == other_eager and other.compile_sources == {"aoti-loaded": 1}

    # A fresh process loads it without importing Dynamo or Inductor (what made a saved step cost seconds to load).
    code = (
        "import json, sys, torch; sys.path.insert(0, sys.argv[2]); from conftest import random_model; "
        "from minigpt.infer.fastpath import FastPath; from minigpt.infer.generate import generate_tokens; "
        "from minigpt.infer.sampling import SamplingParams; torch.set_num_threads(1); "
        f"m = random_model({SHAPE!r}, noise=0.05); fp = FastPath(m, compile=True, compile_cache=sys.argv[1], "
        "aoti=True); toks = list(generate_tokens(fp, [3, 14, 15, 9, 26], SamplingParams(max_tokens=24, "
        "temperature=0))); print(json.dumps([toks, fp.compile_sources, 'torch._dynamo' in sys.modules, "
        "'torch._inductor' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path), os.path.dirname(__file__) + "/.."],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [eager, {"aoti-loaded": 1}, False, False]


@pytest.mark.slow
def test_a_corrupt_package_is_compiled_again(tmp_path):
    eager = greedy(FastPath(make()))
    assert greedy(FastPath(make(), compile=True, compile_cache=tmp_path, aoti=True)) == eager
    (package,) = tmp_path.glob("*" + aoti.SUFFIX)
    package.write_bytes(b"PK\x03\x04 not a package")
    with pytest.warns(RuntimeWarning, match="ignoring the saved compiled step"):
        again = FastPath(make(), compile=True, compile_cache=tmp_path, aoti=True)
        assert greedy(again) == eager
    assert again.compile_sources == {"aoti-saved": 1}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_failed_packaging_falls_back_to_the_torch_compile_step_once(tmp_path, monkeypatch, dtype):
    """One warning, one try, the eager tokens; a bf16 step meant to call minigpt::float_mv (a package's op) goes
    back to the generated loops."""
    tries = []

    def failing(*a, **k):
        tries.append(1)
        raise RuntimeError("unsupported here")

    monkeypatch.setattr(aot, "export_package", failing)
    monkeypatch.setenv(FLOAT_MV_ENV, "1")
    fp = FastPath(make().to(dtype), compile=True, compile_cache=tmp_path, aoti=True)
    through_kernel = fp.geometry.float_mv
    assert through_kernel == (dtype == torch.bfloat16 and float_mv_kernel() not in (None, "scalar"))
    with pytest.warns(RuntimeWarning, match="packaging the compiled step with AOTInductor failed"):
        assert greedy(fp) == greedy(FastPath(make().to(dtype)))
        assert not fp.geometry.float_mv
        with torch.inference_mode():  # another shape: packaging is not tried again
            cache = fp.new_kv_cache(2, 8)
            fp(torch.tensor([PROMPT, PROMPT]), 0, cache)
            fp.decode_step(torch.tensor([[4], [4]]), len(PROMPT), cache)
    assert tries == [1] and not fp.aoti
    assert fp.compile_sources == {"saved": 2}


@pytest.mark.slow
@pytest.mark.skipif(not w8a8_available(), reason="FBGEMM's int8 x int8 product needs x86 with AVX512-VNNI")
def test_an_int8_package_calls_fbgemm_and_gives_the_compiled_steps_tokens(tmp_path):
    """int8 through FBGEMM: the package calls our op (minigpt::w8a8_mm, registered from Python) for every
    projection; the tokens equal those of the torch.compile step, which is tested against eager elsewhere."""
    ref = prepare(make(), quantize="int8", compile=True)
    ref.compile_cache = False
    assert ref.geometry.w8a8
    want = greedy(ref)
    fp = prepare(make(), quantize="int8", compile=True, aoti=True)
    fp.compile_cache = tmp_path
    assert greedy(fp) == want and fp.compile_sources == {"aoti-saved": 1}


def test_a_packages_key_leaves_out_the_cache_length_and_a_saved_steps_keeps_it():
    """A package is exported with the cache length dynamic (aoti._dynamic_shapes), so its file name must not
    depend on it; a saved torch.compile step is specialised to it, so its name must."""
    fp = FastPath(make(), compile=True, compile_cache=False)
    short, long = _step_args(fp, 32), _step_args(fp, 64)
    assert aot.step_key(fp, 1, 1, None, short) == aot.step_key(fp, 1, 1, None, long)
    assert aot.step_key(fp, 1, 1, 32, short) != aot.step_key(fp, 1, 1, 64, long)
    assert aot.step_key(fp, 1, 1, None, short) != aot.step_key(fp, 2, 1, None, short)
    assert aot.step_key(fp, 1, 1, None, short) != aot.step_key(fp, 1, 1, 32, short)
    dynamic = aoti._dynamic_shapes(long)
    assert [d[2].__name__ for d in dynamic["k_cache"] + dynamic["v_cache"]] == ["cache_len"] * 4


@pytest.mark.slow
def test_one_package_serves_every_cache_length(tmp_path, monkeypatch):
    """Before, the cache length (prompt + new tokens, rounded up to CACHE_BUCKET) was in the package's shape and
    name: every new bucket compiled another package (76-157 s at 135M)."""
    long_shape = {**SHAPE, "max_seq_len": 256}
    model = partial(random_model, long_shape, noise=0.05)
    # Caches of 64; 64 grown to 128; 64, 128, then 192 (generate.grown_cache_for)
    lengths = [SamplingParams(max_tokens=n, temperature=0) for n in (24, 100, 180)]
    eager = [list(generate_tokens(FastPath(model()), PROMPT, p)) for p in lengths]
    fp = FastPath(model(), compile=True, compile_cache=tmp_path, aoti=True)
    assert [list(generate_tokens(fp, PROMPT, p)) for p in lengths[:2]] == eager[:2]
    assert fp.compile_sources == {"aoti-saved": 1, "aoti-loaded": 1}
    assert len(list(tmp_path.glob("*" + aoti.SUFFIX))) == 1

    def no_compile(*a, **k):
        raise AssertionError("compiled again instead of loading the saved package")

    monkeypatch.setattr(aot, "export_package", no_compile)
    monkeypatch.setattr(aot, "compile_step", no_compile)
    again = FastPath(model(), compile=True, compile_cache=tmp_path, aoti=True)
    assert list(generate_tokens(again, PROMPT, lengths[2])) == eager[2]
    # one package, loaded once, for the three lengths the cache grew through
    assert again.compile_sources == {"aoti-loaded": 3} and len(again.packages) == 1
    assert sorted(key[2] for key in again._steps) == [64, 128, 192]
