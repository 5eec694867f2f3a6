"""Helpers shared by the serving tests: a quickly trained tiny model, a random one for chats, and a `minigpt serve`
subprocess."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

import torch
from conftest import TINY_MODEL, random_model

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "PYTHONUNBUFFERED": "1"}
# A long context so that a long generation takes long enough to be cancelled or drained mid-way.
SERVED_MODEL = {**TINY_MODEL, "max_seq_len": 512}
CHAT_WORDS = "the cat sat on a mat why is sky blue tell me about tea please answer briefly".split()


def chat_model(directory: Path) -> Path:
    """A random SERVED_MODEL-shaped model (weights with noise 0.5, so answers vary) with a 300-token BPE trained on
    sentences of CHAT_WORDS, saved in ``directory / "m"``."""
    import random

    from conftest import random_model

    from minigpt.checkpoint.native import save_pretrained
    from minigpt.tokenizer.tokenizer import train_tokenizer

    rng = random.Random(0)
    tok = train_tokenizer([" ".join(rng.choice(CHAT_WORDS) for _ in range(12)) for _ in range(200)], 300)
    model = random_model(dict(vocab_size=tok.vocab_size, **SERVED_MODEL), noise=0.5)
    return save_pretrained(model, directory / "m", tokenizer=tok)


def train_tiny_model(data_dir: Path, out: Path, steps: int = 200):
    """A TINY_MODEL-shaped model trained for ``steps`` AdamW steps on ``data_dir`` (a second or two): its greedy
    text varies like real text, and its logits have realistic gaps, unlike a random init's near-ties."""
    from minigpt.checkpoint.native import save_pretrained
    from minigpt.data.loader import BatchSampler, load_split
    from minigpt.model.config import ModelConfig
    from minigpt.model.transformer import Transformer
    from minigpt.tokenizer.tokenizer import Tokenizer

    torch.manual_seed(0)
    tok = Tokenizer.from_dir(data_dir)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, **SERVED_MODEL))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = BatchSampler(load_split(data_dir, "train"), 16, 64, seed=0)
    for _ in range(steps):
        x, y = batches.next()
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return save_pretrained(model, out, tokenizer=tok)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m minigpt serve CKPT` on a free loopback port, one torch thread; stopped with SIGTERM."""

    def __init__(self, ckpt: Path, *args: str, log: Optional[Path] = None, timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        out = open(log, "w") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minigpt", "serve", str(ckpt), "--port", str(self.port), "--threads", "1",
             "--log-level", "warning", *args],
            env=ENV, stdout=out, stderr=subprocess.STDOUT)
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"server not healthy after {timeout} s: {self.output()}")

    def output(self) -> str:
        return self.log.read_text() if self.log and self.log.exists() else ""

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def metrics(url: str) -> dict[str, float]:
    from minigpt.infer.metrics import parse_text

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse_text(r.read().decode())


class InProcessServer:
    """The app of :func:`minigpt.serve.app.create_app` under uvicorn in a thread of the test process."""

    def __init__(self, state, start_worker: bool = True) -> None:
        import threading

        import uvicorn

        from minigpt.serve.app import create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(state, start_worker=start_worker), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("in-process server did not start")
            time.sleep(0.05)

    @classmethod
    def for_model_dir(cls, path: Path) -> "InProcessServer":
        """A server of a random :data:`TINY_MODEL` with the tokenizer and chat template of the folder ``path``,
        one request at a time, one thread."""
        from minigpt.checkpoint.native import load_chat_template, load_tokenizer
        from minigpt.infer.engine import Engine
        from minigpt.serve.app import ServerState

        torch.set_num_threads(1)
        tok = load_tokenizer(path)
        model = random_model(TINY_MODEL, vocab_size=tok.vocab_size)
        return cls(ServerState(Engine(model, tok, max_batch_size=1), tok, "m", chat_template=load_chat_template(path)))

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        """``(status, JSON answer)`` of a JSON POST to ``path``."""
        import http.client
        import json

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()
