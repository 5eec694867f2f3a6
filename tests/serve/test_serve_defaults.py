"""`minigpt serve` start-up defaults: an empty API key is refused (it used to switch authentication off), and a
non-loopback address without a key is warned about."""
import subprocess
import sys

import pytest
from conftest import CLI_ENV, assert_one_line_error, run_cli


def test_empty_api_key_flag_is_refused(tmp_path):
    proc = run_cli("serve", tmp_path / "missing", "--api-key", "")
    assert_one_line_error(proc, "--api-key is empty")


@pytest.mark.slow
def test_empty_api_key_variable_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "minigpt", "serve", str(tmp_path / "missing")], capture_output=True,
                          text=True, env={**CLI_ENV, "MINIGPT_API_KEY": " "}, timeout=120)
    assert_one_line_error(proc, "MINIGPT_API_KEY is empty")


@pytest.mark.slow
def test_public_address_without_a_key_warns(tmp_path):
    env = {k: v for k, v in CLI_ENV.items() if k != "MINIGPT_API_KEY"}
    proc = subprocess.run([sys.executable, "-m", "minigpt", "serve", str(tmp_path / "missing"), "--host", "0.0.0.0"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    assert "warning: serving on 0.0.0.0 without an API key" in proc.stderr
    quiet = subprocess.run([sys.executable, "-m", "minigpt", "serve", str(tmp_path / "missing"), "--host", "127.0.0.1"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert quiet.returncode == 1 and "warning" not in quiet.stderr
