"""`minigpt estimate`: exact parameter counts for every preset and variant, the Llama 2 7B figures, KV-cache bytes,
FLOPs, and an activation estimate checked against what autograd really keeps."""
import json
import os
import subprocess
import sys

import pytest
import torch

from minigpt.analysis.estimate import (
    DTYPE_BYTES,
    EstimateRequest,
    activation_bytes,
    count_parameters,
    estimate,
    flops,
    format_report,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
    training_memory,
)
from minigpt.model.config import PRESETS, ModelConfig, preset
from minigpt.model.transformer import Transformer, lm_loss

torch.set_num_threads(1)

VARIANTS = [
    {}, dict(pos_encoding="learned"), dict(pos_encoding="alibi"), dict(pos_encoding="sinusoidal"),
    dict(norm="layernorm"), dict(norm_position="post"), dict(ffn="gelu"), dict(ffn="relu"), dict(ffn="geglu"),
    dict(tie_embeddings=False), dict(bias=True), dict(attention_bias=True), dict(n_kv_heads=4), dict(head_dim=24),
    dict(n_experts=4, n_experts_per_token=2), dict(n_experts=3, n_experts_per_token=1, moe_every=2,
                                                   n_shared_experts=2, moe_hidden_dim=20, ffn="gelu", bias=True),
]


def built(cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg)


@pytest.mark.parametrize("name", list(PRESETS))
def test_counts_equal_the_model_for_every_preset(name):
    cfg = preset(name)
    model = built(cfg)
    n = count_parameters(cfg)
    assert n["total"] == sum(p.numel() for p in model.parameters()) == n["active"]
    assert n["non_embedding"] == model.num_parameters(exclude_embeddings=True)


@pytest.mark.parametrize("kw", VARIANTS, ids=[",".join(f"{k}={v}" for k, v in kw.items()) or "default"
                                              for kw in VARIANTS])
def test_counts_equal_the_model_for_every_variant(kw):
    cfg = ModelConfig(**{**dict(vocab_size=101, dim=48, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=40), **kw})
    model = built(cfg)
    n = count_parameters(cfg)
    assert n["total"] == sum(p.numel() for p in model.parameters())
    assert n["non_embedding"] == model.num_parameters(exclude_embeddings=True)
    # active: every parameter except the experts a token is not routed to, counted from the module tree
    idle = 0
    for moe in model.moe_layers():
        per_expert = sum(p.numel() for p in moe.experts[0].parameters())
        idle += (cfg.n_experts - cfg.n_experts_per_token) * per_expert
    assert n["active"] == n["total"] - idle
    assert n["total"] == n["embedding"] + n["attention"] + n["ffn"] + n["norms"] + n["lm_head"]


def test_tinyllama_shape_has_its_1_1b_parameters():
    """TinyLlama-1.1B: 22 layers of dim 2048, 32 query and 4 KV heads, FFN 5632, untied 32,000-row embedding and
    head: 1,100,048,384 parameters (its model card's 1.1B)."""
    n = count_parameters(preset("tinyllama-1.1b"))
    assert n["total"] == 1_100_048_384
    assert n["embedding"] == n["lm_head"] == 32000 * 2048


def test_smollm_135m_shape_has_its_135m_parameters():
    """SmolLM-135M (HuggingFaceTB/SmolLM-135M): 30 layers of dim 576, 9 query and 3 KV heads, FFN 1536, a tied
    49,152-row embedding: 134.5M parameters, 28.3M of them the embedding."""
    n = count_parameters(preset("smollm-135m"))
    assert round(n["total"] / 1e6, 1) == 134.5
    assert n["embedding"] == 49152 * 576


def test_llama2_7b():
    """Touvron et al. 2023: 6.74 B parameters; fp16 KV cache of 2048 tokens = 2 * 32 layers * 4096 * 2048 * 2 bytes
    = 1 GiB exactly; GQA with 8 of 32 KV heads cuts it by 75 %."""
    cfg = preset("llama2-7b")
    assert count_parameters(cfg)["total"] == 6_738_415_616
    assert round(count_parameters(cfg)["total"] / 1e9, 2) == 6.74
    fp16 = DTYPE_BYTES["float16"]
    assert kv_cache_bytes(cfg, batch=1, context=2048, bytes_per_element=fp16) == 2 * 32 * 4096 * 2048 * 2 == 2**30
    gqa = preset("llama2-7b", n_kv_heads=8)
    assert kv_cache_bytes(gqa, 1, 2048, fp16) == 2**30 // 4  # a 75 % cut
    assert kv_cache_bytes_per_token(cfg, DTYPE_BYTES["int8"]) * 2 == kv_cache_bytes_per_token(cfg, fp16)


def test_kv_estimate_equals_the_cache_the_model_allocates():
    cfg = ModelConfig(vocab_size=50, dim=48, n_layers=3, n_heads=6, n_kv_heads=2, max_seq_len=32)
    model = Transformer(cfg)
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        cache = model.new_kv_cache(3, 32, dtype=dtype)
        assert cache.nbytes == kv_cache_bytes(cfg, 3, 32, DTYPE_BYTES[name])


