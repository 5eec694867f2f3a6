"""`minigpt serve` against hostile input (issue 21): every malformed request is a 4xx with OpenAI's error body, the
body is capped and declared JSON, the work runs off the event loop, a client that leaves cancels its generation,
and sampling never turns tiny temperatures into NaN. In-process, on a tiny random model."""
import http.client
import json
import signal
import socket
import threading
import time

import pytest
import torch
from conftest import TINY_MODEL, assert_one_line_error, random_model, run_cli
from serve_helpers import InProcessServer, ServerProcess, train_tiny_model

from minigpt.serve.schemas import CHAT_FIELDS, COMPLETION_FIELDS, MAX_JSON_DEPTH

BODY_LIMIT = 256 * 1024  # room for the 200 kB of a 100,000-deep nesting, which must be refused for its depth
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def served(tiny_data):
    from minigpt.infer.engine import Engine
    from minigpt.serve.app import ServerState
    from minigpt.tokenizer.tokenizer import Tokenizer

    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(tiny_data)
    model = random_model(TINY_MODEL, vocab_size=tok.vocab_size, max_seq_len=256)
    engine = Engine(model, tok, max_batch_size=4)
    state = ServerState(engine, tok, "tiny", max_body_bytes=BODY_LIMIT)
    srv = InProcessServer(state)
    srv.state, srv.engine = state, engine
    yield srv
    srv.stop()


def post(srv, path, body=None, raw=None, content_type="application/json", headers=None, chunked=False):
    """(status, parsed JSON or text) of one POST; ``raw`` bytes go as they are, in 1 kB chunks when ``chunked``."""
    data = raw if raw is not None else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    head = dict(headers or {})
    if content_type is not None:
        head["Content-Type"] = content_type
    if chunked:
        head["Transfer-Encoding"] = "chunked"
        conn.request("POST", path, body=(data[i:i + 1024] for i in range(0, len(data), 1024)), headers=head,
                     encode_chunked=True)
    else:
        conn.request("POST", path, body=data, headers=head)
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    try:
        return r.status, json.loads(text)
    except json.JSONDecodeError:
        return r.status, text


def assert_error(status, answer, expected_status, param="any"):
    assert status == expected_status, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert answer["error"]["message"] and answer["error"]["type"] == "invalid_request_error"
    if param != "any":
        assert answer["error"]["param"] == param, answer


def _raw(text: str) -> bytes:
    return text.encode("utf-8")


DIGITS = "9" * 5000
MALFORMED = [
    # (raw body, endpoint, param named)
    (_raw('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"), "/v1/completions", None),
    (_raw('{"prompt": "hi", "x": ' + "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1) + "}"),
     "/v1/completions", None),
    (_raw('{"prompt": "hi", "max_tokens": ' + DIGITS + "}"), "/v1/completions", None),
    (_raw('{"prompt": "hi", "seed": -' + DIGITS + "}"), "/v1/completions", None),
    (_raw('{"prompt": "hi", "top_k": ' + DIGITS + "}"), "/v1/completions", None),
    (_raw('{"prompt": "hi", "temperature": 0.' + DIGITS + "}"), "/v1/completions", None),
    (_raw('{"prompt": "hi", "temperature": NaN}'), "/v1/completions", None),
    (_raw('{"prompt": "hi", "user": Infinity}'), "/v1/completions", None),
    (_raw('{"prompt": "hi", "temperature": 1e400}'), "/v1/completions", "temperature"),  # parses as inf
    (_raw('{"prompt": "\\ud800"}'), "/v1/completions", "prompt"),
    (_raw('{"prompt": ["a\\udfffb"]}'), "/v1/completions", "prompt[0]"),
    (_raw('{"prompt": "hi", "model": "m\\ud800"}'), "/v1/completions", "model"),
    (_raw('{"prompt": "hi", "\\ud800": 1}'), "/v1/completions", "\\ud800"),  # the name, escaped
    (_raw('{"messages": [{"role": "user", "content": "\\udc00"}]}'), "/v1/chat/completions",
     "messages[0].content"),
    (_raw('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'),
     "/v1/chat/completions", "messages[0].content[0].text"),
    (b'{"prompt": "caf\xe9"}', "/v1/completions", None),  # Latin-1, not UTF-8
    (b'{"prompt": "\xed\xa0\x80"}', "/v1/completions", None),  # a surrogate encoded in UTF-8 bytes
]


@pytest.mark.parametrize("raw, path, param", MALFORMED, ids=[f"{i}" for i in range(len(MALFORMED))])
def test_malformed_json_is_a_400_not_a_500(served, raw, path, param):
    status, answer = post(served, path, raw=raw)
    assert_error(status, answer, 400, param)
    assert post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200  # still serving


@pytest.mark.parametrize("field, value", [
    ("user", 5), ("user", True), ("user", ["a"]), ("user", {"id": "a"}), ("model", 5),
    ("top_k", -2), ("max_tokens", 10**30), ("n", 0), ("n", 17), ("n", True), ("logprobs", 21), ("logprobs", "1"),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.5), ("presence_penalty", "1"), ("repetition_penalty", 0),
    ("repetition_penalty", -1), ("min_p", 1.5), ("min_p", -0.1), ("logit_bias", {"5": 101}),
    ("logit_bias", {"x": 1}), ("logit_bias", {"100000": 1}), ("logit_bias", [1]), ("stop_token_ids", [-1]),
    ("stop_token_ids", [10**6]), ("stop_token_ids", "1"), ("top_logprobs", 21), ("seed", "1"),
    ("top_p", 0), ("temperature", 2.5),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_out_of_range_fields_are_a_400_naming_them(served, path, field, value):
    body = {"prompt": "hi", "max_tokens": 2} if path == "/v1/completions" else dict(CHAT)
    status, answer = post(served, path, {**body, field: value})
    assert_error(status, answer, 400, field)


def test_chat_message_name_must_be_a_string(served):
    status, answer = post(served, "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "hi", "name": 3}]})
    assert_error(status, answer, 400, "messages[0].name")


@pytest.mark.parametrize("params", [{"temperature": 1e-40}, {"temperature": 5e-324}, {"top_p": 5e-324},
                                    {"temperature": 5e-324, "top_p": 5e-324, "top_k": 1}])
def test_tiny_temperature_and_top_p_generate_greedily_without_nan(served, params):
    body = {"prompt": "The king", "max_tokens": 8, "seed": 1}
    status, greedy = post(served, "/v1/completions", {**body, "temperature": 0})
    assert status == 200
    status, answer = post(served, "/v1/completions", {**body, **params})
    assert status == 200, answer
    assert answer["choices"][0]["text"] == greedy["choices"][0]["text"]
    status, text = post(served, "/v1/completions", {**body, **params, "stream": True})
    assert status == 200 and '"error"' not in text and text.rstrip().endswith("data: [DONE]"), text


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None, "application/json; charset=latin-1"])
def test_bodies_not_declared_json_get_415(served, content_type):
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}), ("/v1/chat/completions", CHAT)):
        status, answer = post(served, path, body, content_type=content_type)
        assert_error(status, answer, 415, None)
        assert answer["error"]["code"] == "unsupported_media_type"
    assert post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                content_type="application/json; charset=utf-8")[0] == 200


