"""The command line: one clear `error: ...` line and exit status 1 for each user mistake; generation end to end."""

import gc
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from conftest import CLI_ENV, TINY_MODEL, assert_one_line_error, run_cli

import minigpt.cli as cli
from minigpt.checkpoint.native import save_pretrained
from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer
from minigpt.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_data, tmp_path_factory):
    torch.manual_seed(0)
    tok = Tokenizer.from_dir(tiny_data)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, **TINY_MODEL)).eval()
    return save_pretrained(model, tmp_path_factory.mktemp("ckpt") / "model", tokenizer=tok)


def test_invalid_model_config(tiny_data, tmp_path):
    proc = run_cli("train", "--data", tiny_data, "--out-dir", tmp_path, "--max-steps", 1,
                   "--set", "model.n_kv_heads=3")
    assert_one_line_error(proc, "n_kv_heads")


def test_unknown_option_in_yaml(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("max_steps: 10\nlearning_rate: 0.1\n")
    assert_one_line_error(run_cli("train", "--config", cfg), "learning_rate")


def test_missing_budget(tiny_data, tmp_path):
    assert_one_line_error(run_cli("train", "--data", tiny_data, "--out-dir", tmp_path), "--max-steps")


def test_missing_data_file(tmp_path):
    assert_one_line_error(run_cli("prepare", "--data", tmp_path / "nope.txt", "--out-dir", tmp_path / "o"),
                          "nope.txt")


def test_empty_data_file(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    assert_one_line_error(run_cli("prepare", "--data", tmp_path / "empty.txt", "--out-dir", tmp_path / "o"),
                          "empty")


def test_non_utf8_data_file(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    assert_one_line_error(run_cli("prepare", "--data", tmp_path / "latin1.txt", "--out-dir", tmp_path / "o"),
                          "UTF-8")


def test_prompt_too_long(tiny_ckpt):
    proc = run_cli("generate", tiny_ckpt, "--prompt", "to be or not to be " * 40, "--max-new-tokens", 10)
    assert_one_line_error(proc, "max_new_tokens 10", "context of 64 tokens")


def test_the_default_answer_length_fits_a_small_context(tiny_ckpt):
    """Without --max-new-tokens a model whose context (64 tokens) is below the default 200 new tokens was an error
    blaming a flag never given; it now generates what the context has room for. A value given must still fit."""
    proc = run_cli("generate", tiny_ckpt, "--prompt", "ROMEO:", "--temperature", 0, "--stats")
    assert proc.returncode == 0, proc.stderr
    prompt_tokens = int(proc.stderr.split("| prefill ")[1].split(" tokens")[0])
    new_tokens = int(proc.stderr.split("| total ")[1].split(" tokens")[0])
    assert 1 <= new_tokens <= 64 - prompt_tokens, proc.stderr  # fewer only where an end-of-text token came first
    assert_one_line_error(run_cli("generate", tiny_ckpt, "--prompt", "ROMEO:", "--max-new-tokens", 100),
                          "max_new_tokens (100) must be below the model's context of 64 tokens")
    # A prompt that fills the context alone: the prompt is named, with the ways out.
    assert_one_line_error(run_cli("generate", tiny_ckpt, "--prompt", "to be or not to be " * 40),
                          "the prompt has", "context is 64 tokens", "--truncate-prompt")


def test_checkpoint_missing_a_file(tiny_ckpt, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_ckpt.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    assert_one_line_error(run_cli("generate", broken, "--prompt", "hi"), "model.safetensors")


def test_missing_checkpoint_directory(tmp_path):
    assert_one_line_error(run_cli("generate", tmp_path / "nothing", "--prompt", "hi"), "does not exist")


def test_generate_greedy_streams_the_same_text_as_the_library(tiny_ckpt):
    from minigpt.checkpoint.native import load_model
    from minigpt.infer.generate import generate_tokens
    from minigpt.infer.sampling import SamplingParams

    proc = run_cli("generate", tiny_ckpt, "--prompt", "ROMEO:", "--max-new-tokens", 20, "--temperature", 0)
    assert proc.returncode == 0, proc.stderr
    tok = Tokenizer.from_dir(tiny_ckpt)
    model = load_model(tiny_ckpt)
    params = SamplingParams(max_tokens=20, temperature=0)
    ids = list(generate_tokens(model, tok.encode("ROMEO:"), params, stop_ids=[tok.eos_id]))
    assert proc.stdout == tok.decode(ids) + "\n"


def test_generate_from_hf_directory_with_sentencepiece(shared_data):
    proc = run_cli("generate", shared_data / "models" / "stories260K" / "hf", "--prompt", "",
                   "--max-new-tokens", 30, "--temperature", 0)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Once upon a time, there was a little girl named Lily.")


def test_help_comes_from_docstrings():
    proc = run_cli("train", "--help")
    assert proc.returncode == 0 and "AdamW, warmup + cosine" in proc.stdout


@pytest.mark.parametrize("device", ["bogus", "meta", "cuda:x"])
def test_a_device_that_cannot_run_is_one_line(tiny_ckpt, device):
    """`--device bogus` was torch's RuntimeError traceback, `--device meta` one from `.item()` mid-generation."""
    proc = run_cli("generate", tiny_ckpt, "--prompt", "a", "--max-new-tokens", 2, "--device", device)
    assert_one_line_error(proc, f"--device {device!r} is not a device this can run on")


@pytest.mark.parametrize("option,value,fragment", [("--port", 99999, "--port must be between 0 and 65535"),
                                                   ("--port", -1, "--port must be between 0 and 65535"),
                                                   ("--request-timeout", "nan", "--request-timeout must be"),
                                                   ("--shutdown-timeout", -5, "--shutdown-timeout must be")])
def test_serve_refuses_a_bad_port_or_timeout_before_loading(tiny_ckpt, option, value, fragment):
    """`--port 99999` was an OverflowError traceback from bind(); `--request-timeout nan` was accepted."""
    proc = run_cli("serve", tiny_ckpt, option, value)
    assert_one_line_error(proc, fragment)


def test_a_reader_closing_the_pipe_early_is_not_an_error(tiny_ckpt):
    """`minigpt generate ... | head -c 5`: the BrokenPipeError branch came after the OSError one, so the CLI
    printed "error: BrokenPipeError" and exited 1. Here the reader is gone before the first write."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "minigpt", "generate", str(tiny_ckpt), "--prompt", "a",
                               "--max-new-tokens", "20"], stdout=write_end, stderr=subprocess.PIPE, env=CLI_ENV,
                              timeout=300)
    finally:
        os.close(write_end)
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr
    assert "Error" not in stderr and "Exception" not in stderr, stderr


@pytest.mark.parametrize("args,fragment", [(["--seed", 2**70], "--seed must fit in 64 bits"),
                                           (["--draft", "x", "--draft-k", 100000], "--draft-k must be between 1 and 64")])
def test_seed_and_draft_k_out_of_range_name_the_flag(tiny_ckpt, args, fragment):
    """They were "Overflow when unpacking long long" and "max_tokens (100005) must be below ...", naming no flag."""
    assert_one_line_error(run_cli("generate", tiny_ckpt, "--prompt", "a", *args), fragment)


def test_the_executables_exit_through_run_which_keeps_mains_status_and_freezes_the_heap(monkeypatch):
    (script,) = entry_points(group="console_scripts", name="minigpt")
    assert script.value == "minigpt.cli:run"
    assert "run()" in (Path(cli.__file__).parents[1] / "__main__.py").read_text()
    monkeypatch.setattr(cli, "main", lambda: 3)
    gc.unfreeze()
    try:
        assert cli.run() == 3
        assert gc.get_freeze_count() > 0  # the interpreter's last collections skip these objects
    finally:
        gc.unfreeze()
