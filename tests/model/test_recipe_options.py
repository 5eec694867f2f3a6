"""The recipe options of ModelConfig (QK-norm, squared ReLU, untied head, logit soft-capping): their formulas, parity
with a reference implementation, config validation and round trip, old configs loading unchanged, exports refusing
them by name, and the inference fast path computing them or falling back to the eager model."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model

from minigpt.analysis.estimate import count_parameters
from minigpt.errors import MiniGPTError
from minigpt.infer.fastpath import FastPath, supports
from minigpt.interop import hf
from minigpt.model.config import ModelConfig
from minigpt.model.ffn import MLP, relu2
from minigpt.model.transformer import Transformer, softcap

torch.set_num_threads(1)

SHAPE = dict(vocab_size=67, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48, multiple_of=16)
OPTIONS = dict(qk_norm=True, ffn="relu2", tie_embeddings=False, logit_softcap=15.0)


def test_softcap_is_cap_times_tanh_and_bounds_the_logits():
    x = torch.tensor([-1000.0, -30.0, -1.0, 0.0, 0.5, 30.0, 1000.0])
    capped = softcap(x, 30.0)
    torch.testing.assert_close(capped, torch.tensor([30.0 * math.tanh(v / 30.0) for v in x.tolist()]))
    assert capped.abs().max() <= 30.0 and capped[3] == 0.0
    assert softcap(x, None) is x
    # the model applies it to its head's output: capped logits = cap * tanh(uncapped / cap)
    plain = random_model(SHAPE, 3, noise=0.5)
    capped_model = random_model(SHAPE, 3, noise=0.5, logit_softcap=2.0)
    tokens = torch.randint(0, 67, (2, 9))
    with torch.no_grad():
        raw, ours = plain(tokens), capped_model(tokens)
    assert raw.abs().max() > 2.0  # the cap binds
    torch.testing.assert_close(ours, 2.0 * torch.tanh(raw / 2.0))
    assert ours.abs().max() < 2.0


def test_relu2_is_the_squared_relu_mlp():
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(relu2(x), F.relu(x) ** 2)
    mlp = MLP(32, 64, "relu2")
    torch.testing.assert_close(mlp(x), mlp.w2(F.relu(mlp.w1(x)) ** 2))
    assert ModelConfig(dim=128, ffn="relu2").hidden_dim == 512  # a plain MLP: 4 x dim, two matrices
    assert not hasattr(random_model(SHAPE, ffn="relu2").layers[0].feed_forward, "w3")


def _attention_out(model, tokens):
    """Output of layer 0's attention on the embedded tokens."""
    layer = model.layers[0]
    h = layer.attention_norm(model.tok_embeddings(tokens))
    n = tokens.shape[1]
    return layer.attention(h, model.rope_cos[:n], model.rope_sin[:n])


def test_qk_norm_makes_attention_invariant_to_the_scale_of_wq_and_wk():
    tokens = torch.randint(0, 67, (2, 12))
    for qk_norm in (True, False):
        # weights large enough that mean(q^2) >> norm_eps, which is all the norm keeps of the scale
        model = random_model(SHAPE, 5, noise=0.3, norm_noise=0.1, qk_norm=qk_norm)
        with torch.no_grad():
            before = _attention_out(model, tokens)
            model.layers[0].attention.wq.weight.mul_(7.0)
            model.layers[0].attention.wk.weight.mul_(3.0)
            after = _attention_out(model, tokens)
        if qk_norm:
            torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-4)
        else:
            assert (after - before).abs().max() > 1e-2


