"""Crash windows of training checkpoints: a process killed at any point of writing a checkpoint, pointing
``latest`` at it and pruning older ones leaves at least one complete checkpoint, which the next start finds (and
``latest`` names a loadable one); a resume tolerates the torn last line of metrics.jsonl that a kill mid-append
leaves."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, random_model, some_slow, train_config

from minigpt.checkpoint.atomic import verify_manifest
from minigpt.checkpoint.native import load_model, resolve_checkpoint
from minigpt.errors import MiniGPTError
from minigpt.tokenizer.tokenizer import Tokenizer
from minigpt.train import state as train_state
from minigpt.train.distributed import DistInfo
from minigpt.train.loop import train

torch.set_num_threads(1)


class Crash(BaseException):
    """What a kill looks like to the code under test: nothing after it runs, no handler cleans up."""


# The file-system operations whose order makes a checkpoint durable: a crash is injected before each in turn
# (before the k-th is after the (k-1)-th), so every prefix of the operations is a state a kill can leave.
OPERATIONS = ("rename", "replace", "unlink", "rmdir", "fsync")


class Faults:
    """Counts the operations of :data:`OPERATIONS` and raises :class:`Crash` instead of the ``crash_at``-th."""

    def __init__(self, monkeypatch, crash_at: int = 0) -> None:
        self.count, self.crash_at = 0, crash_at
        for name in OPERATIONS:
            monkeypatch.setattr(os, name, self._wrap(getattr(os, name)))

    def _wrap(self, real):
        def operation(*args, **kwargs):
            self.count += 1
            if self.count == self.crash_at:
                raise Crash(real.__name__)
            return real(*args, **kwargs)
        return operation


@pytest.fixture(scope="module")
def parts(tiny_data):
    model = random_model(TINY_MODEL, vocab_size=320)
    return model, torch.optim.AdamW(model.parameters()), Tokenizer.from_file(tiny_data / "tokenizer.json")


def save(run: Path, parts, step: int, keep: int) -> Path:
    model, optimizer, tokenizer = parts
    state = {"step": step, "tokens": 100 * step, "train_time": float(step), "warmup_end_time": None}
    return train_state.save(run, model, optimizer, tokenizer, state, {"sampler": {}, "rng": train_state.rng_state()},
                            DistInfo(), keep, sharded=False)


def recover(run: Path, parts) -> int:
    """What the next start does (clean up, find the newest complete checkpoint, load it); returns its step, after
    checking that no half-written or half-deleted checkpoint is left under a ``step_N`` name and that ``latest``
    names a loadable checkpoint too."""
    model, optimizer, _ = parts
    train_state.remove_stale_temporaries(run)
    assert not list((run / "checkpoints").glob(".*")), "temporaries left behind"
    for ckpt in (run / "checkpoints").iterdir():
        verify_manifest(ckpt)
        assert (ckpt / "trainer_state.pt").is_file() and (ckpt / "dcp" / ".metadata").is_file(), ckpt
    found = train_state.find_latest(run)
    assert found is not None, "no complete checkpoint left"
    state = train_state.load(found, model, optimizer)
    load_model(resolve_checkpoint(run))
    return state["step"]


# (existing checkpoint steps, keep, step saved): rotation that prunes one of two, that prunes the only other one,
# and a checkpoint written again at the step of the only one (e.g. a resumed run that has no step left to take).
SCENARIOS = {"keep 2": ([1, 2], 2, 3), "keep 1": ([2], 1, 3), "same step": ([3], 1, 3)}


@pytest.mark.parametrize("scenario", some_slow(sorted(SCENARIOS), ("keep 2", "same step")))
def test_a_crash_at_any_operation_of_a_save_leaves_a_good_checkpoint(tmp_path, parts, monkeypatch, scenario):
    existing, keep, step = SCENARIOS[scenario]
    base = tmp_path / "base"
    for s in existing:
        save(base, parts, s, keep)
    with monkeypatch.context() as m:  # a clean save, to count its operations
        clean = tmp_path / "clean"
        shutil.copytree(base, clean)
        faults = Faults(m)
        save(clean, parts, step, keep)
        total = faults.count
    assert total > 10
    remaining = sorted(p.name for p in (clean / "checkpoints").iterdir())
    assert remaining == [f"step_{s:07d}" for s in sorted({*existing, step})[-keep:]]
    assert recover(clean, parts) == step
    for k in range(1, total + 1):
        run = tmp_path / f"crash_{k}"
        shutil.copytree(base, run)
        with monkeypatch.context() as m:
            Faults(m, crash_at=k)
            with pytest.raises((Crash, MiniGPTError)):
                save(run, parts, step, keep)
        assert recover(run, parts) in (existing[-1], step), f"crash before operation {k} of {total}"
        shutil.rmtree(run)


def test_pruning_never_removes_the_new_checkpoint(tmp_path, parts):
    """A run resumed from step 2 because step 5 is corrupt: saving step 3 with keep=1 keeps step 3 (and leaves
    the later, corrupt step 5 alone) instead of pruning by name order down to the corrupt one."""
    run = tmp_path / "run"
    for s in (2, 5):
        save(run, parts, s, keep=0)
    (run / "checkpoints" / "step_0000005" / "trainer_state.pt").write_bytes(b"torn")
    save(run, parts, 3, keep=1)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000003", "step_0000005"]
    assert train_state.find_latest(run).name == "step_0000003"


def test_checkpoints_are_ordered_by_step_not_by_name(tmp_path, parts):
    """Past step 9,999,999 the zero-padded names stop sorting by step: step_10000000 < step_9999999."""
    run = tmp_path / "run"
    save(run, parts, 9_999_999, keep=1)
    save(run, parts, 10_000_000, keep=1)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_10000000"]
    assert train_state.find_latest(run).name == "step_10000000"


def _run(tiny_data, out_dir, **kw):
    return train(train_config(tiny_data, out_dir, **{**dict(batch_size=4, warmup_steps=1, max_steps=2,
                                                           eval_interval=1000, eval_windows=4, log_interval=1,
                                                           ckpt_interval=2), **kw}))


def test_resume_drops_a_torn_last_metrics_line(tiny_data, tmp_path, capfd):
    _run(tiny_data, tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 3, "loss": 5.1')  # the process died in the middle of this append
    capfd.readouterr()
    _run(tiny_data, tmp_path, max_steps=4, resume=True)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "torn last line" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: ")
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_resume_refuses_a_corrupt_metrics_line_in_the_middle(tiny_data, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(MiniGPTError, match="line 2 is not a metrics row"):
        train_state.truncate_metrics(metrics, 2)
    metrics.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"st')
    train_state.truncate_metrics(metrics, 2)
    assert metrics.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_a_full_disk_while_truncating_metrics_or_pointing_latest_keeps_the_old_files(tmp_path, monkeypatch):
    from minigpt import paths

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    (tmp_path / "checkpoints" / "step_0000002").mkdir(parents=True)
    (tmp_path / "latest").write_text("checkpoints/step_0000001\n")

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(paths.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        train_state.truncate_metrics(metrics, 2)
    with pytest.raises(OSError, match="No space left"):
        train_state.point_latest(tmp_path, tmp_path / "checkpoints" / "step_0000002")
    assert metrics.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    assert (tmp_path / "latest").read_text() == "checkpoints/step_0000001\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "latest", "metrics.jsonl"]
    monkeypatch.undo()
    train_state.point_latest(tmp_path, tmp_path / "checkpoints" / "step_0000002")
    assert (tmp_path / "latest").read_text() == "checkpoints/step_0000002\n"
