"""Schemathesis fuzzes `minigpt serve` from its own /openapi.json: schema-valid and schema-violating requests to
every operation, with the checks that no answer is a 5xx and that every answer (SSE events included) matches the
documented schema. Bounded (50 examples per operation, fixed seed), loopback only, on a tiny random model."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, random_model
from serve_helpers import ENV, InProcessServer

pytest.importorskip("schemathesis", reason="schemathesis is a dev extra: pip install -e '.[dev]'")


@pytest.mark.slow  # a server and a fuzzing run, ~13 s (make test-slow, CI's second stage)
def test_schemathesis_finds_no_server_error_and_no_schema_violation(tiny_data, tmp_path):
    from minigpt.infer.engine import Engine
    from minigpt.serve.app import ServerState
    from minigpt.tokenizer.tokenizer import Tokenizer

    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(tiny_data)
    model = random_model(TINY_MODEL, vocab_size=tok.vocab_size, max_seq_len=128)
    srv = InProcessServer(ServerState(Engine(model, tok, max_batch_size=4), tok, "tiny"))
    try:
        st = Path(sys.executable).with_name("schemathesis")
        proc = subprocess.run(
            [str(st), "run", f"{srv.url}/openapi.json", "--checks", "not_a_server_error,response_schema_conformance",
             "--max-examples", "50", "--seed", "1", "--workers", "1", "--request-timeout", "60"],
            capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=900)  # cwd: its .hypothesis cache
    finally:
        srv.stop()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # every documented operation, /v1/models/{model} included
    assert "Tested: 7" in out and "No issues found" in out, out[-3000:]
