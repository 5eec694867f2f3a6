"""Model invariants: the formulas of each component, causality, cache == no cache, parameter counts."""
import math

import pytest
import torch

from minigpt.model.attention import Attention, causal_mask
from minigpt.model.config import PRESETS, ModelConfig, preset, swiglu_hidden_dim
from minigpt.model.norm import RMSNorm
from minigpt.model.rope import apply_rope, rope_tables
from minigpt.model.transformer import Transformer


def small_config(**kw):
    base = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, multiple_of=16)
    base.update(kw)
    return ModelConfig(**base)


def test_rmsnorm_equals_formula():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-6)
    norm.weight.data = torch.randn(16)
    x = torch.randn(3, 5, 16)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-6)


def test_rmsnorm_computes_in_float32_for_bf16_inputs():
    x = (torch.randn(4, 64) * 100).bfloat16()
    norm = RMSNorm(64).bfloat16()
    out = norm(x)
    assert out.dtype == torch.bfloat16
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert torch.equal(out, ref)


def test_rope_dot_product_depends_only_on_position_difference():
    torch.manual_seed(0)
    head_dim = 16
    cos, sin = rope_tables(head_dim, 64)
    q = torch.randn(head_dim)
    k = torch.randn(head_dim)

    def rotated_dot(pq, pk):
        rq = apply_rope(q.view(1, 1, 1, -1), cos[pq:pq + 1], sin[pq:pq + 1]).flatten()
        rk = apply_rope(k.view(1, 1, 1, -1), cos[pk:pk + 1], sin[pk:pk + 1]).flatten()
        return torch.dot(rq, rk)

    ref = rotated_dot(7, 3)
    for shift in (0, 5, 20, 50):
        torch.testing.assert_close(rotated_dot(7 + shift, 3 + shift), ref, atol=1e-4, rtol=1e-5)
    assert not torch.allclose(rotated_dot(9, 3), ref, atol=1e-3)  # a different offset gives another score
    # position 0 is the identity rotation
    torch.testing.assert_close(apply_rope(q.view(1, 1, 1, -1), cos[:1], sin[:1]).flatten(), q)


def _manual_attention(attn: Attention, x, cos, sin, n_rep):
    b, t, _ = x.shape
    q = attn.wq(x).view(b, t, attn.n_heads, attn.head_dim).transpose(1, 2)
    k = attn.wk(x).view(b, t, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.wv(x).view(b, t, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim)
    scores = scores.masked_fill(~causal_mask(t, t), float("-inf"))
    out = torch.softmax(scores, -1) @ v
    return attn.wo(out.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_attention_equals_textbook_mha_with_repeated_kv(n_kv_heads):
    torch.manual_seed(0)
    cfg = small_config(n_kv_heads=n_kv_heads)
    attn = Attention(cfg)
    cos, sin = rope_tables(cfg.head_dim, 10)
    x = torch.randn(2, 10, cfg.dim)
    torch.testing.assert_close(attn(x, cos, sin), _manual_attention(attn, x, cos, sin, cfg.n_rep),
                               atol=1e-5, rtol=1e-5)


def test_gqa_equals_mha_with_duplicated_kv_weights():
    torch.manual_seed(0)
    gqa_cfg = small_config(n_kv_heads=2)
    mha_cfg = small_config(n_kv_heads=4)
    gqa, mha = Attention(gqa_cfg), Attention(mha_cfg)
    hd = gqa_cfg.head_dim
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):
            w = getattr(gqa, name).weight.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
            getattr(mha, name).weight.copy_(w)
    cos, sin = rope_tables(hd, 12)
    x = torch.randn(2, 12, gqa_cfg.dim)
    torch.testing.assert_close(gqa(x, cos, sin), mha(x, cos, sin), atol=1e-5, rtol=1e-5)


def test_causality_changing_token_t_never_changes_earlier_logits():
    torch.manual_seed(0)
    model = Transformer(small_config()).eval()
    tokens = torch.randint(0, 97, (1, 20))
    with torch.no_grad():
        base = model(tokens)
        for t in (0, 7, 19):
            changed = tokens.clone()
            changed[0, t] = (changed[0, t] + 1) % 97
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], atol=0, rtol=0)
            assert not torch.allclose(out[:, t], base[:, t])


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_cached_decoding_equals_full_forward(n_kv_heads):
    torch.manual_seed(0)
    model = Transformer(small_config(n_kv_heads=n_kv_heads)).eval()
    tokens = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache(2, 32)
        pieces = [model(tokens[:, :10], 0, cache)]  # prefill
        for i in range(10, 17):  # single-token steps
            pieces.append(model(tokens[:, i:i + 1], i, cache))
        pieces.append(model(tokens[:, 17:], 17, cache))  # a multi-token chunk on top of a cached prefix
        cached = torch.cat(pieces, dim=1)
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=0)


