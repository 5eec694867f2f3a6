"""Architecture variants: every one trains, is causal and decodes through the KV cache exactly; the three attention
implementations agree; ALiBi slopes and the sinusoidal table match their papers; all of it is selectable from the
CLI and from YAML."""
import json
import math
import os
import subprocess
import sys
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model

from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.model.attention import Attention, causal_mask, naive_attention
from minigpt.model.config import ModelConfig
from minigpt.model.flash_reference import flash_attention
from minigpt.model.positions import Alibi, alibi_slopes, sinusoidal_table

torch.set_num_threads(1)

VARIANTS = {
    "default": {},
    "alibi": dict(pos_encoding="alibi"),
    "learned": dict(pos_encoding="learned"),
    "sinusoidal": dict(pos_encoding="sinusoidal"),
    "nope": dict(pos_encoding="none"),
    "layernorm": dict(norm="layernorm"),
    "post-norm": dict(norm_position="post"),
    "geglu": dict(ffn="geglu"),
    "gelu": dict(ffn="gelu"),
    "relu": dict(ffn="relu"),
    "naive": dict(attention_impl="naive"),
    "flash_reference": dict(attention_impl="flash_reference", attention_block_size=5),
    "alibi-naive": dict(pos_encoding="alibi", attention_impl="naive"),
    "alibi-flash": dict(pos_encoding="alibi", attention_impl="flash_reference", attention_block_size=7),
    "mha-untied": dict(n_kv_heads=4, tie_embeddings=False),
    "mqa-bias": dict(n_kv_heads=1, bias=True),
    "moe": dict(n_experts=4, n_experts_per_token=2),
    "moe-top1-shared-every2": dict(n_experts=3, n_experts_per_token=1, n_shared_experts=1, moe_every=2),
    "relu2": dict(ffn="relu2"),
    "qk-norm": dict(qk_norm=True),
    "softcap": dict(logit_softcap=2.0),  # small enough to bind on these logits
    "recipe": dict(qk_norm=True, ffn="relu2", tie_embeddings=False, logit_softcap=15.0),
    "qk-norm-alibi-flash": dict(qk_norm=True, pos_encoding="alibi", attention_impl="flash_reference",
                                attention_block_size=7),
}
VOCAB = 61


SHAPE = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48, multiple_of=16)
# Non-trivial norms and biases, so that none of them is a no-op.
make = partial(random_model, SHAPE, norm_noise=0.1)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_backward_every_parameter_gets_a_gradient(name):
    model = make(**VARIANTS[name], dropout=0.1).train()
    tokens = torch.randint(0, VOCAB, (2, 20))
    loss = model.loss(tokens[:, :-1], tokens[:, 1:]) + model.pop_aux_loss()
    loss.backward()
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(VOCAB)) < 1.0
    # (with top-1 routing the mixing weight is 1, so the router's gradient comes from the router losses alone)
    unused = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not unused, unused


@pytest.mark.parametrize("name", list(VARIANTS))
def test_causality(name):
    model = make(**VARIANTS[name])
    tokens = torch.randint(0, VOCAB, (1, 18))
    with torch.no_grad():
        base = model(tokens)
        for t in (0, 9, 17):
            changed = tokens.clone()
            changed[0, t] = (changed[0, t] + 1) % VOCAB
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], atol=1e-6, rtol=0)
            assert not torch.allclose(out[:, t], base[:, t])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cached_decoding_equals_full_forward(name):
    model = make(**VARIANTS[name])
    tokens = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache(2, 40)
        pieces = [model(tokens[:, :11], 0, cache)]  # prefill
        pieces += [model(tokens[:, i:i + 1], i, cache) for i in range(11, 19)]  # single-token steps
        pieces.append(model(tokens[:, 19:], 19, cache))  # a chunk on top of a cached prefix
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["alibi", "learned", "sinusoidal", "nope", "alibi-flash", "moe", "post-norm"])
def test_padded_batch_rows_equal_each_row_alone(name):
    """Left padding + attention_mask: positions count from each row's first real token (learned / sinusoidal look
    them up, ALiBi measures distances between them), also while decoding through the cache."""
    model = make(**VARIANTS[name])
    rows = [torch.randint(0, VOCAB, (n,)) for n in (12, 7, 3)]
    width = max(len(r) for r in rows)
    tokens = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, width - len(r):], mask[i, width - len(r):] = r, 1
    nxt = torch.randint(0, VOCAB, (3, 1))
    with torch.no_grad():
        cache = model.new_kv_cache(3, 20)
        batched = model(tokens, 0, cache, attention_mask=mask)
        step = model(nxt, width, cache, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1))
        for i, r in enumerate(rows):
            alone = model(torch.cat([r, nxt[i]])[None])
            torch.testing.assert_close(batched[i, width - len(r):], alone[0, :-1], atol=1e-5, rtol=0)
            torch.testing.assert_close(step[i, 0], alone[0, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["alibi", "learned", "sinusoidal", "gelu", "flash_reference", "moe"])
def test_generation_through_the_cache_equals_greedy_full_forward(name):
    model = make(**VARIANTS[name])
    prompt = [3, 1, 4, 1, 5]
    out = list(generate_tokens(model, prompt, SamplingParams(max_tokens=12, temperature=0)))
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[len(prompt):]


# ------------------------------------------------------------------------------------------------ attention impls

def _attention_pair(impl: str, **kw):
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=10, dim=48, n_layers=1, n_heads=6, n_kv_heads=2, max_seq_len=64, **kw)
    ref = Attention(cfg)
    other = Attention(ModelConfig(**{**cfg.to_dict(), "attention_impl": impl, "attention_block_size": 8}))
    other.load_state_dict(ref.state_dict())
    return cfg, ref, other


