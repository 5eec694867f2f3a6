"""Mixture of experts: top-k routing and dispatch, the router losses against hand-computed values, no graph kept
between steps, training logs, and the MixtralForCausalLM export with logit parity against transformers."""
import json
import math
from functools import partial

import pytest
import torch
from conftest import random_model

from minigpt.errors import MiniGPTError
from minigpt.model.accounting import flops_per_token
from minigpt.model.config import ModelConfig
from minigpt.model.moe import MoE, load_balancing_loss, route, router_z_loss
from minigpt.model.transformer import Transformer

torch.set_num_threads(1)


def moe_config(**kw) -> ModelConfig:
    base = dict(vocab_size=53, dim=16, n_layers=2, n_heads=2, max_seq_len=32, n_experts=4, n_experts_per_token=2,
                moe_hidden_dim=24)
    return ModelConfig(**{**base, **kw})


def test_route_picks_the_top_k_experts_and_renormalises_their_probabilities():
    torch.manual_seed(0)
    logits = torch.randn(50, 6)
    probs, weights, experts = route(logits, 2)
    torch.testing.assert_close(probs, torch.softmax(logits, -1))
    assert experts.shape == (50, 2)
    assert all(len(set(row)) == 2 for row in experts.tolist())
    assert torch.equal(experts, torch.topk(logits, 2, dim=-1).indices)
    # Mixtral: equivalently, a softmax over the top-k logits alone
    torch.testing.assert_close(weights, torch.softmax(torch.gather(logits, 1, experts), -1))


def test_each_token_reaches_exactly_its_top_k_experts():
    """Replace every expert by a recorder that scales its input by (e + 1): each token is seen by exactly k experts,
    the ones the router chose, and the output is the routing-weighted sum of their outputs."""
    torch.manual_seed(0)
    moe = MoE(moe_config(n_experts=5, n_experts_per_token=3))
    seen = {e: [] for e in range(5)}

    class Recorder(torch.nn.Module):
        def __init__(self, e):
            super().__init__()
            self.e = e

        def forward(self, x):
            seen[self.e].append(x.detach().clone())
            return x * (self.e + 1)

    moe.experts = torch.nn.ModuleList(Recorder(e) for e in range(5))
    x = torch.randn(3, 7, 16)
    out = moe(x)
    flat = x.reshape(-1, 16)
    _, weights, experts = route(moe.router(flat), 3)
    for t in range(flat.shape[0]):
        received = [e for e in range(5) for row in (torch.cat(seen[e]) if seen[e] else torch.empty(0, 16))
                    if torch.equal(row, flat[t])]
        assert sorted(received) == sorted(experts[t].tolist())
    expected = sum(weights[:, j, None] * flat * (experts[:, j, None] + 1) for j in range(3))
    torch.testing.assert_close(out.reshape(-1, 16), expected)
    assert sum(len(torch.cat(v)) for v in seen.values() if v) == flat.shape[0] * 3
    assert moe.stats["load"].sum().item() == pytest.approx(1.0)


def test_load_balancing_loss_on_a_hand_computed_example():
    """4 tokens, 2 experts, top-1. Probabilities [.8 .2], [.6 .4], [.3 .7], [.9 .1] send tokens to experts 0, 0, 1, 0:
    f = (3/4, 1/4), P = (.65, .35); N * sum f_i P_i = 2 * (.75 * .65 + .25 * .35) = 1.15."""
    probs = torch.tensor([[0.8, 0.2], [0.6, 0.4], [0.3, 0.7], [0.9, 0.1]])
    p, _, experts = route(probs.log(), 1)
    assert experts.flatten().tolist() == [0, 0, 1, 0]
    assert load_balancing_loss(p, experts).item() == pytest.approx(1.15, abs=1e-6)


def test_load_balancing_loss_top2_hand_computed_and_uniform_routing_gives_one():
    """3 experts, top-2, 2 tokens: [.5 .3 .2] -> {0, 1}; [.1 .3 .6] -> {2, 1}. f = (1, 2, 1) / 4,
    P = (.3, .3, .4): 3 * (.25 * .3 + .5 * .3 + .25 * .4) = 0.975."""
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.3, 0.6]])
    p, _, experts = route(probs.log(), 2)
    assert load_balancing_loss(p, experts).item() == pytest.approx(0.975, abs=1e-6)
    uniform = torch.full((8, 4), 0.25)
    assert load_balancing_loss(uniform, torch.arange(8).remainder(4)[:, None]).item() == pytest.approx(1.0)


def test_router_z_loss_hand_computed():
    """logsumexp([0, 0]) = ln 2 and logsumexp([ln 3, 0]) = ln 4: mean of squares = (ln^2 2 + ln^2 4) / 2."""
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    assert router_z_loss(logits).item() == pytest.approx((math.log(2) ** 2 + math.log(4) ** 2) / 2, abs=1e-6)


def test_stored_aux_loss_is_the_weighted_sum_and_pop_releases_the_graph():
    torch.manual_seed(0)
    model = Transformer(moe_config(router_aux_loss_coef=0.5, router_z_loss_coef=0.25, moe_every=2))
    tokens = torch.randint(0, 53, (2, 12))
    model(tokens)
    (moe,) = model.moe_layers()
    assert moe.aux_loss.requires_grad
    expected = 0.5 * moe.stats["aux_loss"] + 0.25 * moe.stats["z_loss"]
    total = model.pop_aux_loss()
    torch.testing.assert_close(total.detach(), expected)
    assert moe.aux_loss is None and model.pop_aux_loss() == 0.0  # consumed: nothing holds the graph any more
    assert all(not t.requires_grad for t in moe.stats.values())
    total.backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    assert Transformer(moe_config(n_experts=0)).pop_aux_loss() == 0.0  # dense: adds nothing


