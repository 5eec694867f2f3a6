"""Architectures beyond the plain Llama, against transformers on random models: Mistral with a sliding window shorter
than the test sequence, Llama with attention and MLP biases, Qwen2 (q/k/v biases; sliding in every layer or none),
from Hugging Face directories and from a qwen2 GGUF. Logits at 1e-5 in fp32 (whole sequence, cached prefill and
decode, left-padded rows), greedy text through generate_tokens, generate_batch and the fast path against
transformers' generate, exports back to hf and gguf, and one-line errors for what is not supported."""
import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, run_cli, some_slow

from minigpt.checkpoint.convert import export_gguf, export_hf
from minigpt.checkpoint.native import import_model, load_model
from minigpt.errors import MiniGPTError
from minigpt.infer.fastpath import FastPath, load_for_inference
from minigpt.infer.generate import generate_batch, generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.interop.hf import config_to_hf
from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (pip install .[dev])")
gguf = pytest.importorskip("gguf")
torch.set_num_threads(1)

VOCAB, WINDOW = 97, 8
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)  # transformers' generate must not stop early
# name -> (transformers model class, config class, config overrides, the class a Hugging Face export is read back as)
ARCHS = {
    "mistral-sliding": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=WINDOW), "MistralForCausalLM"),
    "llama-biases": ("LlamaForCausalLM", "LlamaConfig", dict(attention_bias=True, mlp_bias=True), "LlamaForCausalLM"),
    "llama-mlp-bias": ("LlamaForCausalLM", "LlamaConfig", dict(mlp_bias=True, head_dim=16),
                       "LlamaForCausalLM"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(rope_theta=1e6, tie_word_embeddings=False), "LlamaForCausalLM"),
    # exported nowhere: Mistral (the only dense architecture written with a window) has no biases
    "qwen2-sliding": ("Qwen2ForCausalLM", "Qwen2Config",
                      dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0), None),
}
EXPORTED = [name for name, arch in ARCHS.items() if arch[3] is not None]
PROMPT = [5, 17, 33, 2, 9, 41, 60, 3, 12, 77, 23, 8]  # longer than the window
STEPS = 28


