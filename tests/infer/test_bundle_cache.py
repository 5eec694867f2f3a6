"""The native runner's bundles are kept to ``$MINIGPT_NATIVE_CACHE_GB`` (``minigpt.infer.native.prune_bundles``): each
is a copy of a model's step tensors, and every new model, precision or MiniGPT version wrote another, never removed
(6.4 GB after one day of benchmarks on one machine). Checked on directories laid out as bundles are: the least
recently used go first, the one just written never, a use refreshes a bundle, leftovers of killed writes go once
they are a day old, and a bad limit is refused with the variable's name. Likewise the saved steps and step packages
(``minigpt.infer.fastpath.aot.prune_steps``, ``$MINIGPT_COMPILED_STEPS_GB``), but never a package a bundle runs."""
import json
import os
import time
from pathlib import Path

import pytest

from minigpt.infer import launcher
from minigpt.infer.native import LIMIT_ENV, PARTIAL_MAX_AGE_S, bundle_limit, prune_bundles


def _bundle(directory: Path, name: str, size: int, used: float) -> Path:
    bundle = directory / name
    bundle.mkdir(parents=True, mode=0o700)
    (bundle / "tensors.bin").write_bytes(b"\0" * size)
    (bundle / "manifest.json").write_text("{}")
    os.utime(bundle / "manifest.json", (used, used))
    return bundle


def test_the_least_recently_used_bundles_go_first_and_the_new_one_never(tmp_path):
    now = time.time()
    old, mid, recent = (_bundle(tmp_path, name, 1000, now - age) for name, age in (("a", 300), ("b", 200), ("c", 100)))
    new = _bundle(tmp_path, "d", 1000, now)
    assert prune_bundles(tmp_path, new, 4100) == []  # within the limit (manifests count too)
    assert prune_bundles(tmp_path, new, 2500) == [old, mid]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "d"]
    # a bundle larger than the limit is kept when it is the new one, alone
    assert prune_bundles(tmp_path, new, 0) == [recent] and [p.name for p in tmp_path.iterdir()] == ["d"]
    # ... and removed like any other once another is newer
    newer = _bundle(tmp_path, "e", 10, now + 1)
    assert prune_bundles(tmp_path, newer, 500) == [new]


def test_a_use_refreshes_a_bundle(tmp_path, monkeypatch):
    """``read_manifest`` (what the torch-free launcher reads before running a bundle) marks it used, so an old but
    busy bundle outlives a newer idle one."""
    monkeypatch.setenv(launcher.ENV, str(tmp_path))
    native = tmp_path / "native"
    runner, package, prefill = tmp_path / "runner.so", tmp_path / "step.pt2", tmp_path / "prefill.pt2"
    for f in (runner, package, prefill):
        f.write_bytes(b"x")
        f.chmod(0o600)
    now = time.time()
    busy = _bundle(native, "busy", 1000, now - 1000)
    (busy / "manifest.json").write_text(json.dumps({"format": launcher.FORMAT, "runner": str(runner),
                                                    "package": str(package), "prefill": str(prefill)}))
    os.utime(busy / "manifest.json", (now - 1000, now - 1000))
    idle = _bundle(native, "idle", 1000, now - 10)
    new = _bundle(native, "new", 1000, now)
    assert launcher.read_manifest("busy")["bundle"] == str(busy)
    assert prune_bundles(native, new, 2500) == [idle]
    prefill.unlink()  # a bundle whose prefill package is gone is not run (native.write_bundle makes it again)
    assert launcher.read_manifest("busy") is None


def test_every_reader_and_writer_finds_a_bundle_in_one_place(tmp_path, monkeypatch):
    """``launcher.bundle_dir``: where ``read_manifest``, ``native.write_bundle`` and ``generate --compile``'s notice
    look for bundle ``key``; None with the cache off, and then no manifest is read."""
    monkeypatch.setenv(launcher.ENV, str(tmp_path))
    assert launcher.bundle_dir("k") == tmp_path / "native" / "k"
    assert launcher.bundle_dir("k", tmp_path / "other") == tmp_path / "other" / "native" / "k"
    monkeypatch.setenv(launcher.ENV, "off")
    assert launcher.bundle_dir("k") is None and launcher.read_manifest("k") is None


