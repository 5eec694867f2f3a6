"""torchrun on CPU with gloo and 2 local processes: DDP and FSDP2 match one process, sharded checkpoints reshard."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from conftest import TINY_MODEL

from minigpt.checkpoint.native import load_model
from minigpt.train.state import consolidate

pytestmark = pytest.mark.distributed

# 2 ranks x 1 thread on a 2-core machine: oversubscribing the cores makes gloo runs many times slower.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train(tiny_data, out_dir, nproc, *extra, batch_size, steps=5, resume=False):
    args = ["-m", "minigpt", "train", "--data", str(tiny_data), "--out-dir", str(out_dir), "--max-steps", str(steps),
            "--batch-size", str(batch_size), "--threads", "1", "--seed", "0",
            "--set", f"model={json.dumps(TINY_MODEL)}", "--set", "seq_len=32", "--set", "log_interval=1",
            "--set", "eval_windows=8", "--set", "warmup_steps=2", "--set", "lr=0.003", *extra]
    if resume:
        args.append("--resume")
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", f"--nproc-per-node={nproc}",
               "--rdzv-backend", "c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(l) for l in (out_dir / "metrics.jsonl").read_text().splitlines()]


def losses(rows):
    return [r["loss"] for r in rows if "skipped" not in r]


@pytest.fixture(scope="module")
def single(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    return out, run_train(tiny_data, out / "run", 1, batch_size=8)


# Same global batch (2 ranks x 4 = 1 x 8) and the same data (the sampler draws the global batch on every rank):
# only the order of floating-point reductions differs, so 5 steps agree to ~1e-6; we allow 1e-4.
ATOL = 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(tiny_data, tmp_path, single, parallel):
    rows = run_train(tiny_data, tmp_path / "run", 2, "--parallel", parallel, batch_size=4)
    assert [r["step"] for r in rows] == [r["step"] for r in single[1]]
    assert losses(rows) == pytest.approx(losses(single[1]), abs=ATOL)
    assert rows[-1]["val_loss"] == pytest.approx(single[1][-1]["val_loss"], abs=ATOL)
    assert json.loads(json.dumps(rows[0]))["tokens"] == 8 * 32  # global tokens per step


@pytest.mark.slow  # two child processes and a resume, ~17 s (make test-slow, its own CI stage)
def test_fsdp_checkpoint_resumes_in_one_process_and_back(tiny_data, tmp_path, single):
    # 2 FSDP ranks write sharded checkpoints at steps 3 and 5 ...
    sharded = tmp_path / "sharded"
    run_train(tiny_data, sharded, 2, "--parallel", "fsdp", "--set", "ckpt_interval=3", batch_size=4)
    ckpt3 = sharded / "checkpoints" / "step_0000003"
    assert not (ckpt3 / "model.safetensors").exists() and (ckpt3 / "dcp").is_dir()
    # ... one process resumes from step 3 and continues the same trajectory.
    one = tmp_path / "one"
    shutil.copytree(sharded, one)
    shutil.rmtree(one / "checkpoints" / "step_0000005")
    (one / "latest").write_text("checkpoints/step_0000003\n")
    rows = run_train(tiny_data, one, 1, batch_size=8, resume=True)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert losses(rows) == pytest.approx(losses(single[1]), abs=ATOL)
    # And back: a single-process checkpoint resumes on 2 FSDP ranks.
    back = tmp_path / "back"
    shutil.copytree(single[0] / "run", back)
    run_train(tiny_data, back, 1, "--set", "ckpt_interval=3", batch_size=8)  # rewrite with a step-3 checkpoint
    shutil.rmtree(back / "checkpoints" / "step_0000005")
    (back / "latest").write_text("checkpoints/step_0000003\n")
    rows = run_train(tiny_data, back, 2, "--parallel", "fsdp", batch_size=4, resume=True)
    assert losses(rows) == pytest.approx(losses(single[1]), abs=ATOL)
    # A sharded checkpoint consolidates into a normal model directory.
    model = load_model(consolidate(sharded / "checkpoints" / "step_0000005", tmp_path / "consolidated"))
    reference = load_model(single[0] / "run" / "checkpoints" / "step_0000005")
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, atol=1e-4, rtol=0)
