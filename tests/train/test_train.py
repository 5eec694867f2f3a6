"""Training: schedule values, weight-decay groups, loss falls on real text, exact resume, atomic checkpoints."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, train_config

from minigpt.checkpoint.native import load_model, resolve_checkpoint, verify_manifest
from minigpt.errors import MiniGPTError
from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer
from minigpt.train import state as train_state
from minigpt.train.distributed import DistInfo
from minigpt.train.loop import train
from minigpt.train.schedule import decay_progress, warmup_cosine_lr
from minigpt.train.state import find_latest as find_resume_checkpoint
from minigpt.train.trainer import param_groups


def test_warmup_cosine_values():
    lr, min_lr, warmup, total = 1e-3, 1e-4, 10, 110
    at = lambda step: warmup_cosine_lr(step, lr=lr, min_lr=min_lr, warmup_steps=warmup,
                                       progress=decay_progress(step, warmup, total))
    assert at(0) == pytest.approx(lr / warmup)
    assert at(warmup - 1) == pytest.approx(lr)  # warmup ends at the peak
    assert at(warmup) == pytest.approx(lr)  # decay starts from the peak
    assert at(warmup + 50) == pytest.approx((lr + min_lr) / 2)  # cosine midpoint
    assert at(total) == pytest.approx(min_lr)  # end
    assert at(total + 100) == pytest.approx(min_lr)  # and stays there
    values = [at(s) for s in range(warmup, total + 1)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_time_budget_drives_progress_when_it_binds_first():
    # 10 of 100 steps done but 75% of the time budget spent: the schedule follows time.
    p = decay_progress(10, 0, 100, elapsed=75.0, warmup_end_time=0.0, max_time=100.0)
    assert p == pytest.approx(0.75)
    assert decay_progress(50, 0, 100) == pytest.approx(0.5)


def test_weight_decay_only_on_matrices():
    model = Transformer(ModelConfig(vocab_size=50, **TINY_MODEL))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in no_decay["params"]} == {n for n, _ in model.named_parameters() if "norm" in n}
    # the tied embedding / LM head matrix appears once
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.slow
def test_loss_falls_on_real_text(tiny_data, tmp_path):
    result = train(train_config(tiny_data, tmp_path / "run", max_steps=200, batch_size=16, lr=5e-3, eval_interval=100))
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert first > math.log(320) - 0.5  # starts near uniform
    assert last < first - 1.5, (first, last)
    assert result["val_loss"] < first - 1.0
    assert result["val_bpb"] == pytest.approx(
        result["val_loss"] * json.loads((tiny_data / "meta.json").read_text())["val"]["tokens"]
        / json.loads((tiny_data / "meta.json").read_text())["val"]["bytes"] / math.log(2))
    for key in ("step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory", "ppl"):
        assert key in rows[-1]
    assert "val_loss" in rows[-1] and "bpb" in rows[-1]
    assert (tmp_path / "run" / "loss_curve.png").stat().st_size > 1000
    assert (tmp_path / "run" / "config.yaml").is_file()
    model = load_model(resolve_checkpoint(tmp_path / "run"))  # the run dir's `latest` is a loadable model
    assert model.config.dim == 32


def test_resume_reproduces_the_uninterrupted_run(tiny_data, tmp_path):
    full = tmp_path / "full"
    train(train_config(tiny_data, full, max_steps=12, ckpt_interval=4, keep_checkpoints=10, model={**TINY_MODEL, "dropout": 0.1}))
    # Simulate a crash right after the step-8 checkpoint: later checkpoints never happened.
    crashed = tmp_path / "crashed"
    shutil.copytree(full, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step_0000012")
    (crashed / "latest").write_text("checkpoints/step_0000008\n")
    train(train_config(tiny_data, crashed, max_steps=12, ckpt_interval=4, keep_checkpoints=10, resume=True,
               model={**TINY_MODEL, "dropout": 0.1}))
    a = load_model(full / "checkpoints" / "step_0000012").state_dict()
    b = load_model(crashed / "checkpoints" / "step_0000012").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows_a = [json.loads(l) for l in (full / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(l) for l in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_b] == [r["step"] for r in rows_a]  # no duplicated or missing step
    assert [r["loss"] for r in rows_b] == [r["loss"] for r in rows_a]  # same next-step losses


def _save(out_dir, model, tok, step):
    opt = torch.optim.AdamW(model.parameters())
    return train_state.save(out_dir, model, opt, tok, {"step": step}, {"rng": train_state.rng_state()},
                            DistInfo(), keep=3, sharded=False)


def test_interrupted_checkpoint_write_keeps_the_last_good_one(tmp_path, monkeypatch):
    model = Transformer(ModelConfig(vocab_size=50, **TINY_MODEL))
    from minigpt.tokenizer.tokenizer import train_tokenizer

    tok = train_tokenizer(["hello world"] * 10, 260)
    good = _save(tmp_path, model, tok, 1)

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(MiniGPTError, match="previous checkpoint .checkpoints/step_0000001. is intact"):
        _save(tmp_path, model, tok, 2)
    assert (tmp_path / "latest").read_text().strip() == "checkpoints/step_0000001"
    verify_manifest(good)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000001"]  # no half-written dir
    assert not [p for p in tmp_path.rglob(".step_*")]


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path, capsys):
    model = Transformer(ModelConfig(vocab_size=50, **TINY_MODEL))
    from minigpt.tokenizer.tokenizer import train_tokenizer

    tok = train_tokenizer(["hello world"] * 10, 260)
    _save(tmp_path, model, tok, 1)
    newest = _save(tmp_path, model, tok, 2)
    with open(newest / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert find_resume_checkpoint(tmp_path).name == "step_0000001"
    assert "corrupt" in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tiny_data, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "minigpt", "train", "--data", str(tiny_data), "--out-dir", str(out),
         "--max-steps", "100000", "--threads", "1", "--set", f"model={json.dumps(TINY_MODEL)}",
         "--set", "seq_len=32", "--set", "batch_size=4", "--set", "log_interval=1", "--set", "eval_windows=4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.time() + 120
    metrics = out / "metrics.jsonl"
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "Traceback" not in output
    ckpt = find_resume_checkpoint(out)
    assert ckpt is not None
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert state["step"] >= 3


def _nan_after(n_good, n_bad=10**9):
    """An lm_loss that is finite for n_good calls, then NaN for n_bad calls, then finite again."""
    from minigpt.model.transformer import lm_loss

    calls = {"n": 0}

    def loss(logits, targets):
        calls["n"] += 1
        value = lm_loss(logits, targets)
        return value * float("nan") if n_good < calls["n"] <= n_good + n_bad else value

    return loss


def test_a_non_finite_step_is_skipped_and_training_continues(tiny_data, tmp_path, monkeypatch):
    import minigpt.train.loop as train_mod

    monkeypatch.setattr(train_mod, "lm_loss", _nan_after(5, n_bad=1))
    train(train_config(tiny_data, tmp_path / "run", max_steps=10, log_interval=1))
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("skipped")] == [6]
    model = load_model(resolve_checkpoint(tmp_path / "run"))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_consecutive_non_finite_steps_abort_and_keep_the_last_good_checkpoint(tiny_data, tmp_path, monkeypatch):
    import minigpt.train.loop as train_mod

    monkeypatch.setattr(train_mod, "lm_loss", _nan_after(8))
    with pytest.raises(MiniGPTError, match="3 consecutive steps with a non-finite"):
        train(train_config(tiny_data, tmp_path / "run", max_steps=50, ckpt_interval=4, max_bad_steps=3))
    good = find_resume_checkpoint(tmp_path / "run")
    assert good.name == "step_0000008"
    assert all(torch.isfinite(p).all() for p in load_model(good).parameters())


def _train_cmd(tiny_data, out_dir, *extra):
    return [sys.executable, "-m", "minigpt", "train", "--data", str(tiny_data), "--out-dir", str(out_dir),
            "--max-steps", "30", "--threads", "1", "--seed", "3", "--set", f"model={json.dumps({**TINY_MODEL, 'dropout': 0.1})}",
            "--set", "seq_len=32", "--set", "batch_size=4", "--set", "log_interval=1", "--set", "ckpt_interval=4",
            "--set", "eval_windows=4", "--set", "eval_interval=10", *extra]


@pytest.mark.slow  # a child process killed and resumed, ~10 s (make test-slow, its own CI stage)
def test_sigkill_then_resume_is_bit_exact(tiny_data, tmp_path):
    """A real training process killed with SIGKILL at a random step resumes to the same final weights, and the
    metrics log has every step exactly once."""
    import random

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full = tmp_path / "full"
    subprocess.run(_train_cmd(tiny_data, full), check=True, capture_output=True, env=env, timeout=300)

    killed = tmp_path / "killed"
    kill_at = random.Random(7).randint(9, 26)  # after at least two checkpoints, before the end
    proc = subprocess.Popen(_train_cmd(tiny_data, killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= kill_at:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    steps_before = [json.loads(l)["step"] for l in metrics.read_text().splitlines()]
    assert 0 < len(steps_before) < 30

    subprocess.run(_train_cmd(tiny_data, killed, "--resume"), check=True, capture_output=True, env=env, timeout=300)
    a = load_model(full / "checkpoints" / "step_0000030").state_dict()
    b = load_model(killed / "checkpoints" / "step_0000030").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows_a = [json.loads(l) for l in (full / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(l) for l in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows_b] == list(range(1, 31))
    assert [r["loss"] for r in rows_b] == [r["loss"] for r in rows_a]
    assert not list((killed / "checkpoints").glob(".step_*"))  # no half-written leftovers


@pytest.mark.slow
def test_unwritable_run_directory_is_a_clear_error_before_training(tiny_data, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = subprocess.run(_train_cmd(tiny_data, blocker / "run"), capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error:") and len(proc.stderr.strip().splitlines()) == 1


def test_not_enough_disk_space_is_a_clear_error_before_training(tiny_data, tmp_path, monkeypatch):
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(train_state.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(MiniGPTError, match="not enough free disk space"):
        train(train_config(tiny_data, tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists()



@pytest.mark.parametrize("kw, message", [
    (dict(model={"dim": -1}), "invalid model config: ModelConfig.dim"),
    (dict(seq_len=100_000), "seq_len 100000 exceeds the model's max_seq_len"),
    (dict(vocab_size=10), "invalid training config: vocab_size must be between 259"),
])
def test_options_that_cannot_make_a_model_fail_before_the_data_is_prepared(tmp_path, kw, message):
    """train() (not only the CLI) refuses them before it tokenizes a raw corpus into out_dir/data."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. " * 400)
    with pytest.raises(MiniGPTError, match=message):
        train(train_config(corpus, tmp_path / "run", **kw))
    assert not (tmp_path / "run" / "data").exists()


RECIPES = Path(__file__).resolve().parents[2] / "minigpt" / "recipes"


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_every_bundled_recipe_is_a_valid_training_config(recipe):
    """The YAML files `make demo` and the README run: every key known, every value in range, the model buildable."""
    from minigpt.cli.train import read_config_file
    from minigpt.model.config import preset
    from minigpt.train.loop import TrainConfig

    cfg = TrainConfig.from_dict(read_config_file(str(RECIPES / recipe)))
    assert cfg.max_steps or cfg.max_time
    model_cfg = preset(cfg.preset, vocab_size=1024, **cfg.model)
    assert model_cfg.n_heads % model_cfg.n_kv_heads == 0
