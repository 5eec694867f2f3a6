"""`minigpt sft`: full and LoRA fine-tuning end to end on tiny synthetic conversations, and the real chat data."""
import json
from pathlib import Path

import pytest
import torch
from chat_helpers import chat_tokenizer, conversations, tiny_model
from conftest import assert_one_line_error, run_cli

from minigpt.checkpoint.adapter import CONFIG_NAME, load_adapter
from minigpt.checkpoint.native import load_chat_template, load_model, load_tokenizer, save_pretrained
from minigpt.data.chat import SkipReport, read_conversations
from minigpt.posttrain.sft import SFTConfig, sft
from minigpt.posttrain.vocab import add_chat_tokens
from minigpt.tokenizer.chat_template import CHATML_TEMPLATE, CHATML_TRAINING_TEMPLATE, IM_END, IM_START, ChatTemplate


def write_chat(path, n, seed):
    """Synthetic conversations whose answers are predictable: the assistant repeats the user's words reversed."""
    rows = []
    for messages in conversations(n, seed=seed, turns=1, system=False):
        question = messages[0]["content"]
        rows.append({"messages": [messages[0], {"role": "assistant",
                                                "content": " ".join(reversed(question.rstrip("?").split()))}]})
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny base model directory whose tokenizer lacks the ChatML tokens, plus train/val chat files."""
    root = tmp_path_factory.mktemp("sft")
    tok = chat_tokenizer(with_chat_tokens=False)
    save_pretrained(tiny_model(tok.vocab_size), root / "base", tok)
    return root / "base", write_chat(root / "train.jsonl", 48, seed=10), write_chat(root / "val.jsonl", 8, seed=11)


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_full_sft_learns_and_writes_a_chat_model(tmp_path, base):
    model_dir, train, val = base
    last = sft(SFTConfig(model=str(model_dir), data=str(train), val_data=str(val), out_dir=str(tmp_path / "out"),
                         max_steps=40, lr=3e-3, batch_size=4, eval_interval=20, log_interval=5, device="cpu"))
    rows = metrics(tmp_path / "out")
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "padding_fraction"} <= set(rows[0])
    assert rows[-1]["step"] == 40 and last["val_loss"] == rows[-1]["val_loss"]
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    tok = load_tokenizer(tmp_path / "out")
    assert tok.token_to_id(IM_START) is not None and tok.token_to_id(IM_END) is not None
    assert load_chat_template(tmp_path / "out") == CHATML_TEMPLATE
    model = load_model(tmp_path / "out")
    assert model.config.vocab_size == tok.vocab_size
    # the validation loss on assistant tokens went down from the (resized) base model's
    untuned = load_model(model_dir)
    add_chat_tokens(untuned, load_tokenizer(model_dir))
    from minigpt.data.chat import load_chat_dataset, masked_lm_loss, pad_batch
    examples = load_chat_dataset(val, ChatTemplate(tok, CHATML_TRAINING_TEMPLATE), 256)
    batch = pad_batch(examples, tok.pad_id)
    with torch.no_grad():
        before = masked_lm_loss(untuned(batch.tokens), batch.labels).item()
        after = masked_lm_loss(model(batch.tokens), batch.labels).item()
    assert after == pytest.approx(last["val_loss"], abs=1e-4) and after < before - 0.5


def test_lora_sft_writes_a_peft_adapter_equal_to_the_merged_model(tmp_path, base):
    model_dir, train, _ = base
    sft(SFTConfig(model=str(model_dir), data=str(train), out_dir=str(tmp_path / "out"), lora_rank=4,
                  lora_alpha=8, lora_targets="q_proj,v_proj,down_proj", max_steps=10, lr=1e-2, batch_size=4,
                  pack=False, device="cpu"))
    config = json.loads((tmp_path / "out" / "adapter" / CONFIG_NAME).read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert config["modules_to_save"] == ["embed_tokens"] and config["base_model_name_or_path"] == str(model_dir)
    merged = load_model(tmp_path / "out")
    rebuilt = load_model(model_dir)
    add_chat_tokens(rebuilt, load_tokenizer(model_dir))  # the adapter's base: the vocabulary resized as in training
    base_norm = rebuilt.layers[0].attention_norm.weight.clone()
    load_adapter(rebuilt, tmp_path / "out" / "adapter")
    x = torch.randint(0, merged.config.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), merged(x), atol=1e-5, rtol=0)
    assert torch.equal(merged.layers[0].attention_norm.weight, base_norm)  # the base stayed frozen
    assert not torch.equal(merged.layers[0].attention.wq.weight, load_model(model_dir).layers[0].attention.wq.weight)


def test_sft_cli_then_generate(tmp_path, base):
    model_dir, train, val = base
    proc = run_cli("sft", "--model", model_dir, "--data", train, "--val-data", val, "--out-dir", tmp_path / "out",
                   "--max-steps", 3, "--batch-size", 2, "--device", "cpu", "--lora-rank", 2)
    assert proc.returncode == 0, proc.stderr
    assert "train.jsonl: 48 conversations" in proc.stdout and (tmp_path / "out" / "adapter").is_dir()
    proc = run_cli("generate", tmp_path / "out", "--prompt", "the cat", "--max-new-tokens", 5, "--seed", 0,
                   "--device", "cpu")
    assert proc.returncode == 0, proc.stderr


def test_sft_cli_errors_are_one_line(tmp_path, base):
    model_dir, train, _ = base
    bad = tmp_path / "bad.jsonl"
    bad.write_text(train.read_text() + "{oops\n")
    common = ("--model", model_dir, "--out-dir", tmp_path / "out", "--max-steps", 1, "--device", "cpu")
    assert_one_line_error(run_cli("sft", "--data", train, "--lora-rank", 0, *common), "lora_rank")
    assert_one_line_error(run_cli("sft", "--data", train, "--lora-rank", 2, "--lora-targets", "qkv", *common), "qkv")
    assert_one_line_error(run_cli("sft", "--data", bad, "--strict", *common), "bad.jsonl:49", "invalid JSON")
    assert_one_line_error(run_cli("sft", "--data", tmp_path / "none.jsonl", *common), "does not exist")
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    assert_one_line_error(run_cli("sft", "--data", train, "--model", model_dir, "--out-dir", tmp_path / "precious",
                                  "--max-steps", 1), "not an SFT output")


# ---------------------------------------------------------------------------------------- real data
def test_real_sft_files_load(shared_data):
    """The chat files of shared/data/sft (built from Alpaca and ShareGPT; never copied into the repository) load in
    full, except the Alpaca items whose output is empty (7 English, 5 Chinese), which are skipped and counted."""
    expected = {"alpaca_en.jsonl": (18000, 7), "alpaca_zh.jsonl": (10855, 5), "sharegpt_zh_multiturn.jsonl": (893, 0)}
    for name, (n, empty) in expected.items():
        path = shared_data / "sft" / name
        if not path.is_file():
            pytest.skip(f"{path} is absent")
        report = SkipReport()
        convs = read_conversations(path, report=report)
        assert len(convs) == n - empty and dict(report.skipped) == ({"empty content": empty} if empty else {})
    multi = read_conversations(shared_data / "sft" / "sharegpt_zh_multiturn.jsonl")
    assert sum(sum(m["role"] == "user" for m in c) > 1 for _, c in multi) == 562


def test_real_alpaca_sft_steps(tmp_path, shared_data, base):
    path = shared_data / "sft" / "alpaca_en.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    head = tmp_path / "head.jsonl"  # a temporary slice, outside the repository
    with open(path, encoding="utf-8") as f:
        head.write_text("".join(next(f) for _ in range(64)), encoding="utf-8")
    last = sft(SFTConfig(model=str(base[0]), data=str(head), out_dir=str(tmp_path / "out"), max_steps=4,
                         batch_size=2, device="cpu", lora_rank=4))
    assert last["step"] == 4 and last["loss"] > 0
    assert Path(tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
