"""verify_manifest hashes a checkpoint file once, then trusts its stat signature until the file changes."""
import json
import os
import time

import pytest

from minigpt.checkpoint import atomic
from minigpt.checkpoint.atomic import atomic_dir, verify_manifest
from minigpt.errors import MiniGPTError


@pytest.fixture
def ckpt(tmp_path, monkeypatch):
    """A two-file directory with its manifest, a private stamps file, and a counter of the files hashed."""
    monkeypatch.setenv(atomic.STAMPS_ENV, str(tmp_path / "cache" / "verified.json"))
    with atomic_dir(tmp_path / "model") as d:
        (d / "weights.bin").write_bytes(os.urandom(4096))
        (d / "config.json").write_text("{}")
    hashed = []
    real = atomic.sha256_file
    monkeypatch.setattr(atomic, "sha256_file", lambda p, *a: hashed.append(p.name) or real(p, *a))
    return tmp_path / "model", hashed


def test_a_verified_file_is_not_hashed_again(ckpt, monkeypatch):
    path, hashed = ckpt
    monkeypatch.setattr(atomic, "RACY_NS", 0)
    verify_manifest(path)
    verify_manifest(path)
    assert sorted(hashed) == ["config.json", "weights.bin"]


def test_a_file_changed_after_verification_is_hashed_again_and_refused(ckpt, monkeypatch):
    path, hashed = ckpt
    monkeypatch.setattr(atomic, "RACY_NS", 0)
    verify_manifest(path)
    f = path / "weights.bin"
    before = f.stat()
    time.sleep(0.05)  # past the kernel's file-time tick
    data = bytearray(f.read_bytes())
    data[100] ^= 1
    f.write_bytes(bytes(data))  # same size
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the old modification time
    assert f.stat().st_ctime_ns != before.st_ctime_ns
    with pytest.raises(MiniGPTError, match="weights.bin does not match its SHA-256"):
        verify_manifest(path)


def test_a_file_written_moments_ago_is_hashed_every_time(ckpt):
    path, hashed = ckpt  # RACY_NS as shipped: the files are younger than it
    verify_manifest(path)
    verify_manifest(path)
    assert sorted(hashed) == ["config.json", "config.json", "weights.bin", "weights.bin"]


def test_a_stamps_file_others_can_write_or_garbage_vouches_for_nothing(ckpt, monkeypatch):
    path, hashed = ckpt
    monkeypatch.setattr(atomic, "RACY_NS", 0)
    verify_manifest(path)
    stamps = atomic.verified_stamps().file
    assert json.loads(stamps.read_text())
    os.chmod(stamps, 0o666)
    verify_manifest(path)
    assert len(hashed) == 4
    stamps.write_text("not json")
    os.chmod(stamps, 0o600)
    verify_manifest(path)  # ignored, then rewritten
    assert len(hashed) == 6 and json.loads(stamps.read_text())


def test_off_hashes_on_every_load_and_writes_no_stamps(ckpt, monkeypatch, tmp_path):
    path, hashed = ckpt
    monkeypatch.setattr(atomic, "RACY_NS", 0)
    monkeypatch.setenv(atomic.STAMPS_ENV, "off")
    verify_manifest(path)
    verify_manifest(path)
    assert len(hashed) == 4
    assert not (tmp_path / "cache").exists()


def test_a_wrong_size_is_refused_without_hashing(ckpt):
    path, hashed = ckpt
    with open(path / "weights.bin", "ab") as f:
        f.write(b"x")
    with pytest.raises(MiniGPTError, match="weights.bin does not match its size"):
        verify_manifest(path)
    assert "weights.bin" not in hashed


def test_the_stamps_file_is_private_whatever_the_umask(ckpt, monkeypatch):
    path, _ = ckpt
    monkeypatch.setattr(atomic, "RACY_NS", 0)
    old = os.umask(0o002)
    try:
        verify_manifest(path)
    finally:
        os.umask(old)
    assert atomic.verified_stamps().file.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("manifest", [
    '{"../x": {"sha256": "00", "bytes": 1}}', '{"/etc/hostname": {"sha256": "00", "bytes": 1}}', '{"weights.bin": 5}',
    '{"weights.bin": {"bytes": "1", "sha256": "00"}}', "[1, 2]", '{"": {"sha256": "00", "bytes": 1}}'])
def test_a_hostile_manifest_is_one_clear_error(ckpt, manifest):
    path, hashed = ckpt
    (path / "manifest.json").write_text(manifest)
    with pytest.raises(MiniGPTError, match="manifest.json is corrupt"):
        verify_manifest(path)
    assert not hashed
