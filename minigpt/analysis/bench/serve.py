"""``minigpt bench serve``: aggregate generated tokens/s of ``minigpt serve`` under 1, 4, 16, 32 concurrent streaming
clients versus the same requests sent one after another, and time to first token (TTFT).

For each concurrency ``c`` the benchmark sends ``c * rounds`` greedy streaming chat-less completions (distinct
prompts cut from the bundled Tiny Shakespeare, every request the same ``max_tokens``): first one after another,
then from ``c`` clients at once, each client sending its next request when the previous one ends. Aggregate
tokens/s = generated tokens (from the streamed ``usage``) / wall-clock seconds from the first request sent to the
last one finished. TTFT = seconds from sending a request to receiving its first non-empty text chunk.

The client is a small asyncio HTTP/1.1 reader of Server-Sent Events (no client library), so it costs little CPU on
the machine it shares with the server. Without ``--url`` the server is started as a subprocess on a free loopback
port, from ``CKPT`` or, without one, from a random-initialised ``--preset`` model with a byte-level BPE trained on
the corpus slice (said so in the output: its text is noise, its speed is that of a trained model of that shape).
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse
from urllib.request import urlopen

import torch

from minigpt.checkpoint.native import save_pretrained
from minigpt.data.sources import BUNDLED
from minigpt.errors import MiniGPTError
from minigpt.model.config import preset as preset_config
from minigpt.model.transformer import Transformer
from minigpt.tokenizer.tokenizer import train_tokenizer


@dataclass
class Result:
    """One request's outcome: ``ttft`` seconds (None if no text came), ``tokens`` generated."""

    ttft: Optional[float]
    tokens: int
    status: int
    error: str = ""


@dataclass
class Level:
    """Numbers for one concurrency: tokens/s, TTFT percentiles in seconds."""

    clients: int
    requests: int
    seq_tokens_per_s: float
    conc_tokens_per_s: float
    seq_ttft_p50: float
    conc_ttft_p50: float
    conc_ttft_p95: float
    failures: int = 0
    speedup: float = field(init=False)

    def __post_init__(self) -> None:
        self.speedup = self.conc_tokens_per_s / self.seq_tokens_per_s if self.seq_tokens_per_s else float("nan")


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation between closest ranks; NaN for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


async def stream_completion(host: str, port: int, body: dict, api_key: Optional[str] = None,
                            path: str = "/v1/completions") -> Result:
    """POST one streaming request and read its SSE stream to the end."""
    payload = json.dumps(body).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\nConnection: close\r\n")
        if api_key:
            head += f"Authorization: Bearer {api_key}\r\n"
        writer.write(head.encode() + b"\r\n" + payload)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        chunked = False
        while True:
            line = (await reader.readline()).strip()
            if not line:
                break
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "transfer-encoding" and "chunked" in value.lower():
                chunked = True
        if status != 200:
            return Result(None, 0, status, (await reader.read()).decode("utf-8", "replace")[:200])
        ttft, tokens, buf = None, 0, b""
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                data = await reader.readexactly(size)
                await reader.readline()
            else:
                data = await reader.read(65536)
                if not data:
                    break
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                obj = json.loads(event[6:])
                if "error" in obj:
                    return Result(ttft, tokens, status, obj["error"].get("message", ""))
                if obj.get("usage"):
                    tokens = obj["usage"]["completion_tokens"]
                if ttft is None and obj.get("choices") and obj["choices"][0].get("text"):
                    ttft = time.perf_counter() - start
        return Result(ttft, tokens, status)
    finally:
        writer.close()


async def run_level(host: str, port: int, bodies: list[dict], clients: int, api_key: Optional[str]
                    ) -> tuple[float, list[Result]]:
    """Send ``bodies`` from ``clients`` concurrent clients; returns (wall seconds, results in order)."""
    results: list[Optional[Result]] = [None] * len(bodies)
    next_index = iter(range(len(bodies)))

    async def client() -> None:
        for i in next_index:
            results[i] = await stream_completion(host, port, bodies[i], api_key)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - start, results  # type: ignore[return-value]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: Optional[subprocess.Popen], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise MiniGPTError(f"the server exited with status {proc.returncode} before becoming healthy")
        try:
            with urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise MiniGPTError(f"the server at {url} did not become healthy within {timeout:.0f} s")


def random_model(preset: str, directory: Path, corpus_text: str, vocab_size: int = 4096) -> Path:
    """Save a random-initialised ``preset`` model with a BPE trained on ``corpus_text`` into ``directory``."""


    tok = train_tokenizer([corpus_text], vocab_size)
    torch.manual_seed(0)
    model = Transformer(preset_config(preset, vocab_size=tok.vocab_size)).eval()
    return save_pretrained(model, directory / f"random-{preset}", tokenizer=tok)


