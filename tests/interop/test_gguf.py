"""GGUF import/export: round trips, quantization error, parity with transformers' own GGUF loader, tokenizers rebuilt
from GGUF metadata, and one clear error per broken file."""
import json
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, random_model, run_cli

import minigpt.interop.gguf as gguf_io
from minigpt.checkpoint.convert import export_gguf, export_hf
from minigpt.checkpoint.native import import_model, load_model, load_tokenizer, model_state_dict, save_pretrained
from minigpt.errors import MiniGPTError
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.model.config import ModelConfig
from minigpt.tokenizer.interop import vocab_from_file

gguf = pytest.importorskip("gguf")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tokenizer():
    from minigpt.data.sources import BUNDLED
    from minigpt.tokenizer.tokenizer import train_tokenizer

    return train_tokenizer([BUNDLED["shakespeare"].path.read_text(encoding="utf-8")[:20000]], 300)


def vocab_of(tok):
    with tempfile.TemporaryDirectory() as tmp:
        return vocab_from_file(tok.save(Path(tmp)))


GGUF_SHAPE = dict(vocab_size=300, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256, max_seq_len=64)
# Shapes that are whole 256-value blocks, so every quantization type applies to every matrix.
random_model = partial(random_model, GGUF_SHAPE, norm_noise=0.1)


# ------------------------------------------------------------------------------------------------ round trips
@pytest.mark.slow
def test_f32_round_trip_is_identical(tmp_path, tokenizer):
    model = random_model(tie_embeddings=False, attention_bias=True)
    save_pretrained(model, tmp_path / "ours", tokenizer)
    proc = run_cli("export", tmp_path / "ours", tmp_path / "m.gguf", "--format", "gguf")
    assert proc.returncode == 0, proc.stderr
    back = load_model(tmp_path / "m.gguf")
    assert back.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    tok = load_tokenizer(tmp_path / "m.gguf")
    for text in ["ROMEO: What light through yonder window?", "  spaces  \n\n", "日本語 🙂", "<|endoftext|>"]:
        assert tok.encode(text) == tokenizer.encode(text) and tok.decode(tok.encode(text)) == text
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 0, 1)
    a, b = (run_cli("generate", src, "--prompt", "ROMEO:", "--temperature", 0, "--max-new-tokens", 12, "--device",
                    "cpu") for src in (tmp_path / "ours", tmp_path / "m.gguf"))
    assert a.returncode == 0 and a.stdout == b.stdout, (a.stderr, b.stderr)
    proc = run_cli("import", tmp_path / "m.gguf", tmp_path / "imported")
    assert proc.returncode == 0, proc.stderr
    assert torch.equal(load_model(tmp_path / "imported").output.weight, model.output.weight)


