"""LoRA layers (Hu et al. 2021) and PEFT-format adapters: parity with ``peft`` in both directions, merging, errors."""
import json
from functools import partial

import pytest
import torch
from conftest import assert_one_line_error, random_model, run_cli
from torch import nn

from minigpt.checkpoint.adapter import CONFIG_NAME, WEIGHTS_NAME, load_adapter, save_adapter
from minigpt.checkpoint.convert import export_hf
from minigpt.checkpoint.native import save_pretrained
from minigpt.errors import MiniGPTError
from minigpt.model.lora import HF_TARGETS, LoRALinear, apply_lora, lora_layers, merge_lora, trainable_parameters
from minigpt.model.quant import Int8Linear, quantize_model

ALL = list(HF_TARGETS)


SHAPE = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=32)
tiny_model = partial(random_model, SHAPE)


def randomize_b(model, seed=1, std=0.05):
    """B starts at zero (the adapted model equals the base); a parity test needs a non-zero update."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * std)


def tokens(n=2, t=12, vocab=97, seed=3):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def test_lora_linear_formula_and_init():
    torch.manual_seed(0)
    base = nn.Linear(8, 6, bias=True)
    layer = LoRALinear(base, lora_rank=4, lora_alpha=16, lora_dropout=0.0)
    assert torch.count_nonzero(layer.lora_B.weight) == 0 and torch.count_nonzero(layer.lora_A.weight) > 0
    bound = 1 / 8 ** 0.5  # kaiming_uniform(a=sqrt(5)) on fan_in 8: U(-1/sqrt(8), 1/sqrt(8)), nn.Linear's default
    assert layer.lora_A.weight.abs().max() <= bound
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(3, 5, 8)
    expected = base(x) + x @ layer.lora_A.weight.T @ layer.lora_B.weight.T * (16 / 4)
    torch.testing.assert_close(layer(x), expected)
    assert not base.weight.requires_grad and layer.lora_A.weight.requires_grad
    rs = LoRALinear(nn.Linear(8, 6), lora_rank=4, lora_alpha=16, use_rslora=True)
    assert rs.scaling == 16 / 2


def test_apply_lora_freezes_base_and_trains_only_adapters():
    model = tiny_model()
    names = apply_lora(model, lora_rank=4, lora_alpha=8, targets=["q_proj", "v_proj", "down_proj"])
    assert names == ["layers.0.attention.wq", "layers.0.attention.wv", "layers.0.feed_forward.w2",
                     "layers.1.attention.wq", "layers.1.attention.wv", "layers.1.feed_forward.w2"]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable_parameters(model)) == 12
    before = model(tokens())  # B = 0: the adapted model equals the base
    loss = model(tokens()).sum()
    loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    torch.testing.assert_close(before, tiny_model()(tokens()))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(lora_rank=0, lora_alpha=8), "lora_rank"),
    (dict(lora_rank=-2, lora_alpha=8), "lora_rank"),
    (dict(lora_rank=4, lora_alpha=8, targets=["q_proj", "c_attn"]), "c_attn"),
    (dict(lora_rank=4, lora_alpha=8, targets=[]), "no LoRA target"),
    (dict(lora_rank=4, lora_alpha=8, lora_dropout=1.5), "lora_dropout"),
])
def test_apply_lora_errors_are_one_line(kwargs, fragment):
    with pytest.raises(MiniGPTError) as e:
        apply_lora(tiny_model(), **kwargs)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_merge_equals_unmerged():
    model = tiny_model()
    apply_lora(model, 4, 8, targets="all-linear")
    randomize_b(model)
    x = tokens()
    with torch.no_grad():
        unmerged = model(x)
        merge_lora(model)
        merged = model(x)
    assert not lora_layers(model) and all(isinstance(m, nn.Linear) for m in (model.layers[0].attention.wq,))
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)


def test_lora_on_int8_base():
    """An int8 base stays int8 and frozen (its weights are buffers); the adapters train; merging requantizes."""
    model = quantize_model(tiny_model())
    apply_lora(model, 4, 8, targets=["q_proj", "o_proj", "up_proj"])
    assert isinstance(model.layers[0].attention.wq.base_layer, Int8Linear)
    assert {n.split(".")[-2] for n, p in model.named_parameters() if p.requires_grad} == {"lora_A", "lora_B"}
    randomize_b(model)
    x = tokens()
    model(x).sum().backward()
    assert model.layers[0].attention.wq.lora_B.weight.grad is not None
    with torch.no_grad():
        layer = model.layers[0].attention.wq
        h = torch.randn(5, 32)
        unmerged = layer(h)
        merged = layer.merged()
        assert isinstance(merged, Int8Linear)
        step = merged.weight_scale.max()  # requantization moves each weight by at most half a step
        assert (merged(h) - unmerged).abs().max() <= 0.5 * step * h.abs().sum(-1).max() + 1e-5


# ----------------------------------------------------------------------------------------- PEFT interop
peft = pytest.importorskip("peft", reason="peft is a test-only dependency (pip install .[dev])")
transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")


def exported(model, tmp_path):
    save_pretrained(model, tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "hf")
    return transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()


@pytest.mark.parametrize("kw", [dict(tie_embeddings=True), dict(tie_embeddings=False, n_kv_heads=1)],
                         ids=["tied", "untied-mqa"])
def test_our_adapter_loads_in_peft_with_equal_logits(tmp_path, kw):
    model = tiny_model(**kw)
    hf_base = exported(model, tmp_path)
    apply_lora(model, lora_rank=4, lora_alpha=16, lora_dropout=0.1, targets=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                              "gate_proj", "down_proj"])
    randomize_b(model)
    model.eval()
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "hf"))
    config = json.loads((tmp_path / "adapter" / CONFIG_NAME).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["r"] == 4
    assert config["lora_alpha"] == 16 and config["lora_dropout"] == 0.1 and config["bias"] == "none"
    assert config["fan_in_fan_out"] is False
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "v_proj"]
    from safetensors.torch import load_file
    keys = set(load_file(str(tmp_path / "adapter" / WEIGHTS_NAME)))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys and len(keys) == 24
    x = tokens()
    with torch.no_grad():
        base_logits = hf_base(x).logits
    theirs = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    with torch.no_grad():
        ours_logits, theirs_logits = model(x), theirs(x).logits
    torch.testing.assert_close(ours_logits, theirs_logits, atol=1e-5, rtol=0)
    assert (ours_logits - base_logits).abs().max() > 1e-3  # the adapter changes the function: parity is not trivial


def test_peft_adapter_loads_in_minigpt_with_equal_logits(tmp_path):
    model = tiny_model(tie_embeddings=False)
    hf_base = exported(model, tmp_path)
    lora_config = peft.LoraConfig(r=6, lora_alpha=12, target_modules=["q_proj", "v_proj", "up_proj"],
                                  rank_pattern={"v_proj": 2}, alpha_pattern={"up_proj": 3}, use_rslora=True,
                                  task_type="CAUSAL_LM")
    theirs = peft.get_peft_model(hf_base, lora_config)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    theirs.save_pretrained(tmp_path / "peft_adapter")
    names = load_adapter(model, tmp_path / "peft_adapter")
    assert len(names) == 6 and model.layers[1].attention.wv.lora_rank == 2
    assert model.layers[0].feed_forward.w3.lora_alpha == 3
    x = tokens()
    theirs.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), theirs(x).logits, atol=1e-5, rtol=0)
        unmerged = model(x)
        merge_lora(model)
        torch.testing.assert_close(model(x), unmerged, atol=1e-5, rtol=0)


def test_adapter_round_trip_and_modules_to_save(tmp_path):
    model = tiny_model()
    apply_lora(model, 3, 6, targets=["k_proj"], layers=[1])
    randomize_b(model)
    model.tok_embeddings.weight.requires_grad_(True)
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(1.5)
    save_adapter(model, tmp_path / "a", modules_to_save=["embed_tokens"])
    config = json.loads((tmp_path / "a" / CONFIG_NAME).read_text())
    assert config["target_modules"] == r"^(model\.layers\.1\.self_attn\.k_proj)$"
    assert config["modules_to_save"] == ["embed_tokens"]
    fresh = tiny_model()
    load_adapter(fresh, tmp_path / "a")
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), model(x), atol=0, rtol=0)
    assert fresh.tok_embeddings.weight.requires_grad


def test_adapter_shape_mismatch_is_one_line_error(tmp_path):
    model = tiny_model()
    apply_lora(model, 4, 8)
    save_adapter(model, tmp_path / "a")
    other = tiny_model(dim=48, hidden_dim=64)
    with pytest.raises(MiniGPTError) as e:
        load_adapter(other, tmp_path / "a")
    assert "q_proj.lora_A has shape (4, 32)" in str(e.value) and "(4, 48)" in str(e.value)
    assert "\n" not in str(e.value)


def test_adapter_refuses_unsupported_peft_features(tmp_path):
    model = tiny_model()
    apply_lora(model, 4, 8)
    save_adapter(model, tmp_path / "a")
    path = tmp_path / "a" / CONFIG_NAME
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(MiniGPTError, match="use_dora"):
        load_adapter(tiny_model(), tmp_path / "a")
    with pytest.raises(MiniGPTError, match="adapter_config.json is missing"):
        load_adapter(tiny_model(), tmp_path)


@pytest.mark.parametrize("edit,fragment", [
    (lambda c: [], "must hold a JSON object"),
    (lambda c: {**c, "lora_alpha": None}, "lora_alpha must be a positive number, got None"),
    (lambda c: {**c, "lora_alpha": "16"}, "lora_alpha must be a positive number"),
    (lambda c: {**c, "r": 0}, "r must be a positive number, got 0"),
    (lambda c: {**c, "alpha_pattern": ["q_proj"]}, "alpha_pattern must be an object"),
    (lambda c: {**c, "alpha_pattern": {"q_proj": None}}, "alpha_pattern['q_proj'] must be a positive number"),
])
def test_adapter_config_of_wrong_types_is_one_line_error(tmp_path, edit, fragment):
    """Found by probing: ``"lora_alpha": null`` was a TypeError from the rank check, a JSON list an AttributeError."""
    model = tiny_model()
    apply_lora(model, 4, 8)
    save_adapter(model, tmp_path / "a")
    path = tmp_path / "a" / CONFIG_NAME
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(MiniGPTError) as e:
        load_adapter(tiny_model(), tmp_path / "a")
    assert fragment in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_adapters_follow_the_model_train_eval_mode(tmp_path):
    """Adapters added to a model in eval mode do not drop out (a PEFT adapter loaded for inference is deterministic)."""
    model = tiny_model()
    apply_lora(model, 4, 8, lora_dropout=0.5)
    randomize_b(model)
    assert not any(m.training for m in lora_layers(model).values())
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x), atol=0, rtol=0)
    save_adapter(model, tmp_path / "a")
    fresh = tiny_model()
    load_adapter(fresh, tmp_path / "a")
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), model(x), atol=0, rtol=0)
    fresh.train()
    assert all(m.training for m in lora_layers(fresh).values())


def test_lora_merge_cli_equals_the_unmerged_pair(tmp_path):
    """`minigpt lora merge BASE ADAPTER --out-dir DIR` writes weights whose logits equal base + adapter; an adapter
    made for another base is a one-line error and writes nothing."""
    from minigpt.checkpoint.native import load_model

    base = tiny_model()
    save_pretrained(base, tmp_path / "base")
    adapted = tiny_model()
    apply_lora(adapted, 4, 8, targets=["q_proj", "v_proj", "down_proj"])
    randomize_b(adapted)
    save_adapter(adapted, tmp_path / "adapter")
    proc = run_cli("lora", "merge", tmp_path / "base", tmp_path / "adapter", "--out-dir", tmp_path / "merged")
    assert proc.returncode == 0, proc.stderr
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "merged")(x), adapted(x), atol=1e-5, rtol=0)
    save_pretrained(tiny_model(dim=48, hidden_dim=64), tmp_path / "other")
    bad = run_cli("lora", "merge", tmp_path / "other", tmp_path / "adapter", "--out-dir", tmp_path / "bad")
    assert_one_line_error(bad, "has shape")
    assert not (tmp_path / "bad").exists()
