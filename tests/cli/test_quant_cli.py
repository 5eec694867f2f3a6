"""`minigpt quantize --dtype int4`, `generate --stats --threads --quantize int4` and `bench --model PATH`: the size
report counts a tied embedding once, the stats line has its fields, bad group sizes are one-line errors, and bench
measures a given checkpoint."""
import re

import pytest
from conftest import assert_one_line_error, random_model, run_cli

from minigpt.analysis.bench.infer import BenchSettings
from minigpt.checkpoint.native import save_pretrained
from minigpt.model.quant import tensor_bytes
from minigpt.tokenizer.tokenizer import train_tokenizer

SHAPE = dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=64, multiple_of=32)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """A tied model whose embedding (4096 x 64 float32, 1 MiB) dominates its bytes, with a tokenizer."""
    tok = train_tokenizer(["the cat sat on the mat and the dog ate the hat " * 40], 300)
    model = random_model(dict(SHAPE, vocab_size=4096), tie_embeddings=True)
    return save_pretrained(model, tmp_path_factory.mktemp("tied") / "m", tok), model


def test_quantize_int4_reports_tied_weights_once_and_generates_with_stats(tied_dir, tmp_path):
    src, model = tied_dir
    proc = run_cli("quantize", src, tmp_path / "q4", "--dtype", "int4")
    assert proc.returncode == 0, proc.stderr
    before, after = map(float, re.search(r"\(([\d.]+) MiB -> ([\d.]+) MiB", proc.stdout).groups())
    assert before == round(tensor_bytes(model) / 2**20, 1)  # the tied matrix once: 1.2, not 2.2
    # After: the float embedding (1 MiB) plus the head's own int8 copy (0.25 MiB) and the small block.
    assert before < 1.5 and 1.25 <= after < 1.4
    proc = run_cli("generate", tmp_path / "q4", "--prompt", "the cat", "--max-new-tokens", 6, "--temperature", 0,
                   "--stats", "--threads", 1, "--quantize", "int4")  # already int4: --quantize leaves it as is
    assert proc.returncode == 0, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    two = r"\d+\.\d\d"
    for field in (rf"decode {two} tokens/s", rf"prefill \d+ tokens: {two} tokens/s", rf"time to first token {two} s",
                  rf"load {two} s", rf"compile {two} s"):
        assert re.search(field, line), (field, line)
    assert line.startswith("[decode ")  # the headline rate: decode, compilation excluded


@pytest.mark.slow  # four CLI processes each, one compiling a package: ~40-60 s (make test-slow, CI's second stage)
@pytest.mark.parametrize("quantize", [[], ["--quantize", "int4"]], ids=["float32", "int4"])
def test_generate_compile_saves_its_step_and_the_next_run_loads_it_and_prints_the_eager_text(tied_dir, runner_cache,
                                                                                               quantize):
    src, _ = tied_dir
    args = ("generate", src, "--prompt", "the cat", "--max-new-tokens", 24, "--temperature", 0, "--stats", *quantize)
    env = {"MINIGPT_COMPILE_CACHE": str(runner_cache)}
    eager, first = run_cli(*args, env=env), run_cli(*args, "--compile", env=env)
    second, third = run_cli(*args, "--compile", "--no-native", env=env), run_cli(*args, "--compile", env=env)
    for proc in (eager, first, second, third):
        assert proc.returncode == 0, proc.stderr
    assert first.stdout == eager.stdout and second.stdout == eager.stdout and third.stdout == eager.stdout
    assert "compiled steps" not in eager.stderr
    # On a CPU the CLI's compiled step is an AOTInductor package (minigpt.infer.fastpath.aoti); a greedy call
    # after the first runs it in the native runner (minigpt.cli.quick) unless --no-native.
    stats = [[ln for ln in p.stderr.splitlines() if ln.startswith("[decode ")][-1] for p in (first, second, third)]
    assert "compiled steps: 1 aoti-saved" in stats[0]  # then the note on writing the native bundle, below it
    assert "compiled steps: 1 aoti-loaded" in stats[1]
    assert "compiled steps: 1 native" in stats[2]
    assert "writing the native runner's bundle" in first.stderr.splitlines()[-1]
    assert len(list(runner_cache.glob("*.pt2"))) == 2  # the step and the native runner's prefill
    assert not list(runner_cache.glob("*.step"))


def test_quantize_bad_group_sizes_are_one_line_errors(tied_dir, tmp_path):
    src, _ = tied_dir
    assert_one_line_error(run_cli("quantize", src, tmp_path / "a", "--dtype", "int4", "--group-size", 12),
                          "group size must be a positive multiple of 8, got 12")
    assert_one_line_error(run_cli("quantize", src, tmp_path / "b", "--group-size", 64), "--group-size applies to")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_bench_model_path_with_int4(tied_dir, tmp_path):
    src, _ = tied_dir
    out = tmp_path / "table.md"
    proc = run_cli("bench", "--model", src, "--quantize", "int8,int4", "--rows", "prefill,decode-b1", "--dtypes",
                   "float32", "--repeats", 1, "--warmup", 0, "--no-transformers", "--prefill-len", 16,
                   "--prompt-len", 4, "--new-tokens", 4, "--threads", 1, "--out", out)
    assert proc.returncode == 0, proc.stderr
    table = out.read_text()
    assert "minigpt+int4 tok/s" in table and "minigpt+int8 tok/s" in table
    name = f"{src.parent.name}/{src.name}"  # the folder and its parent: `hf` alone would say little
    assert f"| {name} | float32 | prefill |" in table and f"| {name} | float32 | decode-b1 |" in table
    assert_one_line_error(run_cli("bench", "--model", src, "--prefill-len", 512, "--no-transformers"),
                          "context of 64 tokens", "need 512")
    with pytest.raises(ValueError, match="--quantize takes int8, int4"):
        BenchSettings(quantize="int8,int3")


def test_stats_exclude_compilation_that_came_before_the_first_token():
    """A speculative first token follows the draft's first steps, which compile: that compile time was counted in
    the first-token time *and* taken from the decode time, which went negative ("decode nan tokens/s (39 tokens in
    -92.17 s)", seen with a 148 s AOTInductor compile). Here 5 of 10 compile seconds come before the first token
    at 6 s, the call ends at 12 s: 1 s to the first token, 1 s for the 10 tokens after it."""
    from minigpt.cli.generate import format_stats

    line = format_stats(0.5, 10.0, 5, 6.0, 11, 12.0, compile_first=5.0)
    assert "decode 10.00 tokens/s (10 tokens in 1.00 s)" in line
    assert "prefill 5 tokens: 5.00 tokens/s | time to first token 1.00 s" in line
    assert "compile 10.00 s" in line and "total 11 tokens in 12.00 s" in line
    # Compilation only after the first token (no draft): as before.
    assert "decode 5.00 tokens/s (10 tokens in 2.00 s)" in format_stats(0.5, 4.0, 5, 1.0, 11, 7.0)