@pytest.mark.parametrize("dtype,torch_dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_half_types_round_trip_to_the_rounded_weights(tmp_path, dtype, torch_dtype):
    model = random_model()
    path = gguf_io.write_gguf(model_state_dict(model), model.config, tmp_path / "m.gguf", dtype)
    back = load_model(path)
    for k, v in model.state_dict().items():
        expected = v if v.dim() < 2 else v.to(torch_dtype).float()  # 1-D tensors stay float32
        assert torch.equal(back.state_dict()[k], expected), k


def test_q8_0_logits_are_close(tmp_path):
    """Q8_0 stores each block of 32 weights as int8 times one fp16 scale ``max|w| / 127``: a rounding error of at
    most half a step, uniform, i.e. an RMS error of ``max|w| / (127 * sqrt(12))`` ~ 0.5 % of a Gaussian weight's
    RMS for a block maximum of ~2.1 sigma. Every matmul adds such independent relative noise to its output; ~8 of
    them in sequence here (embedding, 3 per layer on the residual path, head) add up in quadrature to ~1.4 %.
    We assert < 3 % relative RMS logit error (measured: 1.04 %, max abs error 0.017 on logits of RMS 0.36) and that
    the error is not zero (it is really quantized)."""
    model = random_model()
    path = gguf_io.write_gguf(model_state_dict(model), model.config, tmp_path / "m.gguf", "q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32"
    back = load_model(path)
    tokens = torch.randint(0, 300, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact, quant = model(tokens), back(tokens)
    rel_rms = ((quant - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()
    print(f"Q8_0 relative RMS logit error {rel_rms:.4f}, max abs {(quant - exact).abs().max().item():.4f}, "
          f"logit RMS {exact.pow(2).mean().sqrt().item():.4f}")
    assert 1e-4 < rel_rms < 0.03


# ------------------------------------------------------------------------------------------------ vs transformers
K_SCALES = {"Q4_K": (1e-4, 5e-5), "Q5_K": (1e-4, 5e-5), "Q6_K": (2e-5, None)}


def _write_typed(model, path, qname, vocab, monkeypatch):
    """A GGUF whose matrices are all of type ``qname``. gguf-py quantizes F16..Q5_1 itself; it can only
    dequantize the K-quants, so those tensors are random blocks with small fixed fp16 scales (a valid model, just
    not a quantized copy of ``model``)."""
    qtype = gguf.GGMLQuantizationType[qname]
    original = gguf_io._add_tensor

    def typed(writer, name, array, _):
        if array.ndim < 2 or qname == "F32":
            return original(writer, name, array, gguf.GGMLQuantizationType.F32)
        if qname == "F16":
            return writer.add_tensor(name, array.astype(np.float16))
        if qname in K_SCALES:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            rng = np.random.default_rng(len(name) * 1000 + array.shape[0])
            raw = rng.integers(0, 256, (array.shape[0], array.shape[1] // block, size), dtype=np.uint8)
            d, dmin = K_SCALES[qname]
            if dmin is None:  # Q6_K: the scale is the block's last two bytes
                raw[..., -2:] = np.array([d], np.float16).view(np.uint8)
            else:  # Q4_K / Q5_K: d and dmin lead the block
                raw[..., 0:2] = np.array([d], np.float16).view(np.uint8)
                raw[..., 2:4] = np.array([dmin], np.float16).view(np.uint8)
            return writer.add_tensor(name, raw.reshape(array.shape[0], -1), raw_dtype=qtype)
        return writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

    monkeypatch.setattr(gguf_io, "_add_tensor", typed)
    gguf_io.write_gguf(model_state_dict(model), model.config, path, vocab=vocab)
    monkeypatch.setattr(gguf_io, "_add_tensor", original)
    assert {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2} == {qname}


# The types this test writes (gguf-py quantizes the first ones; K-quants get random blocks); every other type
# MiniGPT reads is checked against gguf-py's dequantization in tests/test_real_models.py.
WRITTEN_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@pytest.mark.parametrize("qname", WRITTEN_TYPES)
def test_import_matches_transformers_gguf_loader(tmp_path, tokenizer, qname, monkeypatch):
    """Tolerance 1e-5 for every type: both sides dequantize with gguf-py's reference routines, so they hold the
    same float32 weights and only summation order can differ (measured: exactly 0). What this checks is the rest
    of the import: names, shapes, the undone Q/K row permutation, tying, and the hyper-parameters."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    model = random_model()
    _write_typed(model, tmp_path / "model.gguf", qname, vocab_of(tokenizer), monkeypatch)
    ours = load_model(tmp_path / "model.gguf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf").eval()
    tokens = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, atol=1e-5, rtol=0)


def test_transformers_reads_our_gguf_tokenizer(tmp_path, tokenizer):
    transformers = pytest.importorskip("transformers")
    model = random_model()
    gguf_io.write_gguf(model_state_dict(model), model.config, tmp_path / "model.gguf", vocab=vocab_of(tokenizer))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf")
    for text in ["ROMEO: What light through yonder window breaks?", "  spaces  \n\n", "日本語 🙂"]:
        assert theirs(text).input_ids == tokenizer.encode(text), text
        assert theirs.decode(tokenizer.encode(text)) == text


def test_chat_template_is_carried_over(tmp_path, tokenizer):
    transformers = pytest.importorskip("transformers")
    model = random_model()
    vocab = vocab_of(tokenizer)
    vocab.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    gguf_io.write_gguf(model_state_dict(model), model.config, tmp_path / "model.gguf", vocab=vocab)
    import_model(tmp_path / "model.gguf", tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "tokenizer_config.json").read_text())["chat_template"] == vocab.chat_template
    export_hf(tmp_path / "ours", tmp_path / "hf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = theirs.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "user: hi\n"
    export_gguf(tmp_path / "hf", tmp_path / "again.gguf")
    assert gguf_io.read_vocab(tmp_path / "again.gguf").chat_template == vocab.chat_template


def test_sentencepiece_vocabulary_through_gguf(tmp_path, shared_data):
    """stories260K (a SentencePiece tokenizer.model): HF dir -> GGUF -> ours reproduces the reference greedy ids, and
    the tokenizer rebuilt from the GGUF's scores encodes like sentencepiece."""
    folder = shared_data / "models" / "stories260K"
    path = export_gguf(folder / "hf", tmp_path / "stories.gguf")
    vocab = gguf_io.read_vocab(path)
    assert vocab.model == "llama" and vocab.tokens[1] == "<s>" and vocab.types[3] == 6  # <0x00> is a BYTE token
    ref = json.loads((folder / "reference_outputs.json").read_text())["greedy"]
    model = load_model(path)
    params = SamplingParams(max_tokens=80, temperature=0)
    out = list(generate_tokens(model, ref["prompt_ids"], params, stop_ids=[ref["stop_on_token"]]))
    assert out == ref["generated_ids"][:80]
    rebuilt, sp = load_tokenizer(path), load_tokenizer(folder / "hf")
    for text in ["Once upon a time, there was a little girl named Lily.", "She had 123 balls!\nThe end.", "日本"]:
        assert rebuilt.encode(text) == sp.encode(text), text
        assert rebuilt.decode(sp.encode(text)) == sp.decode(sp.encode(text))


# ------------------------------------------------------------------------------------------------ errors


def test_unsupported_architecture(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_line_error(run_cli("import", tmp_path / "gpt2.gguf", tmp_path / "out"),
                          "unsupported GGUF architecture 'gpt2'")


def test_missing_tensor_and_shape_mismatch(tmp_path, monkeypatch):
    model = random_model()
    original = gguf_io._add_tensor
    monkeypatch.setattr(gguf_io, "_add_tensor", lambda w, name, a, q: None if name == "blk.1.ffn_up.weight"
                        else original(w, name, a, q))
    gguf_io.write_gguf(model_state_dict(model), model.config, tmp_path / "missing.gguf")
    monkeypatch.setattr(gguf_io, "_add_tensor", original)
    with pytest.raises(MiniGPTError, match=r"missing tensors \['layers.1.feed_forward.w3.weight'\]"):
        load_model(tmp_path / "missing.gguf")
    wrong = ModelConfig(**{**model.config.to_dict(), "hidden_dim": 512})
    gguf_io.write_gguf(model_state_dict(model), wrong, tmp_path / "shape.gguf")
    assert_one_line_error(run_cli("generate", tmp_path / "shape.gguf", "--prompt", "x"),
                          "has shape (256, 256) but the config implies (512, 256)")


def test_unknown_and_unsupported_quantization_types(tmp_path, monkeypatch):
    model = random_model()
    path = gguf_io.write_gguf(model_state_dict(model), model.config, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(path, "r+")
    raw_type = reader.tensors[0].field.parts[4]
    raw_type[0] = 99  # no such GGML type
    reader.data.flush()
    del reader, raw_type
    assert_one_line_error(run_cli("import", path, tmp_path / "out"), "unknown GGUF quantization type")

    original = gguf_io._add_tensor

    def q8k(writer, name, array, qtype):  # Q8_K: a type gguf-py cannot dequantize (llama.cpp's dot-product helper)
        if name != "blk.0.ffn_up.weight":
            return original(writer, name, array, qtype)
        size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K][1]
        writer.add_tensor(name, np.zeros((array.shape[0], size), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_K)

    monkeypatch.setattr(gguf_io, "_add_tensor", q8k)
    gguf_io.write_gguf(model_state_dict(model), model.config, tmp_path / "q8k.gguf")
    monkeypatch.setattr(gguf_io, "_add_tensor", original)
    with pytest.raises(MiniGPTError, match="blk.0.ffn_up.weight has quantization type Q8_K, which is not supported"):
        load_model(tmp_path / "q8k.gguf")


def test_truncated_file(tmp_path):
    model = random_model()
    path = gguf_io.write_gguf(model_state_dict(model), model.config, tmp_path / "m.gguf")
    data = path.read_bytes()
    for cut in (len(data) // 2, 100):
        path.write_bytes(data[:cut])
        assert_one_line_error(run_cli("import", path, tmp_path / "out"), "not a valid GGUF file or is truncated")


def test_unsupported_rope_scaling_for_gguf_export(tmp_path):
    model = random_model(rope_scaling={"type": "yarn", "factor": 2.0})
    with pytest.raises(MiniGPTError, match="RoPE scaling 'yarn' cannot be written to GGUF"):
        gguf_io.write_gguf(model_state_dict(model), model.config, tmp_path / "m.gguf")


def test_pre_tokenizer_patterns_round_trip(tmp_path, tokenizer):
    """A byte-level vocabulary with Llama 3's split pattern: built from GGUF-style metadata, saved, read back under
    the same llama.cpp name; so does Mistral's tekken (multi-regex and other names: tests/test_real_models.py)."""
    from minigpt.tokenizer.interop import build_tokenizer

    vocab = vocab_of(tokenizer)
    vocab.pre = "llama-bpe"
    built = build_tokenizer(vocab)
    pieces = [p for p, _ in built.pre_tokenizer.pre_tokenize_str("abc 12345 def")]
    assert pieces == ["abc", "Ġ", "123", "45", "Ġdef"]  # digits split in groups of 3, the space stands alone
    built.save(str(tmp_path / "tokenizer.json"))
    assert vocab_from_file(tmp_path / "tokenizer.json").pre == "llama-bpe"
    vocab.pre = "tekken"
    pieces = [p for p, _ in build_tokenizer(vocab).pre_tokenizer.pre_tokenize_str("camelCase 12345")]
    assert pieces == ["camel", "Case", "Ġ", "1", "2", "3", "4", "5"]  # a capital starts a word; digits one by one
    build_tokenizer(vocab).save(str(tmp_path / "tokenizer.json"))
    assert vocab_from_file(tmp_path / "tokenizer.json").pre == "tekken"
