"""Export keeps the special-token roles: a tokenizer that prepends BOS still does after export (HF and GGUF), and
every stop id (EOS and the end-of-turn tokens) survives export -> re-import, readable by transformers."""
import json

import pytest
from conftest import random_model

from minigpt.checkpoint.convert import export_gguf, export_hf
from minigpt.checkpoint.native import load_tokenizer, save_pretrained
from minigpt.checkpoint.tokenizer_bos import adds_bos
from minigpt.tokenizer.chat_template import add_special_tokens
from minigpt.tokenizer.tokenizer import train_tokenizer

TEXTS = ["Once upon a time, there was a little girl named Lily.", "She liked to play  outside\nin the sun!",
         " leading space, digits 12345 and unicode: café", "<s> is written as text here"]
SHAPE = {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64, "multiple_of": 16}


@pytest.mark.parametrize("name", ["stories260K.bin", "hf"])
def test_llama2c_export_prepends_bos_like_its_source(shared_data, tmp_path, monkeypatch, name):
    """stories260K (llama2.c, trained with BOS before every story): our tokenizer for it adds BOS by default, so the
    exported tokenizer must too, for transformers and for MiniGPT reading the export back."""
    transformers = pytest.importorskip("transformers", reason="a test-only dependency (pip install .[dev])")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = shared_data / "models" / "stories260K" / name
    ours = load_tokenizer(source)
    assert adds_bos(source, ours) is True and ours.bos_id == 1
    out = export_hf(source, tmp_path / "hf")
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    back = load_tokenizer(out)
    assert adds_bos(out, back) is True
    for text in TEXTS:
        expected = [ours.bos_id] + ours.encode(text)
        assert theirs(text)["input_ids"] == expected, text
        assert back.encode(text) == expected[1:], text
    gguf_file = export_gguf(source, tmp_path / "model.gguf")
    assert adds_bos(gguf_file, load_tokenizer(gguf_file)) is True


def test_byte_level_export_adds_no_bos(tmp_path, monkeypatch):
    """MiniGPT's own byte-level BPE prepends nothing; its export neither."""
    transformers = pytest.importorskip("transformers", reason="a test-only dependency (pip install .[dev])")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = train_tokenizer(TEXTS * 4, 300)
    save_pretrained(random_model(SHAPE, vocab_size=tokenizer.vocab_size), tmp_path / "native", tokenizer)
    out = export_hf(tmp_path / "native", tmp_path / "hf")
    assert adds_bos(out, load_tokenizer(out)) is False
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert theirs(text)["input_ids"] == tokenizer.encode(text)


def _chat_model(root, extra_stops=()):
    """A native model whose byte-level tokenizer has ChatML tokens added (its stop ids: ``<|endoftext|>`` and, by
    name, ``<|im_end|>``) or, with ``extra_stops``, those tokens instead, listed in generation_config.json after EOS.
    (A GGUF's reader also stops on every token spelled as llama.cpp's end-of-generation names, so the vocabulary
    holds no such token that is not a stop id.)"""
    tokens = extra_stops or ("<|im_start|>", "<|im_end|>")
    tokenizer, _ = add_special_tokens(train_tokenizer(TEXTS * 4, 300), tokens)
    directory = save_pretrained(random_model(SHAPE, vocab_size=tokenizer.vocab_size), root / "native", tokenizer)
    if extra_stops:
        stops = [tokenizer.eos_id] + [tokenizer.token_to_id(t) for t in extra_stops]
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
        (directory / "manifest.json").unlink()  # the added file is not in the recorded hashes
    return directory


@pytest.mark.parametrize("extra_stops", [(), ("<|eot_id|>", "<|eom_id|>")], ids=["chatml", "eot-eom"])
def test_stop_ids_round_trip_through_hf_and_gguf(tmp_path, monkeypatch, extra_stops):
    transformers = pytest.importorskip("transformers", reason="a test-only dependency (pip install .[dev])")
    gguf = pytest.importorskip("gguf")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = _chat_model(tmp_path, extra_stops)
    tokenizer = load_tokenizer(source)
    stops = tokenizer.stop_ids
    expected = {(): ["<|endoftext|>", "<|im_end|>"],
                ("<|eot_id|>", "<|eom_id|>"): ["<|endoftext|>", "<|eot_id|>", "<|eom_id|>"]}[extra_stops]
    assert [tokenizer.id_to_token(i) for i in stops] == expected

    out = export_hf(source, tmp_path / "hf")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == list(stops)
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == list(stops)
    assert load_tokenizer(out).stop_ids == stops

    path = export_gguf(source, tmp_path / "model.gguf")
    fields = gguf.GGUFReader(path).fields
    keys = gguf.Keys.Tokenizer

    def value(key):
        return fields[key].contents() if key in fields else None

    assert value(keys.EOS_ID) == tokenizer.eos_id
    assert value(keys.EOT_ID) == stops[1]
    assert value(keys.EOM_ID) == (stops[2] if len(stops) > 2 else None)
    assert load_tokenizer(path).stop_ids == stops


def test_adding_chat_tokens_keeps_bos_through_a_saved_model(shared_data, tmp_path):
    """SFT adds the ChatML tokens to stories260K's SentencePiece tokenizer, which turns it into a `tokenizers` one;
    the model it saves must still prepend BOS to plain prompts, as its base did (and keep EOS and the stops)."""
    from minigpt.checkpoint.native import load_model

    source = shared_data / "models" / "stories260K" / "hf"
    base = load_tokenizer(source)
    grown, new_ids = add_special_tokens(base)
    assert grown.backend == "tokenizers" and len(new_ids) == 2 and grown.add_bos is True
    save_pretrained(load_model(source), tmp_path / "sft", grown)
    back = load_tokenizer(tmp_path / "sft")
    assert adds_bos(tmp_path / "sft", back) is True is adds_bos(source, base)
    assert (back.bos_id, back.eos_id) == (base.bos_id, base.eos_id)
    assert set(back.stop_ids) == set(grown.stop_ids) and grown.token_to_id("<|im_end|>") in back.stop_ids
    for text in TEXTS[:3]:
        assert back.encode(text) == base.encode(text), text