@pytest.mark.parametrize("chunked", [False, True])
def test_bodies_over_the_limit_get_413_before_parsing(served, chunked, monkeypatch):
    calls = []
    monkeypatch.setattr(served.state, "prepare_completion", lambda raw: calls.append(raw))
    big = json.dumps({"prompt": "x" * (BODY_LIMIT + 10)}).encode()
    status, answer = post(served, "/v1/completions", raw=big, chunked=chunked)
    assert_error(status, answer, 413, None)
    assert answer["error"]["code"] == "request_too_large" and calls == []


def test_stop_strings_are_capped_in_number_and_length(served):
    body = {"prompt": "hi", "max_tokens": 2}
    assert_error(*post(served, "/v1/completions", {**body, "stop": [str(i) for i in range(17)]}), 400, "stop")
    assert_error(*post(served, "/v1/completions", {**body, "stop": ["y" * 65] * 16}), 400, "stop")  # 1,040 chars
    assert post(served, "/v1/completions", {**body, "stop": ["y" * 64] * 16})[0] == 200  # 1,024 chars


def test_parsing_and_tokenization_run_off_the_event_loop(served, monkeypatch):
    seen = []
    tok = served.state.tokenizer
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **k: seen.append(threading.current_thread().name) or encode(*a, **k))
    chat_prompt = served.state.chat.prompt
    monkeypatch.setattr(served.state.chat, "prompt",
                        lambda *a, **k: seen.append(threading.current_thread().name) or chat_prompt(*a, **k))
    assert post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200
    assert post(served, "/v1/chat/completions", CHAT)[0] == 200
    assert len(seen) >= 2
    assert all(name.startswith("minigpt-prepare") for name in seen), seen
    assert served.thread.name not in seen  # not the thread running uvicorn's event loop


def test_a_prompt_far_beyond_the_context_is_refused_without_tokenizing_it_all(served, monkeypatch):
    """Tokenizers hold the GIL: a 200 kB prompt tokenized in full would stall every other request for a while."""
    lengths = []
    tok = served.state.tokenizer
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **k: lengths.append(len(text)) or encode(text, *a, **k))
    text = "to be or not to be " * 10_000
    assert_error(*post(served, "/v1/completions", {"prompt": text}), 400, "prompt")
    assert_error(*post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}), 400,
                 "messages")
    assert lengths and max(lengths) <= 8 * served.engine.max_seq_len


