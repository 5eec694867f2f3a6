"""Shared pytest fixtures and helpers."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The offline corpora / checkpoint directory next to the repository; skips the test when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is absent")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A prepared data directory: the first 80 kB of the bundled Tiny Shakespeare, a 320-token BPE."""
    from minigpt.data.prepare import prepare
    from minigpt.data.sources import BUNDLED

    root = tmp_path_factory.mktemp("tiny_data")
    text = BUNDLED["shakespeare"].path.read_text(encoding="utf-8")[:80_000]
    src = root / "slice.txt"
    src.write_text(text, encoding="utf-8")
    prepare(str(src), root / "prepared", vocab_size=320)
    return root / "prepared"


# A model small enough that a training step takes milliseconds on 2 cores.
TINY_MODEL = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64, "multiple_of": 16}


# Subprocesses of the CLI: one thread each (the suite shares 2 cores) and never a hub lookup.
CLI_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}


def run_cli(*args, stdin=None):
    """Run ``python -m minigpt ARGS`` and return the completed process (text mode)."""
    return subprocess.run([sys.executable, "-m", "minigpt", *map(str, args)], capture_output=True, text=True,
                          env=CLI_ENV, input=stdin, timeout=300)


def assert_one_line_error(proc, *fragments):
    """The CLI failed with exit 1 and exactly one ``error: ...`` line containing every fragment, no traceback."""
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
