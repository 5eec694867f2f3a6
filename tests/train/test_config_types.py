"""Option values of the wrong type are refused by name when a config is built (``dataclass_from_dict``), before a
comparison deep in the checks could fail with Python's own words; numbers written as strings, as YAML reads
``1e-3``, are read as numbers."""
import subprocess
import sys

import pytest

from minigpt.model.config import ModelConfig, preset
from minigpt.train.loop import TrainConfig


@pytest.mark.parametrize("options, message", [
    ({"lr": "abc"}, "training option 'lr' must be a number, got 'abc'"),
    ({"lr": True}, "training option 'lr' must be a number, got True"),
    ({"batch_size": 2.5}, "training option 'batch_size' must be an integer, got 2.5"),
    ({"batch_size": "eight"}, "training option 'batch_size' must be an integer, got 'eight'"),
    ({"compile": "yes"}, "training option 'compile' must be true or false, got 'yes'"),
    ({"optimizer": 3}, "training option 'optimizer' must be a string, got 3"),
    ({"max_steps": "many"}, "training option 'max_steps' must be an integer, got 'many'"),
])
def test_a_value_of_the_wrong_type_names_its_option(options, message):
    with pytest.raises(ValueError) as e:
        TrainConfig.from_dict(options)
    assert str(e.value) == message


def test_keep_checkpoints_is_0_for_all_or_more():
    with pytest.raises(ValueError, match="keep_checkpoints must be 0 \\(keep all\\) or more, got -1"):
        TrainConfig.from_dict({"keep_checkpoints": -1, "max_steps": 1})
    assert TrainConfig.from_dict({"keep_checkpoints": 0, "max_steps": 1}).keep_checkpoints == 0


def test_numbers_written_as_strings_are_numbers_and_none_stays_allowed():
    cfg = TrainConfig.from_dict({"lr": "1e-3", "batch_size": "4", "max_steps": None, "max_time": "60"})
    assert cfg.lr == 1e-3 and cfg.batch_size == 4 and cfg.max_steps is None and cfg.max_time == 60.0


def test_model_fields_are_checked_the_same_way():
    with pytest.raises(ValueError, match="ModelConfig field 'dim' must be an integer, got 'wide'"):
        ModelConfig.from_dict({**preset("tiny").to_dict(), "dim": "wide"})
    assert ModelConfig.from_dict({**preset("tiny").to_dict(), "norm_eps": "1e-6"}).norm_eps == 1e-6


@pytest.mark.slow
def test_the_cli_says_it_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "minigpt", "train", "--preset", "tiny", "--set", "lr=abc",
                        "--out-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == ["error: invalid training config: training option 'lr' must be a "
                                             "number, got 'abc'"]
    assert not (tmp_path / "run").exists()
