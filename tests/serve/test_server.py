"""`minigpt serve` as a real subprocess, driven by the official `openai` client (and raw HTTP for broken input)."""
import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from serve_helpers import ENV, InProcessServer, ServerProcess, metrics, train_tiny_model

openai = pytest.importorskip("openai", reason="the openai client is a dev extra: pip install -e '.[dev]'")

KEY = "test-key-123"


@pytest.fixture(scope="module")
def ckpt(tiny_data, tmp_path_factory):
    return train_tiny_model(tiny_data, tmp_path_factory.mktemp("served") / "shakespeare-tiny")


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    srv = ServerProcess(ckpt, "--api-key", KEY, "--max-batch-size", "8", "--max-queue", "64",
                        log=tmp_path_factory.mktemp("log") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(ckpt):
    """Greedy text of one prompt generated alone, in this process, with the library."""
    from minigpt.checkpoint.native import load_model
    from minigpt.infer.generate import generate_tokens
    from minigpt.infer.sampling import SamplingParams
    from minigpt.tokenizer.tokenizer import Tokenizer

    model = load_model(ckpt)
    tok = Tokenizer.from_dir(ckpt)

    def generate(prompt: str, max_tokens: int) -> str:
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        ids = generate_tokens(model, tok.encode(prompt), params, stop_ids=[tok.eos_id])
        return tok.decode(list(ids))

    return generate


def http(url, path, body=None, key=KEY, method=None, raw=None):
    """(status, parsed JSON or text) of one request; ``raw`` bytes are sent as they are."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"))
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["shakespeare-tiny"]
    assert client.models.retrieve("shakespeare-tiny").id == "shakespeare-tiny"  # the official client's retrieve
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert http(server.url, "/health", key=None) == (200, {"status": "ok"})
    status, text = http(server.url, "/metrics", key=None)
    assert status == 200
    for name in ("# TYPE minigpt_http_requests_total counter", "# TYPE minigpt_queue_depth gauge",
                 "# TYPE minigpt_running_batch_size gauge", "# TYPE minigpt_time_to_first_token_seconds histogram",
                 "# TYPE minigpt_time_per_output_token_seconds histogram", "minigpt_prompt_tokens_total",
                 "minigpt_generation_tokens_total"):
        assert name in text


def test_completion_equals_minigpt_generate(server, client, ckpt):
    prompt = "ROMEO:\nWhat light"
    proc = subprocess.run([sys.executable, "-m", "minigpt", "generate", str(ckpt), "--prompt", prompt,
                           "--max-new-tokens", "30", "--temperature", "0"], capture_output=True, text=True, env=ENV,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = client.completions.create(model="shakespeare-tiny", prompt=prompt, max_tokens=30, temperature=0)
    assert r.choices[0].text + "\n" == proc.stdout
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens <= 30
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_completion_matches_the_plain_answer(client):
    args = dict(model="shakespeare-tiny", prompt="JULIET:\nO", max_tokens=40, temperature=0)
    plain = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 3  # token by token, not in one piece
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_several_prompts_answer_as_each_alone_indexed_prompt_by_prompt(client):
    """OpenAI's batch form of ``prompt``: choice ``k * n + j`` is the ``j``-th choice of prompt ``k`` and equals
    what that prompt alone gets (seeded sampling included); usage counts every prompt once; streamed, each
    index's text equals the plain answer's."""
    prompts = ["ROMEO:\n", "JULIET:\nO", "KING:\n"]
    args = dict(model="shakespeare-tiny", max_tokens=12, temperature=0.8, seed=7, n=2)
    alone = [client.completions.create(prompt=p, **args) for p in prompts]
    batch = client.completions.create(prompt=prompts, **args)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [c.text for r in alone for c in r.choices]
    assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    assert batch.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone)
    ids = client.completions.create(prompt=[[5, 6, 7], "KING:\n"], **args)  # token ids and text mixed
    assert [c.text for c in ids.choices[2:]] == [c.text for c in alone[2].choices]
    chunks = list(client.completions.create(prompt=prompts, **args, stream=True,
                                            stream_options={"include_usage": True}))
    texts = ["" for _ in range(6)]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in batch.choices]
    assert chunks[-1].usage.prompt_tokens == batch.usage.prompt_tokens


def test_chat_plain_and_streaming(client, reference):
    messages = [{"role": "system", "content": "You speak verse."}, {"role": "user", "content": "Who goes there?"}]
    r = client.chat.completions.create(model="shakespeare-tiny", messages=messages, max_tokens=30, temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant"
    # The default template (no template ships with this model), and its implicit stop at the next "User:" line.
    expected = reference("System: You speak verse.\nUser: Who goes there?\nAssistant:", 30).split("\nUser:")[0]
    assert msg.content == expected
    stream = client.chat.completions.create(model="shakespeare-tiny", messages=messages, max_tokens=30,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_stop_strings_and_seeds(client):
    base = dict(model="shakespeare-tiny", prompt="KING:\n", max_tokens=40, temperature=0)
    full = client.completions.create(**base).choices[0].text
    stop = full[10:13]
    cut = client.completions.create(**base, stop=[stop, "zzzz"]).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
    sampled = dict(model="shakespeare-tiny", prompt="KING:\n", max_tokens=30, temperature=1.0, top_p=0.95,
                   extra_body={"top_k": 40})
    a = client.completions.create(**sampled, seed=7).choices[0].text
    b = client.completions.create(**sampled, seed=7).choices[0].text
    assert a == b


def test_32_concurrent_greedy_requests_each_equal_their_single_output(server, reference):
    lines = [line for line in _corpus_lines() if len(line) > 8][:32]
    jobs = [(lines[i][: 10 + (i * 7) % 60], 5 + (i * 11) % 50) for i in range(32)]
    expected = [reference(p, n) for p, n in jobs]
    before = metrics(server.url)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)

        async def one(i, prompt, n):
            if i % 2:  # half of them streamed
                stream = await aclient.completions.create(model="shakespeare-tiny", prompt=prompt, max_tokens=n,
                                                          temperature=0, stream=True)
                return "".join([c.choices[0].text async for c in stream if c.choices])
            r = await aclient.completions.create(model="shakespeare-tiny", prompt=prompt, max_tokens=n,
                                                 temperature=0)
            return r.choices[0].text

        try:
            return await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(jobs)))
        finally:
            await aclient.close()

    got = asyncio.run(run())
    assert len(got) == 32
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"request {i} ({jobs[i]!r}) differs from its single-request output"
    after = metrics(server.url)
    steps = after["minigpt_decode_batch_size_count"] - before["minigpt_decode_batch_size_count"]
    single = after['minigpt_decode_batch_size_bucket{le="1"}'] - before['minigpt_decode_batch_size_bucket{le="1"}']
    assert steps - single > 0, "no decode step ran more than one request"
    assert after["minigpt_kv_slots_used"] == 0


def _corpus_lines():
    from minigpt.data.sources import BUNDLED

    return BUNDLED["shakespeare"].path.read_text(encoding="utf-8")[100_000:110_000].splitlines()


def test_client_disconnect_cancels_the_generation(server, client):
    before = metrics(server.url)
    stream = client.completions.create(model="shakespeare-tiny", prompt="HAMLET:\n", max_tokens=480,
                                       temperature=0, stream=True)
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = metrics(server.url)
        cancelled = now.get('minigpt_requests_finished_total{reason="cancelled"}', 0) - before.get(
            'minigpt_requests_finished_total{reason="cancelled"}', 0)
        if cancelled >= 1 and now["minigpt_kv_slots_used"] == 0:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the slot was not freed: {now}")
    assert now["minigpt_generation_tokens_total"] - before["minigpt_generation_tokens_total"] < 480
    r = client.completions.create(model="shakespeare-tiny", prompt="HAMLET:\n", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


BAD = [
    # (body or raw bytes, endpoint, param named in the error)
    (b'{"prompt": "hi", ', "/v1/completions", None),
    (b"[1, 2, 3]", "/v1/completions", None),
    ({"prompt": "hi", "max_tokens": "5"}, "/v1/completions", "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "/v1/completions", "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, "/v1/completions", "max_tokens"),
    ({"prompt": "hi", "max_tokens": 512}, "/v1/completions", "max_tokens"),
    ({"prompt": "to be or not " * 80, "max_tokens": 100}, "/v1/completions", "max_tokens"),  # 482 + 100 > 512
    ({"prompt": "to be or not to be " * 200, "max_tokens": 1}, "/v1/completions", "prompt"),
    ({"prompt": "hi", "model": "gpt-4"}, "/v1/completions", "model"),
    ({"prompt": "hi", "n": 0}, "/v1/completions", "n"),
    ({"prompt": "hi", "logprobs": 30}, "/v1/completions", "logprobs"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "/v1/completions", "presence_penalty"),
    ({"prompt": "hi", "frobnicate": True}, "/v1/completions", "frobnicate"),
    ({"prompt": 42}, "/v1/completions", "prompt"),
    ({"prompt": ["one", 5]}, "/v1/completions", "prompt"),
    ({"prompt": [[1, 2], []]}, "/v1/completions", "prompt"),
    ({"prompt": ["one"] * 9, "n": 2}, "/v1/completions", "prompt"),  # 18 choices, over MAX_N
    ({"prompt": "hi", "temperature": "hot"}, "/v1/completions", "temperature"),
    ({"prompt": "hi", "temperature": 3}, "/v1/completions", "temperature"),
    ({"prompt": "hi", "top_p": 0}, "/v1/completions", "top_p"),
    ({"prompt": "hi", "stop": 5}, "/v1/completions", "stop"),
    ({"prompt": "hi", "seed": 1.5}, "/v1/completions", "seed"),
    ({"prompt": "hi", "stream": "yes"}, "/v1/completions", "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "/v1/completions", "stream_options"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": False, "stream_options": {}}, "/v1/chat/completions",
     "stream_options"),
    ({"max_tokens": 5}, "/v1/completions", "prompt"),
    ({"messages": "hi"}, "/v1/chat/completions", "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "/v1/chat/completions", "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "/v1/chat/completions", "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, "/v1/chat/completions", "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 300}, "/v1/chat/completions", "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "/v1/chat/completions",
     "max_completion_tokens"),
]


@pytest.mark.parametrize("body, path, param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_400_with_an_openai_error(server, body, path, param):
    raw = body if isinstance(body, bytes) else None
    status, answer = http(server.url, path, None if raw else body, raw=raw)
    assert status == 400, answer
    err = answer["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


def test_server_is_healthy_after_bad_input_and_errors_have_documented_statuses(server, client):
    assert http(server.url, "/v1/nothing")[0] == 404
    assert http(server.url, "/v1/completions", method="GET")[0] == 405
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="shakespeare-tiny", prompt="hi", max_tokens=10_000)
    assert e.value.body["param"] == "max_tokens"
    assert http(server.url, "/health", key=None) == (200, {"status": "ok"})
    r = client.completions.create(model="shakespeare-tiny", prompt="hi", max_tokens=3, temperature=0)
    assert r.choices[0].text is not None
    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
    assert 'minigpt_http_requests_total{endpoint="/v1/completions",status="400"}' in text


def test_api_key(server):
    body = {"prompt": "hi", "max_tokens": 2}
    for key in (None, "wrong-key"):
        status, answer = http(server.url, "/v1/completions", body, key=key)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        assert http(server.url, "/v1/models", key=key)[0] == 401
        assert http(server.url, "/v1/models/anything", key=key)[0] == 401
    assert http(server.url, "/v1/completions", body)[0] == 200
    assert http(server.url, "/v1/models")[0] == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_chat_page_is_served(server):
    with urllib.request.urlopen(server.url + "/") as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/html")
        page = r.read().decode()
    assert "<textarea" in page and "/v1/chat/completions" in page and "getReader" in page
    assert "http://" not in page and "https://" not in page  # nothing fetched from elsewhere (no CDN)


def test_terminal_chat_streams_and_resets(ckpt, client):
    proc = subprocess.run([sys.executable, "-m", "minigpt", "chat", str(ckpt), "--temperature", "0",
                           "--max-tokens", "12", "--threads", "1"], input="Good morrow\n/reset\nGood morrow\n/quit\n",
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "(conversation cleared)" in out and out.count("assistant> ") == 2
    answers = [part.split("\n")[0] for part in out.split("assistant> ")[1:]]
    assert answers[0] == answers[1]  # after /reset the same question gets the same greedy answer
    r = client.chat.completions.create(model="shakespeare-tiny", messages=[{"role": "user", "content": "Good morrow"}],
                                       max_tokens=12, temperature=0)
    assert answers[0] == r.choices[0].message.content.split("\n")[0]


@pytest.mark.slow
def test_sigterm_finishes_running_requests_then_exits(ckpt, tmp_path):
    srv = ServerProcess(ckpt, log=tmp_path / "log")
    body = json.dumps({"prompt": "HAMLET:\n", "max_tokens": 300, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(srv.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        first = r.readline()
        assert first.startswith(b"data: ")
        srv.proc.send_signal(signal.SIGTERM)
        rest = r.read().decode()
    assert rest.rstrip().endswith("data: [DONE]")
    events = [json.loads(line[6:]) for line in (first.decode() + rest).splitlines()
              if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert srv.proc.wait(timeout=60) == 0, srv.output()


def test_full_queue_gets_429_and_timeouts_get_504(ckpt):
    """In-process, with the worker held back so the queue fills deterministically."""
    import threading

    from minigpt.checkpoint.native import load_model
    from minigpt.infer.engine import Engine
    from minigpt.serve.app import ServerState
    from minigpt.tokenizer.tokenizer import Tokenizer

    torch.set_num_threads(1)
    model, tok = load_model(ckpt), Tokenizer.from_dir(ckpt)
    engine = Engine(model, tok, max_batch_size=1, max_queue=2)
    srv = InProcessServer(ServerState(engine, tok, "m"), start_worker=False)
    try:
        results = []
        body = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
        waiting = [threading.Thread(target=lambda: results.append(http(srv.url, "/v1/completions", body, key=None)))
                   for _ in range(2)]
        for t in waiting:
            t.start()
        deadline = time.monotonic() + 30
        while engine.metrics.queue_depth.value() < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        status, answer = http(srv.url, "/v1/completions", body, key=None)
        assert status == 429 and answer["error"]["code"] == "queue_full"
        engine.start()
        for t in waiting:
            t.join(timeout=60)
        assert [s for s, _ in results] == [200, 200]
    finally:
        srv.stop()
    engine = Engine(model, tok, max_batch_size=1)
    srv = InProcessServer(ServerState(engine, tok, "m", request_timeout=1e-9))
    try:
        status, answer = http(srv.url, "/v1/completions", {"prompt": "hi", "max_tokens": 50}, key=None)
        assert status == 504 and answer["error"]["code"] == "timeout"
        status, text = http(srv.url, "/v1/completions", {"prompt": "hi", "max_tokens": 50, "stream": True}, key=None)
        assert status == 200 and '"code":"timeout"' in text and text.rstrip().endswith("data: [DONE]")
    finally:
        srv.stop()


def test_busy_port_is_one_error_line(ckpt):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "minigpt", "serve", str(ckpt), "--port", str(port)],
                              capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"]