def test_leftovers_of_killed_writes_go_when_a_day_old(tmp_path):
    now = time.time()
    new = _bundle(tmp_path, "new", 10, now)
    stale, young = tmp_path / ".partial-abc", tmp_path / ".partial-def"
    for d, age in ((stale, PARTIAL_MAX_AGE_S + 60), (young, 60)):
        d.mkdir()
        (d / "tensors.bin").write_bytes(b"\0" * 10)
        os.utime(d, (now - age, now - age))
    assert prune_bundles(tmp_path, new, 10 ** 9) == [stale]
    assert young.is_dir() and not stale.exists()


def test_links_are_left_alone(tmp_path):
    outside = _bundle(tmp_path / "elsewhere", "x", 1000, time.time() - 1000)
    native = tmp_path / "native"
    new = _bundle(native, "new", 10, time.time())
    (native / "link").symlink_to(outside)
    assert prune_bundles(native, new, 0) == [] and (outside / "tensors.bin").is_file()


@pytest.mark.parametrize("value, want", [("", 8 * 10 ** 9), ("0", 0), ("0.5", 5 * 10 ** 8), (" 2 ", 2 * 10 ** 9)])
def test_the_limit_comes_from_the_environment(monkeypatch, value, want):
    monkeypatch.setenv(LIMIT_ENV, value)
    assert bundle_limit() == want


@pytest.mark.parametrize("value", ["-1", "lots", "nan", "inf"])
def test_a_bad_limit_is_refused_with_the_variables_name(monkeypatch, value):
    monkeypatch.setenv(LIMIT_ENV, value)
    with pytest.raises(RuntimeError, match=rf"\$MINIGPT_NATIVE_CACHE_GB='{value}' is not a size in GB"):
        bundle_limit()


# ---------------------------------------------------------------- saved steps and packages (fastpath.aot)
def _step_file(directory: Path, name: str, size: int, used: float) -> Path:
    f = directory / name
    f.write_bytes(b"\0" * size)
    f.chmod(0o600)
    os.utime(f, (used, used))
    return f


def test_saved_steps_go_least_recently_used_first_but_not_a_bundles_packages(tmp_path):
    from minigpt.infer.fastpath.aot import prune_steps

    now = time.time()
    old, pinned, prefill, mid, recent = (_step_file(tmp_path, n, 1000, now - age) for n, age in
                                         (("a.pt2", 400), ("b.pt2", 300), ("f.pt2", 250), ("c.step", 200),
                                          ("d.pt2", 100)))
    others = [_step_file(tmp_path, n, 5000, now - 1000) for n in ("runner.so", ".partial-x.pt2")]
    bundle = _bundle(tmp_path / "native", "k", 10, now)
    (bundle / "manifest.json").write_text(json.dumps({"package": str(pinned), "prefill": str(prefill)}))
    (_bundle(tmp_path / "native", "j", 10, now) / "manifest.json").write_text(json.dumps({"package": str(pinned),
                                                                                          "prefill": None}))
    new = _step_file(tmp_path, "e.step", 1000, now)
    assert prune_steps(tmp_path, new, 6000) == []
    assert prune_steps(tmp_path, new, 4000) == [old, mid]  # the bundle's two packages stay, counted
    assert prune_steps(tmp_path, new, 0) == [recent]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".partial-x.pt2", "b.pt2", "e.step", "f.pt2", "native",
                                                          "runner.so"]
    assert all(f.exists() for f in others)


def test_loading_a_saved_step_marks_it_used(tmp_path):
    from minigpt.infer.fastpath import aot

    f = _step_file(tmp_path, "s.step", 10, time.time() - 1000)
    assert aot._load_saved(f, lambda p: "loaded") == "loaded"
    assert time.time() - f.stat().st_mtime < 60


def test_a_bad_steps_limit_is_one_warning_naming_the_variable(tmp_path, monkeypatch):
    from minigpt.infer.fastpath import aot

    monkeypatch.setenv(aot.STEPS_LIMIT_ENV, "lots")
    old = _step_file(tmp_path, "a.step", 10, time.time() - 1000)
    new = _step_file(tmp_path, "b.step", 10, time.time())
    with pytest.warns(RuntimeWarning, match=aot.STEPS_LIMIT_ENV):
        aot._prune_after_save(tmp_path, new)
    assert old.exists()
    monkeypatch.setenv(aot.STEPS_LIMIT_ENV, "0")
    aot._prune_after_save(tmp_path, new)
    assert not old.exists() and new.exists()