@pytest.mark.parametrize("impl", ["naive", "flash_reference"])
@pytest.mark.parametrize("alibi", [False, True], ids=["rope", "alibi"])
def test_attention_implementations_agree_with_sdpa(impl, alibi):
    """Full sequence (forward and gradients), a cached prefix with single-token and chunked steps, and a padding
    mask: naive and flash_reference equal sdpa in fp32 to 1e-5 (6 heads, 2 KV heads, ragged tiles of 8)."""
    cfg, ref, other = _attention_pair(impl)
    from minigpt.model.rope import rope_tables

    cos, sin = rope_tables(cfg.head_dim, 64)
    slopes = alibi_slopes(cfg.n_heads)

    def pos(n):
        return (None, None) if alibi else (cos[:n], sin[:n])

    def ali(n):
        return Alibi(slopes, torch.arange(n)[None]) if alibi else None

    x = torch.randn(2, 29, cfg.dim, requires_grad=True)
    outs, grads = [], []
    for attn in (ref, other):
        y = attn(x, *pos(29), alibi=ali(29))
        outs.append(y)
        grads.append(torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(), x)[0])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=0)

    from minigpt.model.kv_cache import KVCache

    with torch.no_grad():
        results = []
        for attn in (ref, other):
            cache = KVCache(1, 2, cfg.n_kv_heads, 64, cfg.head_dim)
            ys, start = [], 0
            for n in (17, 1, 1, 10):  # prefix, two decode steps, a chunk
                c, s = pos(start + n)
                c, s = (c[start:], s[start:]) if c is not None else (None, None)
                ys.append(attn(x[:, start:start + n], c, s, start, cache, alibi=ali(start + n)))
                start += n
            results.append(torch.cat(ys, 1))
        torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(results[0], outs[0], atol=1e-5, rtol=0)

        mask = torch.ones(2, 29, dtype=torch.long)
        mask[1, :6] = 0
        from minigpt.model.attention import padded_causal_mask
        from minigpt.model.transformer import positions_from_mask

        dense = padded_causal_mask(mask, 29)
        a = Alibi(slopes, positions_from_mask(mask, 0, 29)) if alibi else None
        p = positions_from_mask(mask, 0, 29)
        c, s = (None, None) if alibi else (cos[p][:, None], sin[p][:, None])
        torch.testing.assert_close(other(x, c, s, mask=dense, alibi=a), ref(x, c, s, mask=dense, alibi=a),
                                   atol=1e-5, rtol=0)


def test_flash_reference_equals_the_textbook_formula_for_any_block_size():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 16) for _ in range(3))
    expected = naive_attention(q, k, v, causal_mask(37, 37))
    for block in (1, 4, 16, 37, 64):
        torch.testing.assert_close(flash_attention(q, k, v, block), expected, atol=1e-5, rtol=0)
    # queries after a cached prefix: the last 5 of 37 positions
    torch.testing.assert_close(flash_attention(q[:, :, -5:], k, v, 8),
                               naive_attention(q[:, :, -5:], k, v, causal_mask(5, 37)), atol=1e-5, rtol=0)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True), expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="block_size"):
        flash_attention(q, k, v, 0)


def test_flash_reference_keeps_linear_memory_for_backward():
    """What autograd keeps grows linearly with the sequence (q, k, v, output, log-sum-exp), not quadratically."""
    def kept(n):
        q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for _ in range(3))
        sizes = {}

        def pack(t):
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            flash_attention(q, k, v, 16)
        return sum(sizes.values())

    assert kept(256) == 2 * kept(128)


# ------------------------------------------------------------------------------------------------ formulas

def test_alibi_slopes_match_the_paper():
    """Press et al. 2022: 2^(-8i/n) for n a power of two; otherwise the closest lower power of two m, then every
    other slope of 2m heads."""
    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]
    assert alibi_slopes(4).tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
    assert alibi_slopes(1).tolist() == [2.0 ** -8]
    # 6 heads: slopes(4) then slopes(8)[0::2][:2] = 2^-1, 2^-3
    assert alibi_slopes(6).tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    twelve = alibi_slopes(12).tolist()
    expected = [2.0 ** -i for i in range(1, 9)] + [2.0 ** -(j + 0.5) for j in range(4)]  # 2^-0.5, 2^-1.5, ...
    assert twelve == pytest.approx(expected, rel=1e-6)


