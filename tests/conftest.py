"""Shared pytest fixtures."""
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
    from minigpt.data import BUNDLED, prepare

    root = tmp_path_factory.mktemp("tiny_data")
    text = BUNDLED["shakespeare"].path.read_text(encoding="utf-8")[:80_000]
    src = root / "slice.txt"
    src.write_text(text, encoding="utf-8")
    prepare(str(src), root / "prepared", vocab_size=320)
    return root / "prepared"


# A model small enough that a training step takes milliseconds on 2 cores.
TINY_MODEL = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64, "multiple_of": 16}
