"""The native launcher (minigpt.infer.launcher, minigpt.infer.native, minigpt.cli.quick): a `generate --compile`
greedy call whose bundle exists runs the saved step package through libtorch without importing torch, gives the
compiled step's tokens and the ordinary command's text, and a broken bundle is refused with its reason (the call
then runs the ordinary way). The tests that compile a package and build the runner (~30-60 s) are marked slow."""
import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CLI_ENV, TINY_MODEL, random_model, run_cli

from minigpt.checkpoint.native import save_pretrained
from minigpt.cli import quick
from minigpt.cli.generate import native_eligible, register
from minigpt.infer import launcher
from minigpt.infer.fastpath import load_for_inference
from minigpt.infer.fastpath.library import own_int8_isa, w8a8_available
from minigpt.infer.native import LIMIT_ENV, write_bundle
from minigpt.tokenizer.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


def test_the_command_line_and_the_launcher_import_without_torch():
    """What the native path imports before it runs: the CLI package, its generate module, the launcher, the
    tokenizer and the stop strings -- none of them torch (`import torch` is what the native path saves)."""
    code = ("import sys, minigpt.cli, minigpt.cli.quick, minigpt.infer.launcher, minigpt.infer.stops, "
            "minigpt.tokenizer.tokenizer; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=CLI_ENV)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_launcher_reads_torchs_version_without_importing_it_or_the_package_metadata():
    """The bundle key's torch version comes from torch/version.py: the same string as ``torch.__version__``, with
    neither torch nor ``importlib.metadata`` (23-30 ms of a one-shot call) imported."""
    code = ("import sys, minigpt.infer.launcher as launcher; version = launcher.torch_version(); "
            "print(version, 'torch' in sys.modules, 'importlib.metadata' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=CLI_ENV)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [torch.__version__, "False", "False"]


def _model_dir(tiny_data, path: Path, **overrides) -> Path:
    tok = Tokenizer.from_dir(tiny_data)
    # Noise large enough that greedy tokens vary (at 0.05 this shape repeats one token).
    save_pretrained(random_model(dict(vocab_size=tok.vocab_size, **TINY_MODEL), seed=1, noise=0.5, **overrides),
                    path, tokenizer=tok)
    return path


def test_the_launch_key_follows_the_model_files_and_the_options(tiny_data, tmp_path):
    model = _model_dir(tiny_data, tmp_path / "m")
    key = launcher.launch_key(model, "float32", None, 2)
    assert key == launcher.launch_key(model, "float32", None, 2)
    assert len({key, launcher.launch_key(model, "bfloat16", None, 2), launcher.launch_key(model, "float32", "int4", 2),
                launcher.launch_key(model, "float32", None, 1)}) == 4
    weights = model / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a rewritten checkpoint: another bundle
    assert launcher.launch_key(model, "float32", None, 2) != key
    assert launcher.launch_key(tmp_path, "float32", None, 2) is None  # not a model directory


def test_the_launch_key_follows_the_switches_that_shape_the_step(tiny_data, tmp_path, monkeypatch):
    """A bundle made with $MINIGPT_FLOAT_MV on must not serve a call with it off (nor any other step switch):
    each switch, once set, gives its own key, and each value another."""
    model = _model_dir(tiny_data, tmp_path / "m")
    for name in launcher.STEP_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    plain = launcher.launch_key(model, "bfloat16", None, 2)
    keys = {plain}
    for name in launcher.STEP_SWITCHES:
        for value in ("0", "1"):
            monkeypatch.setenv(name, value)
            keys.add(launcher.launch_key(model, "bfloat16", None, 2))
        monkeypatch.delenv(name)
    assert len(keys) == 1 + 2 * len(launcher.STEP_SWITCHES)
    assert launcher.launch_key(model, "bfloat16", None, 2) == plain


def test_every_switch_the_step_builder_reads_is_in_the_launch_key():
    """The fast path's Python modules read their switches while a package is built, and its kernels' caps decide
    which kernels it calls: each such `MINIGPT_*` name is one of launcher.STEP_SWITCHES, so that a new switch
    cannot be added without the bundles following it."""
    import re
    infer = ROOT / "minigpt" / "infer"
    read = set()
    for path in [*(infer / "fastpath").glob("*.py"), *infer.glob("*.cpp"), *infer.glob("*.h")]:
        read |= set(re.findall(r"MINIGPT_[A-Z0-9_]+", path.read_text()))
    # Not the step's: where the compile cache lives and how large it may grow; the prefill GEMM and the prefill
    # attention kernel's cap (the runner feeds the prompt through the one-token step).
    elsewhere = {"MINIGPT_COMPILE_CACHE", "MINIGPT_COMPILED_STEPS_GB", "MINIGPT_FP32_GEMM", "MINIGPT_ATTENTION_ISA"}
    assert read - elsewhere <= set(launcher.STEP_SWITCHES), sorted(read - elsewhere - set(launcher.STEP_SWITCHES))
    assert {"MINIGPT_FLOAT_MV", "MINIGPT_HEAD_SCREEN", "MINIGPT_WOQ_KERNEL"} <= read


def _parse(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["generate", "m", *argv])


@pytest.mark.parametrize("extra, ok", [
    ([], True), (["--quantize", "int4", "--threads", "2", "--stop", "."], True),
    (["--temperature", "0.8"], False), (["--no-native"], False), (["--chat", "hi"], False),
    (["--prompt", "b"], False), (["--draft", "d"], False), (["--context", "32"], False),
])
def test_only_greedy_single_prompt_compiled_calls_go_native(extra, ok):
    args = _parse("--compile", "--temperature", "0", "--prompt", "a", *extra)
    assert native_eligible(args) is ok
    assert not native_eligible(_parse("--temperature", "0", "--prompt", "a"))  # not compiled


def test_the_cache_length_is_the_compiled_steps():
    assert [launcher.cache_length(n, 1024) for n in (1, 64, 65, 200)] == [64, 64, 128, 256]
    assert launcher.cache_length(200, 100) == 100


def test_no_bundle_means_the_ordinary_command(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv(launcher.ENV, str(tmp_path / "cache"))
    model = _model_dir(tiny_data, tmp_path / "m")
    assert quick.run(["generate", str(model), "--prompt", "a", "--temperature", "0", "--compile"]) is None


def _greedy_through_the_step(fp, prompt: list[int], n: int, screened: bool = False) -> list[int]:
    """The compiled step fed a token at a time, prompt included, as the native runner does (``screened``: the
    greedy step through the head's int8 screen, FastPath.decode_next)."""
    cache = fp.new_kv_cache(1, len(prompt) + n)
    out = []
    with torch.inference_mode():
        for pos, token in enumerate(prompt + [None] * (n - 1)):
            token = out[-1] if token is None else token
            if screened:
                nxt = int(fp.decode_next(torch.tensor([[token]]), pos, cache)[0])
            else:
                nxt = int(fp.decode_step(torch.tensor([[token]]), pos, cache).argmax())
            if pos >= len(prompt) - 1:
                out.append(nxt)
    return out


@pytest.mark.slow  # compiles a package and builds the runner, ~40 s
@pytest.mark.parametrize("quantize, screened", [(None, False), (None, True), ("int4", False), ("int8", False)])
def test_the_runner_gives_the_compiled_steps_tokens_and_refuses_a_truncated_bundle(tiny_data, tmp_path, monkeypatch,
                                                                                   runner_cache, quantize, screened):
    """In this process too (a Python one, whose compiled int8/int4 steps made the runner library's C++ function
    the kernel of `minigpt::w8a8_mm`, sharing its table of packed matrices): the runner gives the compiled step's
    tokens, for models whose step multiplies through FBGEMM as well (before, those were refused here), and for
    the greedy step whose package returns tokens (the fp32 head read through its int8 screen)."""
    monkeypatch.setenv(launcher.ENV, str(runner_cache))
    model = _model_dir(tiny_data, tmp_path / "m")
    fp = load_for_inference(model, quantize=quantize, compile=True, aoti=True)
    if screened:
        assert fp.head_screen() is not None
    prompt = [5, 17, 3, 22, 9]
    want = _greedy_through_the_step(fp, prompt, 20, screened)
    assert fp.compile_sources == {"aoti-saved": 1}
    if screened:  # the argmax of the logits, here from the eager forward (a second package would be a second step)
        assert want == _greedy_through_the_step(load_for_inference(model, compile=False), prompt, 20)
    earlier = runner_cache / "native" / "earlier"  # another model's bundle: beyond a limit of 0 bytes
    earlier.mkdir(parents=True)
    (earlier / "tensors.bin").write_bytes(b"\0" * 64)
    monkeypatch.setenv(LIMIT_ENV, "0")
    bundle = write_bundle(fp, model, "float32", quantize, 1, False, [])
    assert not earlier.exists() and bundle.is_dir()  # the new bundle is kept, alone
    manifest = launcher.read_manifest(launcher.launch_key(model, "float32", quantize, 1))
    assert manifest is not None and Path(manifest["bundle"]) == bundle
    files = Path(manifest["runner"]), Path(manifest["package"]), bundle
    # int8 matrices of the step: FBGEMM's (VNNI) or MiniGPT's kernel alone (AVX2 without VNNI)
    int8_op = w8a8_available() or own_int8_isa() == "avx2"
    assert bool((bundle / "w8a8.txt").read_text()) == (quantize is not None and int8_op)
    with launcher.NativeRunner(*files, threads=1) as runner:
        got = runner.generate(prompt, 20, cache_len=launcher.cache_length(25, manifest["positions"]))
        assert got == want and len(set(want)) > 5
        stop = want[5]
        assert runner.generate(prompt, 20, stop_ids=[stop]) == want[:want.index(stop) + 1]  # ends at it, included
        seen = []

        def closed_pipe(token):  # what writing to a closed stdout raises
            seen.append(token)
            raise BrokenPipeError("the reader went away")

        with pytest.raises(BrokenPipeError):
            runner.generate(prompt, 20, on_token=closed_pipe)
        assert seen == want[:1]  # the first token's error ended the generation
    tensors = bundle / "tensors.bin"
    tensors.write_bytes(tensors.read_bytes()[:tensors.stat().st_size // 2])
    with pytest.raises(launcher.NativeError, match="lies outside tensors.bin"):
        launcher.NativeRunner(*files, threads=1)
    (bundle / "tensors.txt").write_text("minigpt-native 1 2 2 8\nembedding float64 0 1 4 1\n")
    with pytest.raises(launcher.NativeError, match="unknown dtype float64"):
        launcher.NativeRunner(*files, threads=1)


@pytest.mark.slow  # compiles a package and builds the runner, ~40 s
def test_the_runners_cache_grows_past_its_first_bucket_and_keeps_the_steps_tokens(tiny_data, tmp_path, monkeypatch,
                                                                                  runner_cache):
    """The runner starts its cache at 64 columns and grows it (64 -> 128 -> 192 here) as the positions fill it,
    carrying the held columns over: the tokens of the compiled step over one cache of the whole length."""
    monkeypatch.setenv(launcher.ENV, str(runner_cache))
    model = _model_dir(tiny_data, tmp_path / "m", max_seq_len=256)
    fp = load_for_inference(model, quantize="int4", compile=True, aoti=True)
    prompt = [5, 17, 3, 22, 9]
    want = _greedy_through_the_step(fp, prompt, 150)  # one cache of 155 columns (192)
    bundle = write_bundle(fp, model, "float32", "int4", 1, False, [])
    manifest = launcher.read_manifest(launcher.launch_key(model, "float32", "int4", 1))
    with launcher.NativeRunner(Path(manifest["runner"]), Path(manifest["package"]), bundle, threads=1) as runner:
        got = runner.generate(prompt, 150, cache_len=launcher.cache_length(155, manifest["positions"]))
    assert got == want and len(set(want[64:])) > 5


@pytest.mark.slow  # four CLI processes, one compiling a package, ~60 s
@pytest.mark.parametrize("quantize", [[], ["--quantize", "int4"]])
def test_the_second_compiled_call_runs_natively_without_torch_and_prints_the_same_text(tiny_data, tmp_path, runner_cache,
                                                                                        quantize):
    """int4: its int8 LM head goes through FBGEMM where the CPU has VNNI, packed by the runner. A prompt longer than
    ``PROMPT_TOKENS_MAX`` runs natively too (through the bundle's prefill package), with the ordinary text."""
    model = _model_dir(tiny_data, tmp_path / "m", max_seq_len=256)
    env = {"MINIGPT_COMPILE_CACHE": str(runner_cache)}
    args = ["generate", model, "--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "24", "--compile",
            "--threads", "1", "--stats", *quantize]
    first = run_cli(*args, env=env)
    assert first.returncode == 0, first.stderr
    assert "aoti-saved" in first.stderr and "writing the native runner's bundle" in first.stderr
    ordinary = run_cli(*args, "--no-native", env=env)
    second = subprocess.run([sys.executable, "-X", "importtime", "-m", "minigpt", *map(str, args)],
                            capture_output=True, text=True, env={**CLI_ENV, **env}, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "1 native" in second.stderr and "1 native" not in ordinary.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in second.stderr.splitlines() if "|" in line}
    assert "minigpt.cli.quick" in imported and "torch" not in imported
    assert second.stdout == first.stdout == ordinary.stdout
    long_prompt = "ROMEO: But soft, what light through yonder window breaks? " * 3
    assert 2 * quick.PROMPT_TOKENS_MAX > len(Tokenizer.from_dir(model).encode(long_prompt)) > quick.PROMPT_TOKENS_MAX
    long_args = [str(a) if a != "ROMEO:" else long_prompt for a in args]
    native, plain = run_cli(*long_args, env=env), run_cli(*long_args, "--no-native", env=env)
    assert native.returncode == 0 and plain.returncode == 0, native.stderr + plain.stderr
    assert "1 native" in native.stderr and native.stdout == plain.stdout
    # A damaged bundle: one warning, and the ordinary command's output.
    bundle = next((runner_cache / "native").iterdir())
    (bundle / "tensors.bin").write_bytes(b"")
    third = run_cli(*args, env=env)
    assert third.returncode == 0, third.stderr
    assert "running without the native runner" in third.stderr and "aoti-loaded" in third.stderr
    assert third.stdout == first.stdout
    assert (bundle / "tensors.bin").stat().st_size > 0  # written again by that call


def _greedy_after_the_prefill_package(fp, package, prompt: list[int], n: int, rows: tuple[int, int]) -> list[int]:
    """What the native runner computes with a prefill package, in Python: all but the prompt's last token through
    the package in calls of at most ``rows[1]`` tokens, each padded with zeros to ``rows[0]``, then the step."""
    cache = fp.new_kv_cache(1, launcher.cache_length(len(prompt) + n, fp.config.max_seq_len))
    zero = torch.zeros(1, dtype=torch.long)
    p = 0
    with torch.inference_mode():
        while p < len(prompt) - 1:
            chunk = prompt[p:min(p + rows[1], len(prompt) - 1)]
            tokens = torch.tensor([chunk + [0] * (rows[0] - len(chunk))])
            package(tokens, torch.tensor([p]), zero, cache.k, cache.v)
            p += len(chunk)
        out = []
        for pos in range(p, len(prompt) + n - 1):
            token = prompt[pos] if pos < len(prompt) else out[-1]
            nxt = int(fp.decode_step(torch.tensor([[token]]), pos, cache).argmax())
            if pos >= len(prompt) - 1:
                out.append(nxt)
    return out


@pytest.mark.slow  # compiles two packages and builds the runner, ~90 s
@pytest.mark.parametrize("dtype,quantize", [("float32", None), ("float32", "int8"), ("float32", "int4"),
                                            ("bfloat16", None)])
def test_the_runner_prefills_the_prompt_through_its_package(tiny_data, tmp_path, monkeypatch, runner_cache, dtype,
                                                           quantize):
    """The bundle's prefill package takes all but the prompt's last token, in calls of at most ``prefill_rows[1]``
    tokens padded to ``prefill_rows[0]``: the runner gives what those calls and the step give in Python, the keys
    and values of the one-token step to float rounding, and its greedy tokens, for prompts of 1, 2 (padded), 12
    and 40 (three calls of up to 16) tokens; a bundle without one still runs, a token at a time. At every
    precision the runner serves: each has its own products in the package (GEMMs, int8 and int4 kernels)."""
    from minigpt.infer.fastpath.aoti import PREFILL_ROWS_MIN, PackagedStep

    monkeypatch.setenv(launcher.ENV, str(runner_cache))
    model = _model_dir(tiny_data, tmp_path / "m")
    fp = load_for_inference(model, dtype=getattr(torch, dtype), quantize=quantize, compile=True, aoti=True)
    prompts = [[7], [5, 17], [5, 17, 3, 22, 9, 30, 2, 11, 8, 19, 4, 26], [(i * 7 + 3) % 31 + 1 for i in range(40)]]
    steps = {tuple(p): _greedy_through_the_step(fp, p, 16) for p in prompts}
    bundle = write_bundle(fp, model, dtype, quantize, 1, False, [])
    manifest = launcher.read_manifest(launcher.launch_key(model, dtype, quantize, 1))
    assert manifest["prefill"] is not None and manifest["prefill_rows"][0] == PREFILL_ROWS_MIN
    package = PackagedStep(Path(manifest["prefill"]), fp)
    # The cache columns of a 12-token prompt's first 11, against the step's a token at a time.
    prompt = prompts[2]
    ours, theirs = fp.new_kv_cache(1, 64), fp.new_kv_cache(1, 64)
    with torch.inference_mode():
        package(torch.tensor([prompt[:11]]), torch.tensor([0]), torch.tensor([0]), ours.k, ours.v)
        for pos, token in enumerate(prompt[:11]):
            fp.decode_step(torch.tensor([[token]]), pos, theirs)
    for a, b in zip(ours.k + ours.v, theirs.k + theirs.v):
        torch.testing.assert_close(a[:, :, :11], b[:, :, :11], rtol=1e-4, atol=1e-5)
        assert not a[:, :, :11].eq(0).all()
    files = Path(manifest["runner"]), Path(manifest["package"]), bundle
    for rows in [(PREFILL_ROWS_MIN, 16), tuple(manifest["prefill_rows"])]:
        with launcher.NativeRunner(*files, threads=1, prefill=Path(manifest["prefill"]), prefill_rows=rows) as runner:
            for p in prompts:
                got = runner.generate(p, 16, cache_len=launcher.cache_length(len(p) + 16, manifest["positions"]))
                assert got == _greedy_after_the_prefill_package(fp, package, p, 16, rows), (rows, len(p))
                assert got == steps[tuple(p)], (rows, len(p))
                assert runner.prefilled == len(p) - 1
    with launcher.NativeRunner(*files, threads=1) as runner:  # no prefill package
        assert runner.generate(prompts[3], 16) == steps[tuple(prompts[3])] and runner.prefilled == 0
    with pytest.raises(launcher.NativeError, match="prefill_min <= prefill_max"):
        with launcher.NativeRunner(*files, threads=1, prefill=Path(manifest["prefill"]), prefill_rows=(16, 9)) as r:
            r.generate(prompts[3], 4)
