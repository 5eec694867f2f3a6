"""Parity with implementations we did not write: transformers' LlamaForCausalLM and Karpathy's trained stories260K."""
import json

import pytest
import torch

from minigpt.checkpoint.native import load_model, save_pretrained
from minigpt.errors import MiniGPTError
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.interop import hf
from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (pip install .[dev])")


def to_hf_model(model: Transformer):
    cfg = transformers.LlamaConfig(**{k: v for k, v in hf.config_to_hf(model.config).items()
                                      if k not in ("architectures", "model_type")})
    ref = transformers.LlamaForCausalLM(cfg).eval()
    sd = {hf.to_hf_key(k): v for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight")
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return ref


@pytest.mark.parametrize("kw", [
    dict(n_heads=4, n_kv_heads=4, tie_embeddings=True),   # MHA, tied
    dict(n_heads=4, n_kv_heads=2, tie_embeddings=False),  # GQA, untied
    dict(n_heads=4, n_kv_heads=1, rope_theta=500000.0, norm_eps=1e-6),  # MQA
], ids=["mha-tied", "gqa-untied", "mqa-theta500k"])
def test_logits_match_transformers_llama(kw):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=101, dim=64, n_layers=3, hidden_dim=96, max_seq_len=64, **kw)
    model = Transformer(cfg).eval()
    for p in model.parameters():  # make norms non-trivial too
        p.data.add_(torch.randn_like(p) * 0.01)
    ref = to_hf_model(model)
    tokens = torch.randint(0, 101, (2, 40))
    with torch.no_grad():
        ours = model(tokens)
        theirs = ref(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_hf_directory_round_trip(tmp_path):
    """Our model written as an HF directory by transformers itself loads back through our HF loader, identically."""
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=32)
    model = Transformer(cfg).eval()
    to_hf_model(model).save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf")
    assert loaded.config == cfg
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_save_pretrained_round_trip(tmp_path):
    torch.manual_seed(2)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=1, max_seq_len=32, multiple_of=16)
    model = Transformer(cfg).eval()
    save_pretrained(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert loaded.config == cfg and loaded.output.weight is loaded.tok_embeddings.weight
    tokens = torch.randint(0, 64, (1, 10))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(MiniGPTError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(tmp_path)


def test_stories260k_greedy_matches_reference(shared_data):
    """Karpathy's trained stories260K, loaded from its HF directory, reproduces the reference greedy ids exactly."""
    model_dir = shared_data / "models" / "stories260K" / "hf"
    ref = json.loads((shared_data / "models" / "stories260K" / "reference_outputs.json").read_text())
    model = load_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([[1]]))[0, -1]
    top5 = torch.topk(logits, 5)
    assert top5.indices.tolist() == [i for i, _ in ref["bos_logits_top5"]]
    torch.testing.assert_close(top5.values, torch.tensor([v for _, v in ref["bos_logits_top5"]]), atol=1e-4, rtol=0)
    greedy = ref["greedy"]
    params = SamplingParams(max_tokens=greedy["steps_including_bos"] - 1, temperature=0)
    out = list(generate_tokens(model, greedy["prompt_ids"], params, stop_ids=[greedy["stop_on_token"]]))
    assert out == greedy["generated_ids"]