def test_kv_cache_is_static_and_written_in_place():
    model = Transformer(small_config()).eval()
    cache = model.new_kv_cache(1, 16)
    ptr, shape = cache.k.data_ptr(), tuple(cache.k.shape)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), 0, cache)
        model(torch.tensor([[4]]), 3, cache)
    assert cache.k.data_ptr() == ptr and tuple(cache.k.shape) == shape == (2, 1, 2, 16, 16)
    assert cache.k[:, :, :, :4].abs().sum() > 0 and cache.k[:, :, :, 4:].abs().sum() == 0
    with pytest.raises(ValueError, match="overflow"):
        with torch.no_grad():
            model(torch.zeros(1, 13, dtype=torch.long), 4, cache)


def test_tied_embeddings_share_storage_and_untied_do_not():
    tied = Transformer(small_config(tie_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    untied = Transformer(small_config(tie_embeddings=False))
    assert untied.output.weight is not untied.tok_embeddings.weight
    assert untied.num_parameters() == tied.num_parameters() + 97 * 64


def test_init_scales_residual_projections():
    torch.manual_seed(0)
    cfg = small_config(dim=256, n_layers=8, n_heads=4, n_kv_heads=4)
    model = Transformer(cfg)
    std_q = model.layers[0].attention.wq.weight.std().item()
    std_o = model.layers[0].attention.wo.weight.std().item()
    std_w2 = model.layers[0].feed_forward.w2.weight.std().item()
    assert abs(std_q - 0.02) < 0.002
    assert abs(std_o - 0.02 / math.sqrt(16)) < 0.001
    assert abs(std_w2 - 0.02 / math.sqrt(16)) < 0.001


@pytest.mark.parametrize("name", ["tiny", "small", "medium"])
def test_preset_parameter_count_matches_formula(name):
    cfg = preset(name, vocab_size=4096)
    with torch.device("meta"):
        model = Transformer(cfg)
    n = sum(p.numel() for p in model.parameters())
    d, L, hd = cfg.dim, cfg.n_layers, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    ffn = 3 * d * cfg.hidden_dim
    expected = cfg.vocab_size * d + L * (attn + ffn + 2 * d) + d
    assert n == expected == model.num_parameters()


def test_preset_shapes_match_the_seed_design():
    assert (PRESETS["tiny"]["n_layers"], PRESETS["tiny"]["dim"], PRESETS["tiny"]["n_heads"],
            PRESETS["tiny"]["n_kv_heads"]) == (8, 128, 4, 1)
    s = preset("small")
    assert (s.n_layers, s.dim, s.n_heads, s.n_kv_heads) == (12, 384, 12, 3)
    m = preset("medium")
    assert (m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.hidden_dim) == (20, 640, 16, 4, 2048)
    llama = preset("llama2-7b")
    with torch.device("meta"):
        n = Transformer(llama).num_parameters()
    assert abs(n - 6.738e9) / 6.738e9 < 1e-3  # Llama 2 7B: 6,738,415,616 parameters


def test_swiglu_hidden_rule():
    assert swiglu_hidden_dim(4096, 256) == 11008  # Llama 7B
    assert swiglu_hidden_dim(128, 64) == 384
    assert swiglu_hidden_dim(4096, 256, ffn_dim_multiplier=1.3) == 14336  # Llama 3 8B


@pytest.mark.parametrize("kw, field", [
    (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
    (dict(dim=64, n_heads=5), "n_heads"),
    (dict(head_dim=7), "head_dim"),
    (dict(dim=0), "dim"),
    (dict(n_layers=-1), "n_layers"),
    (dict(dropout=1.5), "dropout"),
])
def test_invalid_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        small_config(**kw)


def test_unknown_config_field_is_rejected():
    with pytest.raises(ValueError, match="n_layer"):
        ModelConfig.from_dict({"n_layer": 3})


def test_backward_runs_and_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model = Transformer(small_config(dropout=0.1))
    tokens = torch.randint(0, 97, (2, 16))
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(97)) < 0.5
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