def test_alibi_bias_is_minus_slope_times_distance():
    a = Alibi(torch.tensor([0.5, 0.25]), torch.tensor([[0, 1, 2, 3, 4]]))
    b = a.bias(q_len=2)  # queries at positions 3 and 4
    assert b.shape == (1, 2, 2, 5)
    assert b[0, 0, 1].tolist() == [-2.0, -1.5, -1.0, -0.5, 0.0]
    assert b[0, 1, 0].tolist() == [-0.75, -0.5, -0.25, 0.0, 0.25]  # the future key is masked by the caller


def test_sinusoidal_table_matches_the_formula():
    table = sinusoidal_table(50, 16)
    for pos in (0, 1, 7, 49):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_non_gated_ffn_defaults_to_4x_dim_and_gated_to_the_two_thirds_rule():
    assert ModelConfig(dim=128, ffn="gelu").hidden_dim == 512
    assert ModelConfig(dim=128, ffn="relu").hidden_dim == 512
    assert ModelConfig(dim=128, ffn="geglu").hidden_dim == ModelConfig(dim=128).hidden_dim == 384


def test_default_config_builds_the_llama_modules():
    from minigpt.model.ffn import SwiGLU
    from minigpt.model.norm import RMSNorm

    model = make()
    block = model.layers[0]
    assert type(block.attention_norm) is RMSNorm and type(block.feed_forward) is SwiGLU
    assert type(model.norm) is RMSNorm and not block.post_norm and block.attention.impl == "sdpa"
    assert not any("pos_" in k or "experts" in k or "router" in k for k in model.state_dict())


@pytest.mark.parametrize("kw, field", [
    (dict(pos_encoding="xpos"), "pos_encoding"),
    (dict(norm="batchnorm"), "norm"),
    (dict(norm_position="sandwich"), "norm_position"),
    (dict(ffn="swish"), "ffn"),
    (dict(attention_impl="flash2"), "attention_impl"),
    (dict(attention_block_size=0), "attention_block_size"),
    (dict(pos_encoding="alibi", rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    (dict(attention_impl="flash_reference", attention_dropout=0.1), "attention_dropout"),
    (dict(n_experts=2, n_experts_per_token=3), "n_experts_per_token"),
    (dict(n_experts=-1), "n_experts"),
    (dict(n_experts=2, moe_every=9), "moe_every"),
    (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef"),
])
def test_invalid_variant_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**kw)


def test_odd_head_dim_is_allowed_without_rope():
    ModelConfig(dim=30, n_heads=2, pos_encoding="alibi")  # head_dim 15
    with pytest.raises(ValueError, match="head_dim"):
        ModelConfig(dim=30, n_heads=2)


# ------------------------------------------------------------------------------------------------ CLI and YAML
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _train(tmp_path, data, *args):
    return subprocess.run([sys.executable, "-m", "minigpt", "train", "--data", str(data), "--out-dir", str(tmp_path),
                           "--max-steps", "2", "--batch-size", "2", "--set", "seq_len=16", "--set", "eval_windows=2",
                           *args], capture_output=True, text=True, env=ENV, timeout=300)


@pytest.mark.slow
def test_variants_selectable_from_cli_and_yaml(tiny_data, tmp_path):
    from conftest import TINY_MODEL

    sets = [f"model.{k}={v}" for k, v in {**TINY_MODEL, "ffn": "gelu", "pos_encoding": "alibi", "norm": "layernorm",
                                          "norm_position": "post", "attention_impl": "naive", "n_experts": 2,
                                          "n_experts_per_token": 1, "moe_every": 2}.items()]
    proc = _train(tmp_path / "cli", tiny_data, *[a for s in sets for a in ("--set", s)])
    assert proc.returncode == 0, proc.stderr
    import yaml

    resolved = yaml.safe_load((tmp_path / "cli" / "config.yaml").read_text())["model"]
    assert (resolved["ffn"], resolved["pos_encoding"], resolved["norm"], resolved["norm_position"],
            resolved["attention_impl"], resolved["n_experts"], resolved["moe_every"]) == \
        ("gelu", "alibi", "layernorm", "post", "naive", 2, 2)
    rows = [json.loads(l) for l in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert all("aux_loss" in r and len(r["expert_load"]) == 1 and len(r["expert_load"][0]) == 2
               for r in rows if "loss" in r)

    cfg = tmp_path / "variant.yaml"
    cfg.write_text(yaml.safe_dump({"model": {**TINY_MODEL, "pos_encoding": "learned", "ffn": "relu",
                                             "attention_impl": "flash_reference", "attention_block_size": 8,
                                             "tie_embeddings": False}}))
    proc = _train(tmp_path / "yaml", tiny_data, "--config", str(cfg))
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load((tmp_path / "yaml" / "config.yaml").read_text())["model"]
    assert (resolved["pos_encoding"], resolved["ffn"], resolved["attention_impl"], resolved["tie_embeddings"]) == \
        ("learned", "relu", "flash_reference", False)

    bad = _train(tmp_path / "bad", tiny_data, "--set", "model.ffn=swish")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and "ffn" in bad.stderr
