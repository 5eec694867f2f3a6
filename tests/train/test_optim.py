"""Optimizers: Muon's update is an (approximately) orthogonalised gradient, the Muon / AdamW parameter split, Muon's
own learning rate under the schedule, exact resume with Muon state, and the option's validation and CLI flag."""
import json
import math
import shutil

import pytest
import torch
from conftest import TINY_MODEL, train_config
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from minigpt.checkpoint.native import load_model
from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer
from minigpt.train.config import TrainerConfig
from minigpt.train.loop import train
from minigpt.train.optim import MuonWithAdamW, build_optimizer, set_lr, split_parameters

torch.set_num_threads(1)


def _cfg(**kw):
    return TrainerConfig(max_steps=1, **{"optimizer": "muon", **kw})


def _model(**kw):
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=50, **{**TINY_MODEL, **kw}))


def test_muon_update_is_the_orthogonalised_gradient():
    """One step with momentum 0: the change of a matrix is -lr * sqrt(max(1, rows/cols)) * NS5(G). For singular
    values of G at least 0.002 of its Frobenius norm, the quintic iteration (a, b, c) = (3.4445, -4.7750, 2.0315)
    maps them into [0.68, 1.21] in exact arithmetic (5 steps of the scalar polynomial); bfloat16 adds ~1 %."""
    model = _model()
    opt = build_optimizer(model, _cfg(muon_lr=0.01, muon_momentum=0.0, muon_weight_decay=0.0))
    wk = model.layers[0].attention.wk.weight  # [16, 32]: n_kv_heads * head_dim x dim
    rows, cols = wk.shape
    torch.manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(rows, rows))
    v, _ = torch.linalg.qr(torch.randn(cols, rows))
    s = torch.logspace(0, -2, rows)  # condition number 100; smallest / Frobenius ~ 0.006
    grad = u @ torch.diag(s) @ v.T
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    wk.grad = grad.clone()
    before = wk.detach().clone()
    opt.step()
    update = (before - wk.detach()) / (0.01 * math.sqrt(max(1.0, rows / cols)))
    sv = torch.linalg.svdvals(update)
    assert sv.min() > 0.65 and sv.max() < 1.25, sv
    # the singular vectors are G's: U^T O V is diagonal up to bfloat16 rounding, and O is close to U V^T
    inner = u.T @ update @ v
    off = inner - torch.diag(torch.diagonal(inner))
    assert off.abs().max() < 0.05 * torch.diagonal(inner).min()
    polar = u @ v.T
    assert torch.nn.functional.cosine_similarity(update.flatten(), polar.flatten(), dim=0) > 0.97
    # the NS output ignores the gradient's scale: a 1000x smaller gradient gives the same update
    model2 = _model()
    opt2 = build_optimizer(model2, _cfg(muon_lr=0.01, muon_momentum=0.0, muon_weight_decay=0.0))
    for p in model2.parameters():
        p.grad = torch.zeros_like(p)
    model2.layers[0].attention.wk.weight.grad = grad * 1e-3
    opt2.step()
    update2 = (before - model2.layers[0].attention.wk.weight.detach()) / 0.01
    torch.testing.assert_close(update2, update, atol=0.03, rtol=0)  # bfloat16 rounding of a different input


@pytest.mark.parametrize("kw", [{}, dict(tie_embeddings=False, qk_norm=True, bias=True, pos_encoding="learned"),
                                dict(n_experts=2, n_experts_per_token=1)], ids=["tied", "untied-qknorm-bias", "moe"])
def test_muon_gets_the_hidden_matrices_and_adamw_the_rest(kw):
    model = _model(**kw)
    names = {id(p): n for n, p in model.named_parameters()}
    muon, adamw = split_parameters(model)
    muon_names, adamw_names = {names[id(p)] for p in muon}, {names[id(p)] for p in adamw}
    hidden = ("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight")
    assert muon_names == {n for n in names.values() if n.endswith(hidden)}
    assert adamw_names == set(names.values()) - muon_names  # everything else, each parameter once
    assert "tok_embeddings.weight" in adamw_names and all(p.dim() == 2 for p in muon)
    if kw.get("tie_embeddings") is False:
        assert {"output.weight", "pos_embeddings.weight", "layers.0.attention.q_norm.weight",
                "layers.0.attention.wq.bias"} <= adamw_names
    if kw.get("n_experts"):
        assert "layers.0.feed_forward.router.weight" in adamw_names
        assert "layers.0.feed_forward.experts.1.w2.weight" in muon_names
    opt = build_optimizer(model, _cfg(muon_lr=0.03, lr=1e-3))
    assert isinstance(opt, MuonWithAdamW) and isinstance(opt.muon, torch.optim.Muon)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    set_lr(opt, 5e-4, _cfg(muon_lr=0.03, lr=1e-3))  # half the peak: both optimizers at half their own peak
    assert [g["lr"] for g in opt.muon.param_groups] == [pytest.approx(0.015)]
    assert all(g["lr"] == 5e-4 for g in opt.adamw.param_groups)
    adamw = build_optimizer(model, _cfg(optimizer="adamw"))
    assert isinstance(adamw, torch.optim.AdamW)


def test_resume_with_muon_state_is_bit_exact(tiny_data, tmp_path):
    kw = dict(max_steps=10, ckpt_interval=5, keep_checkpoints=10, optimizer="muon", muon_lr=0.03)
    full = tmp_path / "full"
    result = train(train_config(tiny_data, full, **kw))
    # the checkpoint carries Muon's momentum buffers next to AdamW's moments
    model = load_model(full / "checkpoints" / "step_0000010")
    opt = build_optimizer(model, _cfg(muon_lr=0.03))
    from minigpt.train import state as train_state

    train_state.load(full / "checkpoints" / "step_0000005", model, opt)
    sd = get_optimizer_state_dict(model, opt)
    assert "momentum_buffer" in sd["state"]["layers.0.attention.wq.weight"]
    assert "exp_avg" in sd["state"]["tok_embeddings.weight"]
    # crash right after step 5, resume to 10: the same weights and losses as the uninterrupted run
    crashed = tmp_path / "crashed"
    shutil.copytree(full, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step_0000010")
    (crashed / "latest").write_text("checkpoints/step_0000005\n")
    train(train_config(tiny_data, crashed, resume=True, **kw))
    a = load_model(full / "checkpoints" / "step_0000010").state_dict()
    b = load_model(crashed / "checkpoints" / "step_0000010").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows_a = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(line) for line in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows_b] == [r["loss"] for r in rows_a]
    assert rows_a[-1]["loss"] < rows_a[0]["loss"] - 0.2 and math.isfinite(result["val_loss"])
    assert "optimizer: muon" in (full / "config.yaml").read_text()


@pytest.mark.parametrize("kw, fragment", [
    (dict(optimizer="sgd"), "optimizer must be adamw or muon"),
    (dict(muon_lr=0.0), "muon_lr"),
    (dict(muon_momentum=1.0), "muon_momentum"),
    (dict(parallel="fsdp"), "parallel=fsdp"),
])
def test_invalid_optimizer_options(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        _cfg(**kw)


def test_cli_flag_selects_the_optimizer():
    from minigpt.cli import build_parser

    args = build_parser().parse_args(["train", "--optimizer", "muon", "--max-steps", "1"])
    assert args.optimizer == "muon"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--optimizer", "lion"])