def test_flops_training_is_three_times_inference_and_moe_counts_active_parameters():
    dense = preset("small")
    f = flops(dense, 512)
    assert f["training_per_token"] == pytest.approx(3 * f["inference_per_token"])
    n = count_parameters(dense)["total"]
    assert f["training_per_token"] == 6 * n + 12 * dense.n_layers * dense.n_heads * dense.head_dim * 512
    moe = preset("small", n_experts=8, n_experts_per_token=2)
    n_moe = count_parameters(moe)
    assert n_moe["active"] < n_moe["total"]
    assert flops(moe, 512)["training_per_token"] == 6 * n_moe["active"] + 12 * 12 * 12 * 32 * 512


@pytest.mark.parametrize("kw", [{}, dict(attention_impl="naive"), dict(attention_impl="flash_reference"),
                                dict(ffn="gelu"), dict(pos_encoding="alibi"), dict(n_experts=4, moe_hidden_dim=96)],
                         ids=["default", "naive", "flash", "gelu", "alibi", "moe"])
def test_activation_estimate_matches_what_autograd_keeps(kw):
    """The estimate is within 10 % of the bytes saved for backward, measured with saved-tensor hooks."""
    cfg = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=1, max_seq_len=128, **kw)
    torch.manual_seed(0)
    model = Transformer(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, 512, (4, 128))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model(tokens), tokens) + model.pop_aux_loss()
    measured = sum(b for p, b in saved.items() if p not in params)
    assert activation_bytes(cfg, 4, 128) == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("n_layers, moe_every, n_experts", [(7, 3, 4), (6, 1, 4), (5, 5, 4), (5, 2, 0), (1, 1, 2)])
def test_layer_sums_stand_one_block_of_each_kind_for_all(n_layers, moe_every, n_experts):
    """The estimate adds one dense and one MoE block per kind (so `estimate --set n_layers=100000000` answers
    at once, where it took minutes): equal to summing every layer, with and without checkpointing."""
    from minigpt.analysis.estimate import layer_activations

    cfg = ModelConfig(vocab_size=101, dim=48, n_layers=n_layers, n_heads=4, n_kv_heads=2, max_seq_len=40,
                      n_experts=n_experts, moe_every=moe_every, n_experts_per_token=min(2, n_experts or 2))
    assert cfg.n_moe_layers == sum(cfg.is_moe_layer(i) for i in range(n_layers))
    each = [layer_activations(cfg, i, 32, 4) for i in range(n_layers)]
    top = 3 * cfg.dim * 4 + 4.0 * cfg.vocab_size
    assert activation_bytes(cfg, 2, 32) == pytest.approx(2 * 32 * (sum(each) + top), rel=1e-12)
    kept = n_layers * cfg.dim * 4 + max(each)
    assert activation_bytes(cfg, 2, 32, checkpointing=True) == pytest.approx(2 * 32 * (kept + top), rel=1e-12)
    assert count_parameters(cfg)["total"] == sum(p.numel() for p in built(cfg).parameters())


def test_training_memory_accounting():
    cfg = preset("tiny")
    n = count_parameters(cfg)["total"]
    plain = training_memory(cfg, 16, 256)
    assert plain["weights"] + plain["gradients"] + plain["adam"] == 16 * n and plain["autocast_copies"] == 0
    ckpt = training_memory(cfg, 16, 256, checkpointing=True)
    assert ckpt["activations"] < plain["activations"] / 3
    assert training_memory(cfg, 16, 256, "bfloat16")["autocast_copies"] == 2 * n
    assert training_memory(cfg, 32, 256)["activations"] == pytest.approx(2 * plain["activations"])
    with pytest.raises(ValueError, match="dtype"):
        training_memory(cfg, 1, 8, "int8")


def test_report_names_its_accounting():
    text = format_report(estimate(preset("llama2-7b"), EstimateRequest(context=2048)))
    for fragment in ("6,738,415,616", "Kaplan", "PaLM", "Korthikanti", "1.00 GiB", "int8 without scales"):
        assert fragment in text, fragment


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "minigpt", "estimate", *map(str, args)], capture_output=True,
                          text=True, env=ENV, timeout=120)


@pytest.mark.slow
def test_cli_preset_config_file_and_flags(tmp_path):
    proc = run_cli("--preset", "llama2-7b", "--context", "2048", "--set", "n_kv_heads=8", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["kv_cache"]["total"]["bfloat16"] == 2**30 // 4
    recipe = tmp_path / "run.yaml"
    recipe.write_text("preset: tiny\nvocab_size: 2048\nmodel:\n  ffn: gelu\n  n_experts: 4\n")
    out = json.loads(run_cli("--config", recipe, "--set", "model.n_experts_per_token=1", "--json").stdout)
    cfg = preset("tiny", vocab_size=2048, ffn="gelu", n_experts=4, n_experts_per_token=1)
    assert out["parameters"] == count_parameters(cfg)
    bad = run_cli("--set", "ffn=swish")
    assert bad.returncode == 1 and "ffn" in bad.stderr and "Traceback" not in bad.stderr