def scaled_random(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights that make a decisive model: matrices N(0, 1/fan_in) (unit gain, so logits spread over several
    nats and greedy text keeps changing, where transformers' N(0, 0.02) init repeats one token), embeddings N(0, 1),
    norm gains 1 + N(0, 0.1) and biases N(0, 0.1), so no norm or bias is a no-op."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 1.0 if "embed" in name else p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (transformers model, its saved directory), built once per module."""
    out = {}
    for i, (name, (model_cls, config_cls, overrides, _)) in enumerate(ARCHS.items()):
        torch.manual_seed(i)
        cfg = getattr(transformers, config_cls)(**{**SHAPE, **overrides})
        ref = scaled_random(getattr(transformers, model_cls)(cfg), seed=i)
        directory = tmp_path_factory.mktemp(name)
        ref.save_pretrained(directory)
        out[name] = ref, directory
    return out


def hf_greedy(ref, prompt: list[int], steps: int) -> list[int]:
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0,
                       attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def with_config(model: Transformer, **changes) -> Transformer:
    """``model``'s weights in a model whose config has ``changes``."""
    other = Transformer(dataclasses.replace(model.config, **changes)).eval()
    other.load_state_dict(model.state_dict())
    return other


TOKENS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------------------ logits
@pytest.mark.parametrize("name", list(ARCHS))
def test_logits_match_transformers(hf_models, name):
    ref, directory = hf_models[name]
    ours = load_model(directory)
    with torch.no_grad():
        expected = ref(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS), expected, atol=1e-5, rtol=0)
        if name.endswith("sliding"):
            assert ours.config.sliding_window == WINDOW
            # the window changes the function past its first WINDOW positions, so this test can see it
            full = with_config(ours, sliding_window=None)(TOKENS)
            assert (full[:, :WINDOW] - expected[:, :WINDOW]).abs().max() < 1e-5
            assert (full[:, WINDOW:] - expected[:, WINDOW:]).abs().max() > 1e-2


@pytest.mark.parametrize("impl", ["sdpa", "naive", "flash_reference"])
@pytest.mark.parametrize("name", ["mistral-sliding", "llama-biases"])
def test_cached_prefill_and_decode_match_transformers(hf_models, name, impl):
    """Prefill through the KV cache, then one token at a time, then a few at once (a speculative verify): every
    step's logits equal transformers' over the whole sequence, with each attention implementation."""
    ref, directory = hf_models[name]
    ours = with_config(load_model(directory), attention_impl=impl, attention_block_size=4)
    tokens = TOKENS[:1]
    with torch.no_grad():
        expected = ref(tokens).logits
        cache = ours.new_kv_cache(1, 40)
        got = [ours(tokens[:, :20], 0, cache)]
        got += [ours(tokens[:, i:i + 1], i, cache) for i in range(20, 35)]
        got.append(ours(tokens[:, 35:], 35, cache))
    torch.testing.assert_close(torch.cat(got, dim=1), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["mistral-sliding", "qwen2-sliding", "llama-biases"])
def test_left_padded_rows_match_each_row_alone(hf_models, name):
    """A left-padded batch (attention_mask) gives every real token the logits transformers gives its row alone."""
    ref, directory = hf_models[name]
    ours = load_model(directory)
    short = TOKENS[1, :26]
    ids = torch.cat([torch.zeros(1, 14, dtype=torch.long), short[None]], dim=1)
    batch = torch.cat([TOKENS[:1], ids])
    mask = torch.ones_like(batch)
    mask[1, :14] = 0
    with torch.no_grad():
        got = ours(batch, attention_mask=mask)
        torch.testing.assert_close(got[0], ref(TOKENS[:1]).logits[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(got[1, 14:], ref(short[None]).logits[0], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ generation
# Each architecture the fast path computes compiles it (~7-10 s): one in make test, the others in the slow stage.
@pytest.mark.parametrize("name", some_slow(ARCHS, ("llama-mlp-bias", "qwen2")))
def test_greedy_matches_transformers_generate(hf_models, name):
    ref, directory = hf_models[name]
    expected = hf_greedy(ref, PROMPT, STEPS)
    assert len(set(expected)) >= 8, expected  # the random model is decisive, not stuck on one token
    greedy = SamplingParams(max_tokens=STEPS, temperature=0)
    assert list(generate_tokens(load_model(directory), PROMPT, greedy)) == expected
    # the inference fast path computes these architectures or hands them to the model's own forward
    fast = load_for_inference(directory, compile=True)
    assert isinstance(fast, FastPath)
    assert fast.reason == ("sliding-window attention" if name.endswith("sliding") else None)
    assert list(generate_tokens(fast, PROMPT, greedy)) == expected
    # in a batch with a shorter prompt (left padding): the same text for the long one, the alone text for the other
    short = PROMPT[3:]
    rows = generate_batch(FastPath(load_model(directory)), [PROMPT, short], greedy)
    assert rows[0].tokens == expected
    assert rows[1].tokens == hf_greedy(ref, short, STEPS)


# ------------------------------------------------------------------------------------------------ export back
@pytest.mark.parametrize("name", EXPORTED)
def test_hf_export_round_trips(hf_models, tmp_path, name):
    ref, directory = hf_models[name]
    import_model(directory, tmp_path / "ours")
    if name == "mistral-sliding":
        proc = run_cli("export", tmp_path / "ours", tmp_path / "hf", "--format", "hf")
        assert proc.returncode == 0, proc.stderr
    else:
        export_hf(tmp_path / "ours", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == [ARCHS[name][3]]
    assert cfg.get("sliding_window") == (WINDOW if name.endswith("sliding") else None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == ARCHS[name][3]
    with torch.no_grad():
        torch.testing.assert_close(theirs(TOKENS).logits, ref(TOKENS).logits, atol=1e-5, rtol=0)
    assert load_model(tmp_path / "hf").config == load_model(tmp_path / "ours").config


def test_gguf_export_where_llama_gguf_can_hold_it(hf_models, tmp_path):
    """Qwen2 goes to a llama GGUF (q/k/v/o biases, the o bias zero) and back unchanged; FFN biases and a sliding
    window have no place in a llama GGUF and are refused in one line naming them."""
    ref, directory = hf_models["qwen2"]
    import_model(directory, tmp_path / "qwen2")
    export_gguf(tmp_path / "qwen2", tmp_path / "qwen2.gguf")
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "qwen2.gguf")(TOKENS), ref(TOKENS).logits, atol=1e-5, rtol=0)
    for name, fragment in (("llama-biases", "FFN biases"),
                           ("mistral-sliding", f"sliding_window={WINDOW} cannot be represented in a llama GGUF")):
        import_model(hf_models[name][1], tmp_path / name)
        assert_one_line_error(run_cli("export", tmp_path / name, tmp_path / f"{name}.gguf", "--format", "gguf"),
                              fragment)


def test_sliding_qwen2_export_is_refused_in_one_line(hf_models, tmp_path):
    import_model(hf_models["qwen2-sliding"][1], tmp_path / "ours")
    assert_one_line_error(run_cli("export", tmp_path / "ours", tmp_path / "hf", "--format", "hf"),
                          "attention_bias=True cannot be represented in a MistralForCausalLM export")


def test_mixtral_with_a_window_matches_and_keeps_it(tmp_path):
    cfg = transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)
    torch.manual_seed(0)
    ref = scaled_random(transformers.MixtralForCausalLM(cfg), seed=0)
    ref.save_pretrained(tmp_path / "src")
    ours = load_model(tmp_path / "src")
    assert ours.config.sliding_window == WINDOW and ours.config.n_experts == 4
    with torch.no_grad():
        expected = ref(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS), expected, atol=1e-5, rtol=0)
    import_model(tmp_path / "src", tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["sliding_window"] == WINDOW
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(TOKENS).logits, expected, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ qwen2 GGUF
def write_qwen2_gguf(ref, path) -> None:
    """A qwen2 GGUF as llama.cpp's convert_hf_to_gguf.py writes one: ``qwen2.*`` metadata, tensor names from the
    gguf package's own name map, q/k rows unpermuted (llama.cpp's NEOX RoPE rotates halves, like transformers)."""
    c = ref.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")  # transformers' GGUF loader takes the vocabulary size from the token list
    writer.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, c.num_hidden_layers)
    for key, value in ref.state_dict().items():
        writer.add_tensor(names.get_name(key, try_suffixes=(".weight", ".bias")), value.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_qwen2_gguf_matches_transformers(hf_models, tmp_path):
    ref, _ = hf_models["qwen2"]
    write_qwen2_gguf(ref, tmp_path / "q.gguf")
    assert gguf.GGUFReader(tmp_path / "q.gguf").fields["general.architecture"].contents() == "qwen2"
    ours = load_model(tmp_path / "q.gguf")
    assert ours.config.attention_bias and not ours.config.tie_embeddings and ours.config.rope_theta == 1e6
    with torch.no_grad():
        expected = ref(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS), expected, atol=1e-5, rtol=0)
        pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="q.gguf").eval()
        assert type(theirs).__name__ == "Qwen2ForCausalLM"  # the file is a qwen2 GGUF to transformers too
        torch.testing.assert_close(theirs(TOKENS).logits, expected, atol=1e-5, rtol=0)
    assert list(generate_tokens(ours, PROMPT, SamplingParams(max_tokens=STEPS, temperature=0))) == \
        hf_greedy(ref, PROMPT, STEPS)


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("arch", ["GemmaForCausalLM", "Phi3ForCausalLM"])
def test_unsupported_architecture_is_one_line_naming_the_supported(tmp_path, arch):
    cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**SHAPE)
    getattr(transformers, arch)(cfg).save_pretrained(tmp_path / "src")
    assert_one_line_error(run_cli("import", tmp_path / "src", tmp_path / "out"), f"unsupported architecture '{arch}'",
                          "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM")


