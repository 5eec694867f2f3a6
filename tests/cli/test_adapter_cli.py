"""LoRA adapters at inference: `generate BASE --adapter DIR` and `chat BASE --adapter DIR` run the base with the PEFT
folder merged in, the same text as the merged model written by `lora merge`; a mismatched adapter is one line."""
import pytest
import torch
from conftest import TINY_MODEL, assert_one_line_error, random_model, run_cli

from minigpt.checkpoint.adapter import save_adapter
from minigpt.checkpoint.native import save_pretrained
from minigpt.model.lora import apply_lora, lora_layers
from minigpt.tokenizer.tokenizer import Tokenizer


def _base_and_adapter(tiny_data, tmp_path):
    tok = Tokenizer.from_dir(tiny_data)
    shape = dict(vocab_size=tok.vocab_size, **TINY_MODEL)
    save_pretrained(random_model(shape, noise=0.05), tmp_path / "base", tokenizer=tok)
    adapted = random_model(shape, noise=0.05)
    apply_lora(adapted, 4, 16, targets=["q_proj", "v_proj", "o_proj", "down_proj"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a large update, so the greedy text changes
        for layer in lora_layers(adapted).values():
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.5)
    save_adapter(adapted, tmp_path / "adapter")
    return tmp_path / "base", tmp_path / "adapter"


@pytest.mark.slow  # several CLI processes, ~14 s (make test-slow, CI's second stage)
def test_generate_and_chat_with_an_adapter(tiny_data, tmp_path):
    base, adapter = _base_and_adapter(tiny_data, tmp_path)
    assert run_cli("lora", "merge", base, adapter, "--out-dir", tmp_path / "merged").returncode == 0
    args = ["--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "24"]
    plain = run_cli("generate", base, *args)
    with_adapter = run_cli("generate", base, "--adapter", adapter, *args)
    merged = run_cli("generate", tmp_path / "merged", *args)
    assert plain.returncode == with_adapter.returncode == merged.returncode == 0, with_adapter.stderr
    assert with_adapter.stdout == merged.stdout != plain.stdout
    chat = run_cli("chat", base, "--adapter", adapter, "--temperature", "0", "--max-tokens", "8", stdin="hello\n")
    chat_merged = run_cli("chat", tmp_path / "merged", "--temperature", "0", "--max-tokens", "8", stdin="hello\n")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.replace(str(base), "") == chat_merged.stdout.replace(str(tmp_path / "merged"), "")


def test_adapter_for_another_base_is_one_line(tiny_data, tmp_path):
    base, adapter = _base_and_adapter(tiny_data, tmp_path)
    tok = Tokenizer.from_dir(tiny_data)
    save_pretrained(random_model(dict(vocab_size=tok.vocab_size, **{**TINY_MODEL, "dim": 48})), tmp_path / "other",
                    tokenizer=tok)
    assert_one_line_error(run_cli("generate", tmp_path / "other", "--adapter", adapter, "--prompt", "a"), "has shape")
    assert_one_line_error(run_cli("chat", tmp_path / "other", "--adapter", adapter, stdin="hi\n"), "has shape")


@pytest.mark.slow
def test_serve_with_an_adapter_answers_like_the_merged_model(tiny_data, tmp_path):
    import json
    import sys
    import urllib.request
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
    from serve_helpers import ServerProcess

    base, adapter = _base_and_adapter(tiny_data, tmp_path)
    merged = run_cli("generate", base, "--adapter", adapter, "--prompt", "ROMEO:", "--temperature", "0",
                     "--max-new-tokens", "16")
    server = ServerProcess(base, "--adapter", str(adapter))
    try:
        body = json.dumps({"model": "base", "prompt": "ROMEO:", "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            text = json.loads(r.read())["choices"][0]["text"]
    finally:
        server.stop()
    assert merged.stdout.rstrip("\n") == text
