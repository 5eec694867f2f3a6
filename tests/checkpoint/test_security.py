"""Untrusted files: a crafted torch.distributed.checkpoint index must not run code in `checkpoint consolidate` or in
`train --resume`, even with a manifest that matches it (whoever writes the files writes the manifest)."""
import json
import pickle

import pytest
from conftest import assert_one_line_error, run_cli, train_config

from minigpt.checkpoint.atomic import MANIFEST, sha256_file
from minigpt.checkpoint.dcp import read_index
from minigpt.errors import MiniGPTError
from minigpt.train.loop import train


class _Payload:
    """Unpickling this calls ``exec``, which writes a marker file: what a hostile checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def _run(tiny_data, out_dir, **kw):
    return train(train_config(tiny_data, out_dir, **{**dict(batch_size=4, warmup_steps=1, max_steps=2, eval_interval=1000,
                                                           eval_windows=4, log_interval=1, ckpt_interval=2), **kw}))


def _poison(ckpt, marker):
    """Replace the checkpoint's DCP index by the payload and rewrite the manifest so it matches."""
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    manifest = json.loads((ckpt / MANIFEST).read_text())
    for rel in manifest:
        p = ckpt / rel
        manifest[rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    (ckpt / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


@pytest.fixture(scope="module")
def trained_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    _run(tiny_data, out)
    return out


def test_a_real_index_reads_back(trained_run):
    ckpt = next((trained_run / "checkpoints").glob("step_*"))
    meta = read_index(ckpt / "dcp" / ".metadata", "index")
    assert any(k.startswith("model.") for k in meta.state_dict_metadata)


def test_consolidate_refuses_a_crafted_index(trained_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    ckpt = next((run / "checkpoints").glob("step_*"))
    marker = tmp_path / "marker"
    _poison(ckpt, marker)
    for target in (ckpt, run):  # the checkpoint itself, or the run directory
        proc = run_cli("checkpoint", "consolidate", target, tmp_path / "out")
        assert_one_line_error(proc, "refusing to load it")
        assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_resume_refuses_a_crafted_index(trained_run, tiny_data, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    marker = tmp_path / "marker"
    _poison(next((run / "checkpoints").glob("step_*")), marker)
    with pytest.raises(MiniGPTError, match="refusing to load it"):
        _run(tiny_data, run, max_steps=4, resume=True)
    assert not marker.exists()


def test_gguf_with_arrays_nested_100k_deep_is_one_line_error(tmp_path):
    import struct

    key = b"general.architecture"
    body = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    body += struct.pack("<IQ", 9, 1) * 100_000 + struct.pack("<IQ", 0, 1) + b"\x00"  # ARRAY of ARRAY of ... of UINT8
    path = tmp_path / "nested.gguf"
    path.write_bytes(body)
    assert_one_line_error(run_cli("generate", path, "--prompt", "hi"), "nests arrays too deeply")
    assert_one_line_error(run_cli("import", path, tmp_path / "out"), "nests arrays too deeply")
    assert not (tmp_path / "out").exists()