def test_qwen2_with_sliding_and_full_layers_is_refused(tmp_path):
    cfg = transformers.Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "src")
    assert_one_line_error(run_cli("import", tmp_path / "src", tmp_path / "out"),
                          "sliding-window attention in 1 of 2 layers is not supported")


def test_sliding_window_and_mlp_bias_fields():
    for bad in (0, -4, True, 2.5, "8"):
        with pytest.raises(ValueError, match="ModelConfig.sliding_window must be a positive integer"):
            ModelConfig(sliding_window=bad)
    model = Transformer(ModelConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=4, mlp_bias=True))
    biased = {k for k, v in model.named_parameters() if k.endswith("bias")}
    assert biased == {f"layers.0.feed_forward.{w}.bias" for w in ("w1", "w2", "w3")}
    with pytest.raises(MiniGPTError, match="mlp_bias=True cannot be represented in a MistralForCausalLM export"):
        config_to_hf(ModelConfig(sliding_window=WINDOW, mlp_bias=True))


@pytest.mark.parametrize("key", ["tie_word_embeddings", "attention_bias", "mlp_bias"])
def test_a_boolean_field_that_is_not_true_or_false_is_refused(tmp_path, key):
    """``"tie_word_embeddings": "no"`` was read as True (``bool("no")``): the model tied its head silently."""
    cfg = transformers.LlamaConfig(**SHAPE)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "src")
    path = tmp_path / "src" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: "no"}))
    with pytest.raises(MiniGPTError, match=f"config.json: {key} must be true or false, got 'no'"):
        load_model(tmp_path / "src")