def test_non_streaming_client_disconnect_cancels_the_generation(served, monkeypatch):
    engine = served.engine
    decode = engine._decode_forward

    def slow(*args):  # 20 ms a step: the generation outlives the client by far
        time.sleep(0.02)
        return decode(*args)

    monkeypatch.setattr(engine, "_decode_forward", slow)
    m = engine.metrics
    cancelled = m.finished.value(reason="cancelled")
    generated = m.generation_tokens.value()
    body = json.dumps({"prompt": "hi", "max_tokens": 200, "temperature": 0}).encode()
    sock = socket.create_connection(("127.0.0.1", served.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 30
    while m.generation_tokens.value() - generated < 3:
        assert time.monotonic() < deadline, "the generation did not start"
        time.sleep(0.01)
    sock.close()
    while m.finished.value(reason="cancelled") == cancelled or m.slots_used.value() != 0:
        assert time.monotonic() < deadline, "the slot was not freed after the client left"
        time.sleep(0.01)
    assert m.generation_tokens.value() - generated < 100


def test_openapi_document_lists_the_accepted_fields(served):
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    conn.request("GET", "/openapi.json")
    r = conn.getresponse()
    doc = json.loads(r.read())
    assert r.status == 200
    schemas = doc["components"]["schemas"]
    assert set(schemas["CompletionRequest"]["properties"]) == COMPLETION_FIELDS
    assert set(schemas["ChatCompletionRequest"]["properties"]) == CHAT_FIELDS
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(doc["paths"])
    responses = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "413", "415"} <= set(responses)


@pytest.fixture(scope="module")
def ckpt(tiny_data, tmp_path_factory):
    return train_tiny_model(tiny_data, tmp_path_factory.mktemp("served") / "tiny")


@pytest.mark.slow
def test_serve_flags_cap_context_and_body_and_sigterm_ends_streams_with_an_error(ckpt, tmp_path):
    """`--context` sizes the KV cache (reported at start-up), `--max-body-bytes` caps bodies, and SIGTERM past
    `--shutdown-timeout` ends each stream still running with an error event and [DONE], then exits 0."""
    srv = ServerProcess(ckpt, "--context", "480", "--max-body-bytes", "4096", "--shutdown-timeout", "0",
                        "--max-batch-size", "8", log=tmp_path / "log")
    try:
        assert "KV cache: 8 slots x 480 tokens" in srv.output()
        url = srv.url.replace("http://", "")
        status, answer = post_to(url, {"prompt": "KING:", "max_tokens": 480})
        assert_error(status, answer, 400, "max_tokens")
        status, answer = post_to(url, {"prompt": "x" * 5000})
        assert_error(status, answer, 413, None)

        first_lines, rests, started = [], [None] * 8, threading.Barrier(9)
        body = json.dumps({"prompt": "HAMLET:\n", "max_tokens": 470, "temperature": 0, "stream": True}).encode()

        def stream(i):
            conn = http.client.HTTPConnection(url, timeout=120)
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            first_lines.append(r.readline())
            started.wait()
            rests[i] = r.read().decode()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        started.wait(timeout=120)
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=120)
        assert srv.proc.wait(timeout=60) == 0, srv.output()
    finally:
        srv.stop()
    assert all(line.startswith(b"data: ") for line in first_lines)
    assert all(rest is not None and rest.rstrip().endswith("data: [DONE]") for rest in rests), rests
    cut = [rest for rest in rests if '"code":"cancelled"' in rest]
    assert cut, "no stream was still running at SIGTERM"
    for rest in cut:
        events = [line for line in rest.splitlines() if line.startswith("data: ")]
        assert json.loads(events[-2][6:])["error"]["code"] == "cancelled"


def post_to(hostport, body):
    conn = http.client.HTTPConnection(hostport, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


@pytest.mark.slow
def test_context_flag_of_generate_and_chat(ckpt):
    """`--context` caps prompt + new tokens in `generate` and the conversation in `chat` (reported at start)."""
    proc = run_cli("generate", ckpt, "--prompt", "KING:", "--max-new-tokens", "20", "--context", "16")
    assert_one_line_error(proc, "context of 16 tokens")
    assert_one_line_error(run_cli("generate", ckpt, "--prompt", "KING:", "--context", "513"), "context of 512")
    proc = run_cli("generate", ckpt, "--prompt", "to be or not to be " * 5, "--max-new-tokens", "10", "--context",
                   "16", "--truncate-prompt", "--temperature", "0")  # the prompt's oldest tokens make room
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("chat", ckpt, "--context", "24", "--max-tokens", "4", "--temperature", "0",
                   stdin="Good morrow\n" + "to be or not to be " * 10 + "\n/quit\n")
    assert proc.returncode == 0, proc.stderr
    assert "(24-token context)" in proc.stdout and "the context is 24" in proc.stdout
    assert_one_line_error(run_cli("chat", ckpt, "--context", "1"), "--context must be at least 2")
