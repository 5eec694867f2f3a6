"""The tests' CLI calls forked from a process that has imported torch (``tests/cli_zygote.py``) behave as a fresh
``python -m minigpt``: the same output, errors, exit status, stdin and working directory."""
import subprocess
import sys

import pytest
from conftest import CLI_ENV, TINY_MODEL, _zygote, random_model, run_cli

from minigpt.checkpoint.native import save_pretrained
from minigpt.tokenizer.tokenizer import train_tokenizer

# Each case starts a fresh interpreter (~3.5 s here): the ones that load torch's heavier parts run in the slow stage.
slow = pytest.mark.slow
COMMANDS = [
    ["--help"],
    pytest.param(["estimate", "--preset", "tiny"], marks=slow),
    pytest.param(["generate", "/nonexistent/model", "--prompt", "hi"], marks=slow),
    ["bench", "--bogus"],
    ["tokenizer", "train", "--data", "-", "--vocab-size", "10", "--out", "t.json"],
    # The prompt read from stdin, a model in the working directory, greedy decoding.
    pytest.param(["generate", "model", "--temperature", "0", "--max-new-tokens", "8"], marks=slow),
    pytest.param(["generate", "model", "--temperature", "0", "--max-new-tokens", "8", "--batch"], marks=slow),
]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a)[:40])
def test_a_forked_call_is_the_fresh_call(args, tmp_path, monkeypatch):
    if not _zygote.usable():
        pytest.skip("the zygote is off here (MINIGPT_TEST_FRESH_CLI, or it could not start single-threaded)")
    monkeypatch.chdir(tmp_path)  # relative paths resolve against the test's working directory in both
    tok = train_tokenizer(["some text the cat sat on the mat"] * 20, 280)
    save_pretrained(random_model(TINY_MODEL, vocab_size=tok.vocab_size), tmp_path / "model", tokenizer=tok)
    forked = run_cli(*args, stdin="some text\n")
    fresh = subprocess.run([sys.executable, "-m", "minigpt", *args], capture_output=True, text=True, env=CLI_ENV,
                           input="some text\n", timeout=300)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.args == fresh.args