def test_qk_norm_normalises_each_head_before_rope():
    model = random_model(SHAPE, 7, norm_noise=0.1, qk_norm=True)
    attn = model.layers[0].attention
    seen = {}
    attn.q_norm.register_forward_hook(lambda m, i, o: seen.update(q_in=i[0], q_out=o))
    tokens = torch.randint(0, 67, (1, 10))
    with torch.no_grad():
        _attention_out(model, tokens)
    q_in, q_out = seen["q_in"], seen["q_out"]
    assert q_in.shape == (1, 4, 10, 8)  # [batch, n_heads, seq_len, head_dim]: one norm per head and position
    expected = q_in / torch.sqrt(q_in.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.q_norm.weight
    torch.testing.assert_close(q_out, expected)


def test_qk_norm_logits_match_transformers_qwen3():
    """Qwen3 is Llama with q_norm / k_norm over head_dim before RoPE: our qk_norm model computes the same logits."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    model = random_model(SHAPE, 11, noise=0.02, qk_norm=True, tie_embeddings=False, hidden_dim=48)
    c = model.config
    ref_cfg = transformers.Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.hidden_dim, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=False, attention_bias=False)
    ref = transformers.Qwen3ForCausalLM(ref_cfg).eval()
    sd = {}
    for k, v in model.state_dict().items():
        if k.endswith(("q_norm.weight", "k_norm.weight")):
            layer, name = k.split(".")[1], k.split(".")[-2]
            sd[f"model.layers.{layer}.self_attn.{name}.weight"] = v
        else:
            sd[hf.to_hf_key(k)] = v
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not missing and not unexpected
    tokens = torch.randint(0, 67, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref(tokens).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kw, field", [
    (dict(qk_norm="yes"), "qk_norm"),
    (dict(logit_softcap=0.0), "logit_softcap"),
    (dict(logit_softcap=-30.0), "logit_softcap"),
    (dict(logit_softcap=float("inf")), "logit_softcap"),
    (dict(logit_softcap=True), "logit_softcap"),
    (dict(ffn="relu3"), "ffn"),
])
def test_invalid_options_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**kw)


def test_options_round_trip_and_old_configs_load_unchanged(tmp_path):
    cfg = ModelConfig(**SHAPE, **OPTIONS)
    cfg.save(tmp_path / "config.json")
    assert ModelConfig.load(tmp_path / "config.json") == cfg
    old = {k: v for k, v in ModelConfig(**SHAPE).to_dict().items() if k not in ("qk_norm", "logit_softcap")}
    loaded = ModelConfig.from_dict(old)  # a config.json written before the options existed
    assert loaded.qk_norm is False and loaded.logit_softcap is None and loaded.ffn == "swiglu"
    # the default model has exactly the parameters it always had
    assert not any("q_norm" in k or "k_norm" in k for k in Transformer(loaded).state_dict())


def test_native_checkpoint_round_trip_keeps_the_options(tmp_path):
    from minigpt.checkpoint.native import load_model, save_pretrained

    model = random_model(SHAPE, 2, norm_noise=0.1, **OPTIONS)
    save_pretrained(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert loaded.config == model.config
    tokens = torch.randint(0, 67, (1, 8))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))


def test_parameter_count_includes_the_qk_norm_gains():
    for kw in (dict(qk_norm=True), OPTIONS, dict(qk_norm=True, norm="layernorm")):
        cfg = ModelConfig(**SHAPE, **kw)
        assert count_parameters(cfg)["total"] == Transformer(cfg).num_parameters()


@pytest.mark.parametrize("field, value", [("qk_norm", True), ("logit_softcap", 30.0), ("ffn", "relu2")])
def test_exports_refuse_the_options_by_name(field, value):
    cfg = ModelConfig(**SHAPE, **{field: value})
    for target in ("LlamaForCausalLM", "llama GGUF"):
        with pytest.raises(MiniGPTError, match=f"{field}=.*cannot be represented"):
            hf.check_representable(cfg, target)
    hf.check_representable(dataclasses.replace(ModelConfig(**SHAPE), tie_embeddings=False))  # untied: fine


def test_fast_path_falls_back_for_qk_norm_and_softcap_and_computes_relu2():
    tokens = torch.randint(0, 67, (2, 11))
    for kw, reason in ((dict(qk_norm=True), "QK-norm"), (dict(logit_softcap=3.0), "logit soft-capping"),
                       (dict(ffn="relu2"), None), (OPTIONS, "QK-norm")):
        model = random_model(SHAPE, 4, noise=0.1, **kw)
        assert supports(model.config) == reason
        fast = FastPath(model)
        with torch.no_grad():
            eager = model(tokens)
            torch.testing.assert_close(fast(tokens), eager, atol=1e-5, rtol=0)
        if reason is not None:
            with pytest.raises(ValueError, match=reason):
                FastPath(model, strict=True)
