"""LoRA adapters whose training added tokens (SFT adding the ChatML tokens to a base without them): the adapter
folder carries the grown embedding / LM-head rows, and loading it onto the base grows the base's vocabulary to the
adapter's, as PEFT users resize the base to the adapter's tokenizer before loading it."""
import json

import pytest
import torch
from chat_helpers import chat_tokenizer, conversations, tiny_model
from conftest import assert_one_line_error, run_cli
from safetensors.torch import load_file, save_file

from minigpt.checkpoint.adapter import (
    WEIGHTS_NAME,
    adapter_vocab_size,
    load_adapter,
    load_merged,
    read_adapter,
    save_adapter,
    tokenizer_source,
)
from minigpt.checkpoint.native import load_chat_template, load_model, load_tokenizer, save_pretrained
from minigpt.errors import MiniGPTError
from minigpt.model.lora import apply_lora, lora_layers, merge_lora
from minigpt.posttrain.sft import SFTConfig, sft
from minigpt.posttrain.vocab import add_chat_tokens

EMBED = "base_model.model.model.embed_tokens.weight"
HEAD = "base_model.model.lm_head.weight"


def write_chat(path, n, seed):
    rows = [{"messages": m} for m in conversations(n, seed=seed, turns=1, system=False)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A tiny base whose tokenizer lacks the ChatML tokens, and a 2-step LoRA SFT over it (which adds them)."""
    root = tmp_path_factory.mktemp("adapter_vocab")
    tok = chat_tokenizer(with_chat_tokens=False)
    save_pretrained(tiny_model(tok.vocab_size), root / "base", tok)
    sft(SFTConfig(model=str(root / "base"), data=str(write_chat(root / "train.jsonl", 16, seed=3)),
                  out_dir=str(root / "out"), lora_rank=2, lora_alpha=4, max_steps=2, lr=1e-2, batch_size=4,
                  pack=False, device="cpu", lora_dropout=0.0))
    return root / "base", root / "out"


def handmade_adapter(directory, vocab_size, added=2, tie=True, seed=1):
    """A LoRA adapter over ``tiny_model(vocab_size, tie_embeddings=tie)`` grown by ``added`` rows, with random
    LoRA B and embedding / LM-head rows; returns the reference model (the grown base with it merged by hand)."""
    from minigpt.model.transformer import resize_token_embeddings

    model = tiny_model(vocab_size, tie_embeddings=tie)
    resize_token_embeddings(model, vocab_size + added)
    apply_lora(model, 2, 4.0, targets="q_proj,down_proj")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.1)
        for weight in {id(w): w for w in (model.tok_embeddings.weight, model.output.weight)}.values():
            weight.add_(torch.randn(weight.shape, generator=g) * 0.1)
    save_adapter(model, directory, modules_to_save=["embed_tokens"] if tie else ["embed_tokens", "lm_head"])
    return merge_lora(model).eval()


def logits(model, vocab_size, seed=0):
    x = torch.randint(0, vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(x)


def test_sft_adapter_merges_onto_the_base_it_grew(sft_run):
    """The base plus the adapter is the SFT output (the adapter merged into the grown base) and its vocabulary."""
    base, out = sft_run
    base_vocab = load_model(base).config.vocab_size
    full = load_model(out)
    assert full.config.vocab_size == base_vocab + 2 == adapter_vocab_size(out / "adapter")
    merged = load_merged(base, out / "adapter")
    assert merged.config.vocab_size == base_vocab + 2
    assert merged.tok_embeddings.weight.shape[0] == merged.output.weight.shape[0] == base_vocab + 2
    assert merged.config.tie_embeddings and merged.output.weight is merged.tok_embeddings.weight
    torch.testing.assert_close(logits(merged, base_vocab + 2), logits(full, base_vocab + 2), atol=1e-5, rtol=0)
    # The tokenizer and template with the added tokens are the SFT output's, beside adapter/.
    source = tokenizer_source(base, out / "adapter")
    assert source == out and load_tokenizer(source).vocab_size == base_vocab + 2
    assert "<|im_start|>" in load_chat_template(source)
    assert tokenizer_source(base, None) == base and tokenizer_source(base) == base


def test_load_adapter_grows_the_vocabulary_in_place(sft_run):
    """load_adapter on the plain base: the vocabulary grows to the adapter's, the saved rows replace the base's and
    train, the base stays frozen; on a base already grown (as in training) it loads as before."""
    base, out = sft_run
    model = load_model(base)
    vocab = model.config.vocab_size
    load_adapter(model, out / "adapter")
    assert model.config.vocab_size == vocab + 2 and model.output.weight is model.tok_embeddings.weight
    saved = load_file(str(out / "adapter" / WEIGHTS_NAME))[EMBED]
    assert torch.equal(model.tok_embeddings.weight.detach(), saved)
    assert model.tok_embeddings.weight.requires_grad and not model.layers[0].attention_norm.weight.requires_grad
    grown = load_model(base)
    add_chat_tokens(grown, load_tokenizer(base))
    load_adapter(grown, out / "adapter")
    torch.testing.assert_close(logits(merge_lora(grown), vocab + 2), logits(merge_lora(model), vocab + 2))


@pytest.mark.parametrize("tie", [True, False])
def test_handmade_adapter_equals_the_reference(tmp_path, tie):
    """Tied and untied bases: the merged model's logits equal the adapter's model merged by hand."""
    reference = handmade_adapter(tmp_path / "adapter", 64, tie=tie)
    save_pretrained(tiny_model(64, tie_embeddings=tie), tmp_path / "base")
    merged = load_merged(tmp_path / "base", tmp_path / "adapter")
    assert merged.config.vocab_size == 66 and merged.config.tie_embeddings == tie
    assert (merged.output.weight is merged.tok_embeddings.weight) == tie
    torch.testing.assert_close(logits(merged, 66), logits(reference, 66), atol=1e-6, rtol=0)


def test_smaller_or_other_width_adapters_are_refused(tmp_path):
    """An adapter of fewer vocabulary rows than the base, of another width, or whose embedding and LM-head rows
    disagree, is one error naming the tensor and both shapes; the base is left as it was."""
    handmade_adapter(tmp_path / "small", 64, added=0, tie=False)
    bigger = tiny_model(66, tie_embeddings=False)
    with pytest.raises(MiniGPTError, match=r"(tok_embeddings|output).weight has shape \(64, 32\).*\(66, 32\).*shrink"):
        load_adapter(bigger, tmp_path / "small")
    assert bigger.config.vocab_size == 66 and bigger.tok_embeddings.weight.shape == (66, 32)

    handmade_adapter(tmp_path / "wide", 64, tie=False)
    path = tmp_path / "wide" / WEIGHTS_NAME
    tensors = load_file(str(path))
    tensors[EMBED] = torch.zeros(66, 40)
    save_file(tensors, str(path))
    model = tiny_model(64, tie_embeddings=False)
    with pytest.raises(MiniGPTError, match=r"tok_embeddings.weight has shape \(66, 40\) but the base model's is "
                                           r"\(64, 32\)"):
        load_adapter(model, tmp_path / "wide")
    assert model.config.vocab_size == 64

    tensors[EMBED] = torch.zeros(68, 32)
    save_file(tensors, str(path))
    with pytest.raises(MiniGPTError, match="disagree on the vocabulary size"):
        load_adapter(model, tmp_path / "wide")
    assert model.config.vocab_size == 64 and not lora_layers(model)


def test_adapters_by_name_refuse_a_grown_vocabulary(tmp_path, sft_run):
    base, out = sft_run
    with pytest.raises(MiniGPTError, match=r"grows the vocabulary from \d+ to \d+ tokens.*--adapter DIR"):
        read_adapter(load_model(base), out / "adapter")


@pytest.mark.slow
def test_cli_merge_generate_and_serve_by_name(tmp_path, sft_run):
    """`lora merge` writes the grown model with the adapter's tokenizer; `generate --adapter` runs; `serve
    --adapter NAME=DIR` is a one-line error."""
    base, out = sft_run
    proc = run_cli("lora", "merge", base, out / "adapter", "--out-dir", tmp_path / "merged")
    assert proc.returncode == 0, proc.stderr
    merged, full = load_model(tmp_path / "merged"), load_model(out)
    vocab = full.config.vocab_size
    assert merged.config.vocab_size == load_tokenizer(tmp_path / "merged").vocab_size == vocab
    torch.testing.assert_close(logits(merged, vocab), logits(full, vocab), atol=1e-5, rtol=0)
    common = ("--prompt", "the cat", "--max-new-tokens", 5, "--seed", 0, "--device", "cpu", "--bos")
    with_adapter = run_cli("generate", base, "--adapter", out / "adapter", *common)
    assert with_adapter.returncode == 0, with_adapter.stderr
    assert_one_line_error(run_cli("serve", base, "--adapter", f"a={out / 'adapter'}", "--device", "cpu"),
                          "grows the vocabulary", "--adapter DIR")


def test_generate_with_the_adapter_speaks_as_the_sft_output(sft_run, capsys):
    """`generate BASE --adapter` takes the adapter's tokenizer and chat template (with the tokens SFT added):
    the same rendered prompt and tokens as `generate` of the SFT output itself."""
    from minigpt.cli import main

    base, out = sft_run
    common = ["--chat", "the cat", "--echo", "--max-new-tokens", "4", "--temperature", "0", "--device", "cpu"]
    assert main(["generate", str(base), "--adapter", str(out / "adapter"), *common]) == 0
    with_adapter = capsys.readouterr().out
    assert main(["generate", str(out), *common]) == 0
    assert with_adapter == capsys.readouterr().out
    assert "<|im_start|>" in with_adapter  # ChatML, not the base's plain "User:" template


def test_merge_refuses_an_adapter_tokenizer_it_cannot_read(tmp_path, sft_run):
    """`lora merge` takes the tokenizer generate/chat/serve would (tokenizer_source): one in the adapter folder
    that cannot be read is a one-line error and writes nothing, not a silent fall-back to the base's tokenizer,
    whose vocabulary lacks the tokens the adapter added."""
    import shutil

    base, out = sft_run
    adapter = tmp_path / "adapter"
    shutil.copytree(out / "adapter", adapter)
    (adapter / "tokenizer.json").write_text("{not json", encoding="utf-8")
    proc = run_cli("lora", "merge", base, adapter, "--out-dir", tmp_path / "merged")
    assert_one_line_error(proc, "tokenizer.json")
    assert not (tmp_path / "merged").exists()