def test_flops_count_active_experts_only():
    cfg = moe_config()
    n_total = sum(p.numel() for p in Transformer(cfg).parameters())
    per_expert = 3 * cfg.dim * cfg.moe_hidden_dim
    n_active = n_total - cfg.n_layers * (cfg.n_experts - cfg.n_experts_per_token) * per_expert
    assert flops_per_token(cfg, n_total, 32) == 6 * n_active + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 32


def test_training_adds_router_losses_and_logs_expert_load(tiny_data, tmp_path):
    from conftest import TINY_MODEL

    from minigpt.train.loop import TrainConfig, train

    model = {**TINY_MODEL, "n_experts": 3, "n_experts_per_token": 2}
    result = train(TrainConfig(data=str(tiny_data), out_dir=str(tmp_path), model=model, seq_len=16, batch_size=4,
                               max_steps=4, log_interval=2, eval_interval=4, eval_windows=4, device="cpu", seed=0))
    assert math.isfinite(result["val_loss"])
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert logged and all(r["aux_loss"] > 0 and r["z_loss"] > 0 for r in logged)
    for r in logged:
        assert len(r["expert_load"]) == 2  # one list per MoE layer
        assert all(len(layer) == 3 and sum(layer) == pytest.approx(1.0, abs=1e-3) for layer in r["expert_load"])


# ------------------------------------------------------------------------------------------------ Mixtral export
transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")


MOE_SHAPE = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, n_experts=4, n_experts_per_token=2, moe_hidden_dim=40)
random_moe = partial(random_model, MOE_SHAPE, noise=0.05, norm_noise=0.1)


@pytest.mark.parametrize("kw", [dict(tie_embeddings=False), dict(tie_embeddings=True, n_experts_per_token=1),
                                dict(n_experts=3, n_kv_heads=4, rope_theta=1e6)],
                         ids=["untied-top2", "tied-top1", "3experts-mha"])
def test_mixtral_export_matches_transformers_and_imports_back(tmp_path, kw):
    from minigpt.checkpoint.convert import export_hf
    from minigpt.checkpoint.native import load_model, save_pretrained

    model = random_moe(**kw)
    save_pretrained(model, tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == model.config.n_experts
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(ref).__name__ == "MixtralForCausalLM"
    tokens = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref(tokens).logits, atol=1e-5, rtol=0)
        prompt = tokens[:1, :8]
        theirs = ref.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0,
                              attention_mask=torch.ones_like(prompt))[0, 8:].tolist()
    from minigpt.infer.generate import generate_tokens
    from minigpt.infer.sampling import SamplingParams

    assert list(generate_tokens(model, prompt[0].tolist(), SamplingParams(max_tokens=16, temperature=0))) == theirs
    back = load_model(tmp_path / "hf")
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert (back.config.n_experts, back.config.n_experts_per_token, back.config.moe_hidden_dim) == \
        (model.config.n_experts, model.config.n_experts_per_token, model.config.moe_hidden_dim)


def test_transformers_fused_expert_layout_imports(tmp_path):
    """transformers 5 keeps experts fused in memory (gate_up_proj / down_proj); a state dict in that layout loads."""
    from minigpt.interop import hf

    model = random_moe(seed=3, tie_embeddings=False)
    ref = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{
        k: v for k, v in hf.config_to_hf(model.config).items() if k not in ("architectures", "model_type")}))
    fused = {}
    sd = ref.state_dict()
    ours = {k: v for k, v in model.state_dict().items()}
    for i in range(model.config.n_layers):
        experts = [f"layers.{i}.feed_forward.experts.{e}" for e in range(model.config.n_experts)]
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([ours[f"{p}.w1.weight"], ours[f"{p}.w3.weight"]]) for p in experts])
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([ours[f"{p}.w2.weight"] for p in experts])
        fused[f"model.layers.{i}.mlp.gate.weight"] = ours[f"layers.{i}.feed_forward.router.weight"]
    others = {hf.to_hf_key(k): v for k, v in ours.items() if "feed_forward" not in k}
    assert set(fused) | set(others) == set(sd)
    ref.load_state_dict({**fused, **others})
    loaded = hf.state_dict_from_hf({**fused, **others}, model.config, "MixtralForCausalLM")
    for name, tensor in ours.items():
        assert torch.equal(loaded[name], tensor), name
    tokens = torch.randint(0, 97, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref.eval()(tokens).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kw, field", [(dict(n_shared_experts=1), "n_shared_experts"), (dict(moe_every=2), "moe_every"),
                                       (dict(ffn="gelu"), "ffn"), (dict(bias=True), "bias")])
def test_unrepresentable_moe_layouts_are_refused_by_name(tmp_path, kw, field):
    from minigpt.checkpoint.convert import export_gguf, export_hf
    from minigpt.checkpoint.native import save_pretrained

    model = random_moe(**kw)
    save_pretrained(model, tmp_path / "ours")
    with pytest.raises(MiniGPTError, match=field):
        export_hf(tmp_path / "ours", tmp_path / "hf")
    with pytest.raises(MiniGPTError, match="n_experts"):
        export_gguf(tmp_path / "ours", tmp_path / "m.gguf")
