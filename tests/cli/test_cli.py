"""The command line: one clear `error: ...` line and exit status 1 for each user mistake; generation end to end."""

import pytest
import torch
from conftest import TINY_MODEL, assert_one_line_error, run_cli

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
