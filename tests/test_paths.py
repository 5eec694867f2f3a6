"""Output files written whole or not at all (``minigpt.paths``), and the commands that write them checking the path
before their long run rather than after it."""
import errno
import json
import os

import pytest
from conftest import assert_one_line_error, run_cli

from minigpt import paths
from minigpt.errors import MiniGPTError
from minigpt.model.config import ModelConfig


def test_write_text_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    assert paths.write_text_atomic(target, "new é\n") == target
    assert target.read_text(encoding="utf-8") == "new é\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_write_text_atomic_follows_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        paths.write_text_atomic(tmp_path / "f.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "f.txt").stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("stage", ["fsync", "replace"])
def test_a_failed_write_keeps_the_old_file_and_cleans_up(tmp_path, monkeypatch, stage):
    """A full disk at the flush, or a failure at the rename: the old content stays, no ``.tmp-`` file is left."""
    target = tmp_path / "results.md"
    target.write_text("the old report")

    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(paths.os, stage, fail)
    with pytest.raises(OSError, match="No space left"):
        paths.write_text_atomic(target, "half of a new report")
    assert target.read_text() == "the old report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.md"]


def test_an_interrupt_mid_write_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "config.json"
    target.write_text("{}")
    monkeypatch.setattr(paths.os, "fsync", lambda fd: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        paths.write_text_atomic(target, '{"dim": 64}')
    assert target.read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_write_text_atomic_refuses_a_folder(tmp_path):
    with pytest.raises(IsADirectoryError):
        paths.write_text_atomic(tmp_path, "x")


def test_check_file_path_and_write_output_name_the_flag(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(MiniGPTError, match=r"^--json .* is a folder; give a file path"):
        paths.check_file_path(tmp_path, "--json")
    with pytest.raises(MiniGPTError, match=r"^--out .*out\.md cannot be written: .* is an existing file"):
        paths.check_file_path(tmp_path / "a_file" / "out.md", "--out")
    assert paths.check_file_path(tmp_path / "new" / "deeper" / "r.json", "--json") == tmp_path / "new/deeper/r.json"
    assert not (tmp_path / "new").exists()  # checking makes nothing
    paths.write_output(tmp_path / "new" / "deeper" / "r.json", "{}\n", "--json")
    assert (tmp_path / "new" / "deeper" / "r.json").read_text() == "{}\n"
    with pytest.raises(MiniGPTError, match=r"^cannot write --out .*out\.md: "):
        paths.write_output(tmp_path / "a_file" / "out.md", "x", "--out")


def test_model_config_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    ModelConfig(dim=64, n_layers=1, n_heads=4, vocab_size=32).save(path)
    before = path.read_text()
    monkeypatch.setattr(paths.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError):
        ModelConfig(dim=128, n_layers=2, n_heads=4, vocab_size=32).save(path)
    assert path.read_text() == before and json.loads(before)["dim"] == 64


@pytest.mark.parametrize("command", [
    ["bench", "--presets", "tiny", "--rows", "decode-b1", "--json", "{dir}"],
    ["bench", "--presets", "tiny", "--rows", "decode-b1", "--out", "{file}/table.md"],
    ["bench", "quant", "{missing}", "--data", "{missing}", "--json", "{dir}"],
    ["bench", "speculative", "{missing}", "{missing}", "--data", "{missing}", "--json", "{file}/r.json"],
])
def test_bench_refuses_an_unwritable_output_before_measuring(tmp_path, command):
    """The benchmarks run for minutes to an hour; their --out/--json used to be written only at the end, and a
    folder or a path under a file then lost the run in a traceback. Here the models do not even exist: the path
    error must come first."""
    (tmp_path / "a_file").write_text("x")
    args = [a.format(dir=tmp_path, file=tmp_path / "a_file", missing=tmp_path / "none") for a in command]
    flag = "--json" if "--json" in args else "--out"
    assert_one_line_error(run_cli(*args), flag)
