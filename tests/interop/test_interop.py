"""Interoperability with transformers: a logit/greedy parity matrix, RoPE scaling, padded batches, HF directories in
and out (sharded, fp16/bf16, Mistral, Qwen2), llama2.c files, clear errors, and an end-to-end export check."""
import json
import os
import struct
import subprocess
import sys
from functools import partial

import pytest
import torch
from conftest import assert_one_line_error, random_model, run_cli, train_config

from minigpt.checkpoint.convert import export_hf
from minigpt.checkpoint.native import import_model, load_model, load_tokenizer, save_pretrained
from minigpt.errors import MiniGPTError
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.interop import hf
from minigpt.model.config import ModelConfig
from minigpt.model.rope import half_to_interleaved, rope_tables
from minigpt.model.transformer import Transformer
from minigpt.runtime import parse_size

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (pip install .[dev])")

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "HF_DATASETS_OFFLINE": "1"}
torch.set_num_threads(1)


SHAPE = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_seq_len=96)
# Every parameter random (norm gains and biases too, so none of them is a no-op).
random_model = partial(random_model, SHAPE, noise=0.02, norm_noise=0.1)


def hf_reference(model: Transformer):
    """transformers' LlamaForCausalLM with the same config and weights (a fresh instance: dynamic RoPE is stateful)."""
    d = hf.config_to_hf(model.config, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**d)).eval()
    missing, unexpected = ref.load_state_dict(hf.state_dict_to_hf(
        {k: v for k, v in model.state_dict().items() if not (model.config.tie_embeddings and k == "output.weight")}),
        strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return ref


def hf_greedy(model: Transformer, prompt: list[int], steps: int) -> list[int]:
    ref = hf_reference(model)
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0,
                       attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


# ------------------------------------------------------------------------------------------------ parity matrix
YARN = {"type": "yarn", "factor": 4.0, "original_max_seq_len": 24}
CASES = {
    "mha-tied": dict(n_kv_heads=4, tie_embeddings=True),
    "gqa-untied": dict(n_kv_heads=2, tie_embeddings=False),
    "mqa": dict(n_kv_heads=1),
    "theta500k": dict(n_kv_heads=2, rope_theta=500000.0),
    "head_dim-explicit": dict(dim=48, n_kv_heads=2, head_dim=16),  # 48 // 4 = 12 != 16
    "eps1e-5": dict(n_kv_heads=2, norm_eps=1e-5),
    "eps1e-6": dict(n_kv_heads=2, norm_eps=1e-6),
    "attention-bias": dict(n_kv_heads=2, attention_bias=True),
    "rope-linear": dict(n_kv_heads=2, rope_scaling={"type": "linear", "factor": 2.0}),
    "rope-dynamic": dict(n_kv_heads=2, rope_scaling={"type": "dynamic", "factor": 2.0, "original_max_seq_len": 24}),
    "rope-llama3": dict(n_kv_heads=2, head_dim=16, rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_seq_len": 24}),
    "rope-yarn": dict(n_kv_heads=2, head_dim=16, rope_scaling=YARN),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_parity_with_transformers(case):
    """fp32 logits within 1e-5 and 32 identical greedy tokens. Sequences (60 positions, prompts of 40) run past the
    original context of 24 of the scaled cases, where scaling differs from plain RoPE."""
    model = random_model(**CASES[case])
    tokens = torch.randint(0, 97, (2, 60), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf_reference(model)(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    prompt = tokens[0, :40].tolist()
    greedy = SamplingParams(max_tokens=32, temperature=0)
    assert list(generate_tokens(model, prompt, greedy)) == hf_greedy(model, prompt, 32)


@pytest.mark.parametrize("case", ["rope-linear", "rope-dynamic", "rope-llama3", "rope-yarn"])
def test_rope_scaling_changes_the_tables_only_where_it_should(case):
    """A guard against a scaling that silently does nothing: each type changes some frequency (dynamic only beyond
    the original context, where the logits must then differ from plain RoPE)."""
    model = random_model(**CASES[case])
    plain = random_model(**{**CASES[case], "rope_scaling": None})
    tokens = torch.randint(0, 97, (1, 60))
    with torch.no_grad():
        differs = (model(tokens) - plain(tokens)).abs().amax(-1)[0]
    if case == "rope-dynamic":  # below the original context dynamic NTK is plain RoPE
        cut = model.rope.original
        assert torch.equal(model(tokens[:, :cut]), plain(tokens[:, :cut]))
    assert differs[-1] > 1e-4


def test_no_scaling_tables_unchanged_bit_for_bit():
    cos, sin = rope_tables(16, 64, 10000.0)
    positions = torch.arange(64).float()
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    emb = torch.cat([torch.outer(positions, inv)] * 2, dim=-1)
    assert torch.equal(cos, emb.cos()) and torch.equal(sin, emb.sin())


def test_rope_scaling_validation():
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig(rope_scaling={"type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="needs"):
        ModelConfig(rope_scaling={"type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="unknown keys"):
        ModelConfig(rope_scaling={"type": "linear", "factor": 2.0, "beta_fast": 3})
    with pytest.raises(ValueError, match=">= 1"):
        ModelConfig(rope_scaling={"type": "linear", "factor": 0.5})


# ------------------------------------------------------------------------------------------------ padded batches
def _left_padded(prompts, pad=0):
    width = max(map(len, prompts))
    tokens = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return tokens, mask


@pytest.mark.parametrize("case", ["gqa-untied", "rope-dynamic", "rope-yarn"])
def test_padded_batch_matches_transformers_and_single_rows(case):
    model = random_model(**CASES[case])
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 97, (n,), generator=g).tolist() for n in (7, 30, 19)]
    tokens, mask = _left_padded(prompts)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        ours = model(tokens, attention_mask=mask)
        theirs = hf_reference(model)(tokens, attention_mask=mask, position_ids=positions).logits
        real = mask.bool()
        torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)
    if case == "rope-dynamic":
        return  # its frequencies follow the longest row, so a short row differs from itself run alone (also in HF)
    with torch.no_grad():
        for row, p in enumerate(prompts):  # each row equals that prompt run alone
            torch.testing.assert_close(ours[row, -len(p):], model(torch.tensor([p]))[0], atol=1e-5, rtol=0)
    # transformers' batched greedy generation equals ours one prompt at a time
    out = hf_reference(model).generate(tokens, attention_mask=mask, max_new_tokens=32, do_sample=False,
                                       pad_token_id=0)
    greedy = SamplingParams(max_tokens=32, temperature=0)
    for row, p in enumerate(prompts):
        assert out[row, tokens.shape[1]:].tolist() == list(generate_tokens(model, p, greedy))


def test_attention_mask_extends_to_the_kv_cache():
    """Prefill with a mask, then decode one token with the mask grown by one column: same logits as one pass."""
    model = random_model(n_kv_heads=2)
    tokens, mask = _left_padded([[5, 6, 7], [8, 9, 10, 11, 12, 13]])
    with torch.no_grad():
        full = model(tokens, attention_mask=mask)
        cache = model.new_kv_cache(2, 16)
        model(tokens[:, :-1], 0, cache, attention_mask=mask[:, :-1])
        last = model(tokens[:, -1:], tokens.shape[1] - 1, cache, attention_mask=mask)
    torch.testing.assert_close(last[:, 0], full[:, -1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(tokens, attention_mask=mask[:, 1:])


# ------------------------------------------------------------------------------------------------ HF directories
def _tokenizer():
    from minigpt.data.sources import BUNDLED
    from minigpt.tokenizer.tokenizer import train_tokenizer

    return train_tokenizer([BUNDLED["shakespeare"].path.read_text(encoding="utf-8")[:20000]], 300)


@pytest.mark.parametrize("kw", [dict(n_kv_heads=2), dict(n_kv_heads=1, tie_embeddings=False, attention_bias=True),
                                dict(n_kv_heads=2, rope_scaling=CASES["rope-llama3"]["rope_scaling"], head_dim=16),
                                dict(n_kv_heads=2, rope_scaling=CASES["rope-dynamic"]["rope_scaling"], max_seq_len=48)],
                         ids=["plain", "untied-bias", "llama3", "dynamic"])
def test_export_hf_round_trip_is_bit_identical(tmp_path, kw):
    model = random_model(vocab_size=300, **kw)
    save_pretrained(model, tmp_path / "ours", _tokenizer())
    export_hf(tmp_path / "ours", tmp_path / "hf", max_shard_size="30KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()  # sharded
    back = load_model(tmp_path / "hf")
    assert back.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 300, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(ref(tokens).logits, model(tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_and_sharded_hf_dirs_load_and_match(tmp_path, dtype):
    model = random_model(n_kv_heads=2, tie_embeddings=False)
    ref = hf_reference(model).to(dtype)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = load_model(tmp_path / "hf")
    assert ours.tok_embeddings.weight.dtype == torch.float32
    tokens = torch.randint(0, 97, (1, 30))
    with torch.no_grad():
        # the half weights, widened exactly to float32 on both sides
        torch.testing.assert_close(ours(tokens), ref.float()(tokens).logits, atol=1e-5, rtol=0)
    in_half = load_model(tmp_path / "hf", dtype=dtype)
    assert torch.equal(in_half.output.weight, ref.lm_head.weight.to(dtype))


def test_export_hf_in_bfloat16(tmp_path):
    model = random_model(vocab_size=300, n_kv_heads=2)
    save_pretrained(model, tmp_path / "ours", _tokenizer())
    export_hf(tmp_path / "ours", tmp_path / "hf", dtype="bfloat16")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    back = load_model(tmp_path / "hf")
    assert torch.equal(back.tok_embeddings.weight, model.tok_embeddings.weight.to(torch.bfloat16).float())


def _foreign_dir(tmp_path, config_cls, model_cls, **kw):
    torch.manual_seed(3)
    cfg = config_cls(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, **kw)
    ref = model_cls(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref.save_pretrained(tmp_path / "src")
    return ref


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_mistral_and_qwen2_dirs_match_transformers(tmp_path, arch):
    if arch == "mistral":
        ref = _foreign_dir(tmp_path, transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=None)
    else:
        ref = _foreign_dir(tmp_path, transformers.Qwen2Config, transformers.Qwen2ForCausalLM, rope_theta=1e6)
    ours = load_model(tmp_path / "src")
    assert ours.config.attention_bias == (arch == "qwen2")
    tokens = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), ref(tokens).logits, atol=1e-5, rtol=0)
    # and through `minigpt import` plus a Llama export, still the same function
    import_model(tmp_path / "src", tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "llama")
    llama = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama").eval()
    assert type(llama).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(llama(tokens).logits, ref(tokens).logits, atol=1e-5, rtol=0)


def test_qwen2_sliding_in_some_layers_only_is_refused(tmp_path):
    # Mistral's window (every layer) is supported: tests/interop/test_architectures.py
    _foreign_dir(tmp_path, transformers.Qwen2Config, transformers.Qwen2ForCausalLM, use_sliding_window=True,
                 sliding_window=16, max_window_layers=1)
    with pytest.raises(MiniGPTError, match="sliding-window attention in 1 of 2 layers is not supported"):
        load_model(tmp_path / "src")


def test_exported_tokenizer_matches_ours_in_transformers(tmp_path):
    tok = _tokenizer()
    save_pretrained(random_model(vocab_size=300), tmp_path / "ours", tok)
    export_hf(tmp_path / "ours", tmp_path / "hf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in ["ROMEO: What light through yonder window breaks?", "  two  spaces\nand a newline ",
                 "the literal <|endoftext|> stays text", "日本語 and emoji 🙂", ""]:
        assert theirs(text).input_ids == tok.encode(text), text  # no BOS added, specials not parsed
        assert theirs.decode(tok.encode(text)) == text
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (0, 0, 1)


def test_features_a_llama_cannot_hold_are_refused_by_name():
    from dataclasses import dataclass

    @dataclass
    class Variant(ModelConfig):  # a field a later feature might add to ModelConfig
        norm: str = "rmsnorm"

    hf.config_to_hf(Variant())
    with pytest.raises(MiniGPTError, match="norm='layernorm' cannot be represented in a LlamaForCausalLM export"):
        hf.config_to_hf(Variant(norm="layernorm"))


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("1GiB") == 2**30 and parse_size("30KB") == 30000
    with pytest.raises(MiniGPTError, match="cannot read 'lots' as a size"):
        parse_size("lots")
    with pytest.raises(MiniGPTError, match="below the minimum of 1 bytes"):
        parse_size("0", "--max-shard-size", minimum=1)


# ------------------------------------------------------------------------------------------------ llama2.c
def write_llama2c(model: Transformer, path, version: int) -> None:
    """A llama2.c .bin of ``model`` (the inverse of minigpt.interop.llama2c, written here independently for the test)."""
    c, sd = model.config, model.state_dict()
    stack = lambda name: torch.stack([sd[f"layers.{i}.{name}"] for i in range(c.n_layers)])  # noqa: E731
    q = torch.stack([half_to_interleaved(sd[f"layers.{i}.attention.wq.weight"], c.n_heads) for i in range(c.n_layers)])
    k = torch.stack([half_to_interleaved(sd[f"layers.{i}.attention.wk.weight"], c.n_kv_heads)
                     for i in range(c.n_layers)])
    shared = c.tie_embeddings
    dims = (c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.max_seq_len)
    mats = [stack("attention.wv.weight"), stack("attention.wo.weight")]
    ffn = [stack("feed_forward.w1.weight"), stack("feed_forward.w2.weight"), stack("feed_forward.w3.weight")]
    with open(path, "wb") as f:
        if version == 0:
            f.write(struct.pack("<7i", *dims[:5], c.vocab_size if shared else -c.vocab_size, dims[6]))
            rope = torch.zeros(c.max_seq_len * c.head_dim // 2)
            arrays = [sd["tok_embeddings.weight"], stack("attention_norm.weight"), q, k, *mats,
                      stack("ffn_norm.weight"), *ffn, sd["norm.weight"], rope, rope]
        else:
            header = struct.pack("<Ii7iB", 0x616B3432, 1, *dims, int(shared))
            f.write(header + bytes(256 - len(header)))
            arrays = [stack("attention_norm.weight"), stack("ffn_norm.weight"), sd["norm.weight"],
                      sd["tok_embeddings.weight"], q, k, *mats, *ffn]
        if not shared:
            arrays.append(sd["output.weight"])
        for a in arrays:
            f.write(a.detach().float().contiguous().numpy().tobytes())


@pytest.mark.parametrize("version,tied", [(0, True), (0, False), (1, True), (1, False)])
def test_llama2c_versions_round_trip(tmp_path, version, tied):
    model = random_model(n_kv_heads=2, tie_embeddings=tied, hidden_dim=48)
    write_llama2c(model, tmp_path / "m.bin", version)
    back = load_model(tmp_path / "m.bin")
    assert back.config.tie_embeddings == tied and back.config.n_kv_heads == 2
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_stories260k_bin_reproduces_reference_greedy(shared_data):
    folder = shared_data / "models" / "stories260K"
    ref = json.loads((folder / "reference_outputs.json").read_text())
    model = load_model(folder / "stories260K.bin")
    from_hf = load_model(folder / "hf")
    for k, v in from_hf.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    greedy = ref["greedy"]
    params = SamplingParams(max_tokens=greedy["steps_including_bos"] - 1, temperature=0)
    out = list(generate_tokens(model, greedy["prompt_ids"], params, stop_ids=[greedy["stop_on_token"]]))
    assert out == greedy["generated_ids"]
    tok = load_tokenizer(folder / "stories260K.bin")  # tok512.model beside it
    assert tok.backend == "sentencepiece" and tok.decode(out).startswith("Once upon a time")


def test_sentencepiece_model_exports_for_autotokenizer(shared_data, tmp_path):
    """A tokenizer.model is exported as is plus a rebuilt tokenizer.json, so AutoTokenizer needs no protobuf; it
    encodes real TinyStories paragraphs exactly like sentencepiece (trailing/double spaces included), with the BOS
    the llama2.c model was trained with first (as our tokenizer for it adds: tokenizer_bos.adds_bos)."""
    folder = shared_data / "models" / "stories260K"
    export_hf(folder / "stories260K.bin", tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == (folder / "tok512.model").read_bytes()
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = load_tokenizer(tmp_path / "hf")
    assert ours.backend == "sentencepiece"
    text = (shared_data / "tinystories_valid_head.txt").read_text(encoding="utf-8")
    paragraphs = [p for p in text.split("\n") if p.strip()][:300] + ["  two  spaces  ", "tab\there"]
    for p in paragraphs:
        assert theirs(p).input_ids == [ours.bos_id] + ours.encode(p), p
        assert theirs(p, add_special_tokens=False).input_ids == ours.encode(p), p
    ids = ours.encode(paragraphs[0])
    assert theirs.decode(ids) == ours.decode(ids)


def test_llama2c_tokenizer_bin_encodes_like_sentencepiece(shared_data):
    from minigpt.tokenizer.interop import build_tokenizer, read_llama2c_tokenizer
    from minigpt.tokenizer.tokenizer import Tokenizer

    folder = shared_data / "models" / "stories260K"
    sp = Tokenizer.from_file(folder / "tok512.model")
    rebuilt = Tokenizer(hf=build_tokenizer(read_llama2c_tokenizer(folder / "tok512.bin")))
    for text in ["Once upon a time, there was a little girl named Lily.", "She had 123 red balls!\nThe end.",
                 "Zebras jump over quiet foxes", "日本"]:
        assert rebuilt.encode(text) == sp.encode(text), text
        assert rebuilt.decode(sp.encode(text)) == sp.decode(sp.encode(text))


# ------------------------------------------------------------------------------------------------ errors


def test_errors_are_one_clear_line(tmp_path):
    model = random_model(n_kv_heads=2, tie_embeddings=False)
    hf_reference(model).save_pretrained(tmp_path / "good")
    cfg = json.loads((tmp_path / "good" / "config.json").read_text())

    bad_arch = tmp_path / "arch"
    bad_arch.mkdir()
    (bad_arch / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPTNeoXForCausalLM"]}))
    assert_one_line_error(run_cli("import", bad_arch, tmp_path / "o1"), "unsupported architecture 'GPTNeoXForCausalLM'")

    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "good" / "model.safetensors")
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in tensors.items() if "layers.1.mlp" not in k}, missing / "model.safetensors")
    with pytest.raises(MiniGPTError, match="missing tensors"):
        load_model(missing)

    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 64}))
    save_file(tensors, shape / "model.safetensors")
    assert_one_line_error(run_cli("export", shape, tmp_path / "o2", "--format", "hf"), "has shape", "config implies")

    truncated = tmp_path / "m.bin"
    write_llama2c(model, truncated, 0)
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    assert_one_line_error(run_cli("import", truncated, tmp_path / "o3"), "is truncated")

    assert_one_line_error(run_cli("export", tmp_path / "good", tmp_path / "o4", "--format", "hf", "--dtype", "q8_0"),
                          "not available for Hugging Face export")


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_trained_model_exports_and_generates_the_same_text_in_transformers(tiny_data, tmp_path):
    """Train a few steps, export, and compare `minigpt generate --temperature 0` with transformers' greedy
    `generate` in a fresh Python process (AutoModelForCausalLM + AutoTokenizer, offline)."""
    from minigpt.train.loop import train

    train(train_config(tiny_data, tmp_path / "run", max_steps=30, eval_interval=30))
    export = run_cli("export", tmp_path / "run", tmp_path / "hf", "--format", "hf")
    assert export.returncode == 0, export.stderr
    prompt, n = "ROMEO:", 24
    ours = run_cli("generate", tmp_path / "run", "--prompt", prompt, "--temperature", 0, "--max-new-tokens", n,
                   "--device", "cpu")
    assert ours.returncode == 0, ours.stderr
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "ids = tok(sys.argv[2], return_tensors='pt')\n"
        "out = model.generate(**ids, max_new_tokens=int(sys.argv[3]), do_sample=False)\n"
        "sys.stdout.write(tok.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True) + '\\n')\n"
    )
    theirs = subprocess.run([sys.executable, "-c", script, str(tmp_path / "hf"), prompt, str(n)],
                            capture_output=True, text=True, env=ENV, timeout=300)
    assert theirs.returncode == 0, theirs.stderr
    assert theirs.stdout == ours.stdout
    assert len(ours.stdout.strip()) > 0