def make_prompts(text: str, n: int, words: int = 24) -> list[str]:
    """``n`` distinct prompts of about ``words`` words, cut from consecutive stretches of ``text``."""
    tokens = text.split()
    step = max(1, (len(tokens) - words) // max(1, n))
    return [" ".join(tokens[i * step:i * step + words]) for i in range(n)]


def bench_serve(source: Optional[str] = None, preset: str = "small", url: Optional[str] = None,
                clients: tuple[int, ...] = (1, 4, 16, 32), rounds: int = 2, max_tokens: int = 64,
                prompt_words: int = 24, api_key: Optional[str] = None, threads: Optional[int] = None,
                max_batch_size: Optional[int] = None, repeats: int = 1, compile: int = 0,
                out=sys.stdout) -> list[Level]:
    """Run the benchmark (see the module docstring) and print a markdown table; returns the rows.

    With ``repeats`` > 1 each level is measured that many times (sequential and concurrent alternating) and the
    table shows medians of tokens/s and of the TTFT percentiles. ``compile``: start the server with ``--compile``,
    more than 1 with ``--compile-batch`` that many (its start-up waits for the compiled steps).
    """

    corpus = BUNDLED["shakespeare"].path.read_text(encoding="utf-8")
    n_max = max(clients) * rounds
    prompts = make_prompts(corpus[200_000:], n_max, prompt_words)
    proc = None
    tmp = None
    try:
        if url is None:
            tmp = tempfile.TemporaryDirectory(prefix="minigpt-bench-")
            if source is None:
                out.write(f"model: random-init `{preset}` preset (no trained checkpoint given: generated text is "
                          "noise; speed is that of the shape), BPE trained on 200 kB of Tiny Shakespeare\n")
                source = str(random_model(preset, Path(tmp.name), corpus[:200_000]))
            else:
                out.write(f"model: {source}\n")
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "minigpt", "serve", source, "--port", str(port), "--log-level", "warning",
                   "--max-batch-size", str(max_batch_size or max(clients)), "--max-queue", str(4 * n_max)]
            env = dict(os.environ)
            if threads:
                cmd += ["--threads", str(threads)]
            if compile:
                cmd += ["--compile"] + (["--compile-batch", str(int(compile))] if compile > 1 else [])
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
            _wait_healthy(url, proc, timeout=1800.0 if compile else 300.0)
        else:
            _wait_healthy(url, None, timeout=10)
        parsed = urlparse(url)
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
        body = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        # Warm-up: first calls pay for lazy initialisation in torch and the server.
        asyncio.run(run_level(host, port, [{**body, "prompt": p} for p in prompts[:2]], 2, api_key))
        out.write(f"{rounds} request(s) per client, {max_tokens} new tokens each (greedy), prompts of "
                  f"{prompt_words} words, {'median of ' + str(repeats) + ' runs' if repeats > 1 else '1 run'}\n\n")
        out.write("| clients | requests | sequential tok/s | concurrent tok/s | speed-up | TTFT p50 seq (s) "
                  "| TTFT p50 conc (s) | TTFT p95 conc (s) |\n|---|---|---|---|---|---|---|---|\n")
        levels = []
        for c in clients:
            bodies = [{**body, "prompt": p} for p in prompts[:c * rounds]]
            runs, bad = [], []
            for _ in range(repeats):
                seq_s, seq = asyncio.run(run_level(host, port, bodies, 1, api_key))
                conc_s, conc = asyncio.run(run_level(host, port, bodies, c, api_key))
                bad += [r for r in seq + conc if r.status != 200 or r.error]
                seq_t = [r.ttft for r in seq if r.ttft is not None]
                conc_t = [r.ttft for r in conc if r.ttft is not None]
                runs.append((sum(r.tokens for r in seq) / seq_s, sum(r.tokens for r in conc) / conc_s,
                             percentile(seq_t, 0.5), percentile(conc_t, 0.5), percentile(conc_t, 0.95)))
            level = Level(c, len(bodies), *(median([r[i] for r in runs]) for i in range(5)), failures=len(bad))
            levels.append(level)
            out.write(f"| {c} | {len(bodies)} | {level.seq_tokens_per_s:.1f} | {level.conc_tokens_per_s:.1f} | "
                      f"{level.speedup:.2f}x | {level.seq_ttft_p50:.3f} | {level.conc_ttft_p50:.3f} | "
                      f"{level.conc_ttft_p95:.3f} |\n")
            out.flush()
            if bad:
                out.write(f"  {len(bad)} request(s) failed, e.g. status {bad[0].status}: {bad[0].error}\n")
        return levels
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        if tmp is not None:
            tmp.cleanup()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
