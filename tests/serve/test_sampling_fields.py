"""The sampling and scoring fields of /v1/completions and /v1/chat/completions: logprobs and echo in OpenAI's
shapes (checked by the official `openai` client's types and by the server's own /openapi.json), echo's prompt
scores against the model, n choices, seeds under concurrent load, logit_bias and stop_token_ids, bad values."""
import json
import threading

import pytest
import torch
from conftest import TINY_MODEL, random_model
from serve_helpers import InProcessServer
from test_hardening import assert_error, post

CHAT = [{"role": "user", "content": "Good morrow"}]


@pytest.fixture(scope="module")
def served(tiny_data):
    from minigpt.infer.engine import Engine
    from minigpt.serve.app import ServerState
    from minigpt.tokenizer.tokenizer import Tokenizer

    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(tiny_data)
    model = random_model(TINY_MODEL, vocab_size=tok.vocab_size, max_seq_len=256, noise=0.3)
    srv = InProcessServer(ServerState(Engine(model, tok, max_batch_size=4), tok, "tiny"))
    srv.model, srv.tok = model, tok
    yield srv
    srv.stop()


def ok(srv, path, body):
    status, answer = post(srv, path, body)
    assert status == 200, answer
    return answer


def stream(srv, path, body) -> list[dict]:
    status, text = post(srv, path, {**body, "stream": True})
    assert status == 200, text
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def model_logprobs(srv, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(srv.model(torch.tensor([ids]))[0].float(), dim=-1)


@pytest.mark.parametrize("as_ids", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt_like_the_model(served, as_ids):
    """What lm-evaluation-harness's local-completions sends to score log-likelihoods (token ids, a batch of one):
    the prompt back with one logprob per token, the first null, equal to the model's within 1e-5."""
    text = "ROMEO: But soft, what light"
    ids = served.tok.encode(text)
    answer = ok(served, "/v1/completions", {"prompt": [ids] if as_ids else text, "max_tokens": 0, "echo": True,
                                             "logprobs": 1, "temperature": 0})
    choice = answer["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == text
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = model_logprobs(served, ids)
    for t in range(1, len(ids)):
        assert lp["token_logprobs"][t] == pytest.approx(float(expected[t - 1, ids[t]]), abs=1e-5)
        top = lp["top_logprobs"][t]  # the most likely token and the actual one
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(float(expected[t - 1].max()), abs=1e-5)
        assert top[lp["tokens"][t]] == lp["token_logprobs"][t]
    assert lp["text_offset"] == [sum(len(s) for s in lp["tokens"][:i]) for i in range(len(ids))]


def test_completion_logprobs_of_generated_tokens_and_echo(served):
    body = {"prompt": "KING:", "max_tokens": 6, "temperature": 0, "logprobs": 3}
    plain = ok(served, "/v1/completions", body)["choices"][0]
    lp = plain["logprobs"]
    assert len(lp["tokens"]) == 6
    if not any(t.startswith("bytes:") for t in lp["tokens"]):  # (part of a character shows as its bytes)
        assert "".join(lp["tokens"]) == plain["text"]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert 3 <= len(top) <= 4 and top[token] == logprob and logprob == max(top.values())  # greedy: the top
    echoed = ok(served, "/v1/completions", {**body, "echo": True})["choices"][0]
    assert echoed["text"] == "KING:" + plain["text"]
    n_prompt = len(served.tok.encode("KING:"))
    # (the same to float rounding: an echo request is prefilled whole, the plain one may start from cached blocks)
    assert echoed["logprobs"]["token_logprobs"][n_prompt:] == pytest.approx(lp["token_logprobs"], abs=1e-5)
    assert echoed["logprobs"]["text_offset"][n_prompt] == len("KING:")
    assert ok(served, "/v1/completions", {**body, "logprobs": None})["choices"][0]["logprobs"] is None
    # Streamed: the same tokens and logprobs, chunk by chunk, with cumulative text offsets.
    chunks = [c["choices"][0] for c in stream(served, "/v1/completions", {**body, "echo": True})]
    assert "".join(c["text"] for c in chunks) == echoed["text"]
    streamed = [c["logprobs"] for c in chunks if c["logprobs"]]
    for key in ("tokens", "text_offset"):
        assert [x for part in streamed for x in part[key]] == echoed["logprobs"][key]
    assert [x for part in streamed for x in part["token_logprobs"]] == pytest.approx(
        echoed["logprobs"]["token_logprobs"], abs=1e-5, nan_ok=True)


def test_chat_logprobs_shape(served):
    answer = ok(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "temperature": 0,
                                                  "logprobs": True, "top_logprobs": 2})
    choice = answer["choices"][0]
    content = choice["logprobs"]["content"]
    assert set(choice["logprobs"]) == {"content"} and len(content) == answer["usage"]["completion_tokens"]
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"} and item["logprob"] <= 0
        assert all(isinstance(b, int) and 0 <= b < 256 for b in item["bytes"])
        assert len(item["top_logprobs"]) == 2 and item["top_logprobs"][0]["logprob"] == item["logprob"]
        assert all(set(t) == {"token", "logprob", "bytes"} for t in item["top_logprobs"])
    without = ok(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
    assert without["choices"][0]["logprobs"] is None
    chunks = stream(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "temperature": 0,
                                                      "logprobs": True})
    items = [i for c in chunks for i in (c["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert [i["logprob"] for i in items] == [i["logprob"] for i in content]
    assert all(i["top_logprobs"] == [] for i in items)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_choices_plain_and_streamed(served, path):
    """n choices sample with seed, seed + 1, ...: choice i equals the n=1 request seeded seed + i; the prompt is
    counted once in the usage; streamed chunks carry one choice each with its index."""
    base = {"prompt": "To be"} if path == "/v1/completions" else {"messages": CHAT}
    body = {**base, "max_tokens": 8, "temperature": 1.0, "seed": 7}
    answer = ok(served, path, {**body, "n": 3})
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    singles = [ok(served, path, {**body, "seed": 7 + i}) for i in range(3)]

    def text(choice):
        return choice["text"] if "text" in choice else choice["message"]["content"]

    assert [text(c) for c in answer["choices"]] == [text(s["choices"][0]) for s in singles]
    assert len({text(c) for c in answer["choices"]}) > 1
    usage = answer["usage"]
    assert usage["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    chunks = stream(served, path, {**body, "n": 3, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"] == usage and chunks[-1]["choices"] == []
    texts, finishes = ["", "", ""], [0, 0, 0]
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["text"] if "text" in choice else choice["delta"].get("content") or ""
        finishes[choice["index"]] += choice["finish_reason"] is not None
    assert texts == [text(c) for c in answer["choices"]] and finishes == [1, 1, 1]


def test_seed_gives_the_same_output_alone_and_under_concurrent_load(served):
    body = {"prompt": "HAMLET:", "max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 1234,
            "frequency_penalty": 0.4, "logprobs": 1}
    alone = ok(served, "/v1/completions", body)["choices"][0]
    results, errors = {}, []

    def send(i):
        try:
            other = {"prompt": "x" * (i + 1), "max_tokens": 4 + 3 * i, "temperature": 1.0}
            results[i] = ok(served, "/v1/completions", body if i % 3 == 0 else other)
        except Exception as e:  # reported below: an assert in a thread would be lost
            errors.append(e)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in (0, 3, 6):  # the same tokens; their logprobs to float rounding (batched rows sum in another order)
        got = results[i]["choices"][0]
        assert got["text"] == alone["text"] and got["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(alone["logprobs"]["token_logprobs"], abs=1e-4)
    other_seed = ok(served, "/v1/completions", {**body, "seed": 1235})["choices"][0]
    assert other_seed["text"] != alone["text"]


def test_logit_bias_penalties_and_stop_token_ids(served):
    tok = served.tok
    forced = tok.encode(" the")[-1]
    body = {"prompt": "KING:", "max_tokens": 5, "temperature": 1.0, "seed": 0}
    answer = ok(served, "/v1/completions", {**body, "logit_bias": {str(forced): 100}})
    assert answer["choices"][0]["text"] == tok.decode([forced] * 5)
    greedy = ok(served, "/v1/completions", {**body, "temperature": 0, "logprobs": 0})["choices"][0]
    first = tok.encode(greedy["logprobs"]["tokens"][0])[-1]
    banned = ok(served, "/v1/completions", {**body, "temperature": 0, "logit_bias": {str(first): -100}})
    assert not banned["choices"][0]["text"].startswith(greedy["logprobs"]["tokens"][0])
    stopped = ok(served, "/v1/completions", {**body, "logit_bias": {str(forced): 100}, "stop_token_ids": [forced]})
    assert stopped["choices"][0]["text"] == "" and stopped["choices"][0]["finish_reason"] == "stop"
    # lm-eval's scoring request (max_tokens 1) ending at a stop id: its logprob is still the last entry.
    scored = ok(served, "/v1/completions", {"prompt": "KING:", "max_tokens": 1, "echo": True, "logprobs": 1,
                                            "temperature": 0, "logit_bias": {str(forced): 100},
                                            "stop_token_ids": [forced]})["choices"][0]
    n_prompt = len(tok.encode("KING:"))
    assert scored["text"] == "KING:" and scored["finish_reason"] == "stop"
    assert len(scored["logprobs"]["token_logprobs"]) == n_prompt + 1
    assert scored["logprobs"]["tokens"][-1] == tok.decode([forced])
    chat = ok(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0.5,
                                                "logit_bias": {str(forced): 100}, "min_p": 0.5,
                                                "repetition_penalty": 1.2})
    assert chat["choices"][0]["message"]["content"].startswith(tok.decode([forced]))


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0, "echo": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 1} | {str(i): 1 for i in range(301)}}, "logit_bias"),
])
def test_field_rules_per_endpoint_are_400s_naming_the_field(served, path, body, param):
    status, answer = post(served, path, body)
    assert_error(status, answer, 400, param)


def test_the_openai_client_reads_the_new_fields(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    r = client.completions.create(model="tiny", prompt="KING:", max_tokens=3, logprobs=2, echo=True, n=2, seed=5,
                                  presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"7": 1.5},
                                  extra_body={"repetition_penalty": 1.1, "min_p": 0.01, "stop_token_ids": [0]})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.text.startswith("KING:") and c.logprobs.token_logprobs[0] is None for c in r.choices)
    c = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2,
                                       n=2, seed=5)
    assert len(c.choices) == 2
    for choice in c.choices:
        entry = choice.logprobs.content[0]
        assert isinstance(entry.token, str) and len(entry.top_logprobs) == 2 and entry.bytes is not None
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, logprobs=True,
                                                 top_logprobs=1, n=2, stream=True))
    assert {ch.choices[0].index for ch in chunks if ch.choices} == {0, 1}
    assert any(ch.choices[0].logprobs and ch.choices[0].logprobs.content for ch in chunks if ch.choices)


def test_answers_match_the_published_schema(served):
    """The answers with logprobs, echo and n validate against /openapi.json's response schemas, and the request
    schemas list every new field."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs", reason="schemathesis's JSON Schema validator (dev extra)")
    import urllib.request

    with urllib.request.urlopen(served.url + "/openapi.json") as r:
        doc = json.loads(r.read())
    schemas = doc["components"]["schemas"]
    fields = {"n", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p",
              "stop_token_ids", "seed"}
    assert fields | {"echo"} <= set(schemas["CompletionRequest"]["properties"])
    assert fields | {"top_logprobs"} <= set(schemas["ChatCompletionRequest"]["properties"])

    def check(name, obj):
        jsonschema_rs.validate({**schemas[name], "components": doc["components"]}, obj)

    check("Completion", ok(served, "/v1/completions", {"prompt": "KING:", "max_tokens": 3, "n": 2, "logprobs": 2,
                                                       "echo": True}))
    check("ChatCompletion", ok(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "n": 2,
                                                                "logprobs": True, "top_logprobs": 3}))
    for chunk in stream(served, "/v1/completions", {"prompt": "KING:", "max_tokens": 3, "logprobs": 1, "n": 2,
                                                    "echo": True}):
        check("CompletionChunk", chunk)
    for chunk in stream(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True}):
        check("ChatCompletionChunk", chunk)
    for body in ({"prompt": "hi", "n": 2, "logprobs": 5, "echo": True, "presence_penalty": -2,
                  "logit_bias": {"3": -100}, "min_p": 0.1, "repetition_penalty": 1.3, "stop_token_ids": [1]},):
        check("CompletionRequest", body)


def test_n_choices_are_queued_all_or_none(tiny_data):
    """n requests that do not all fit the wait queue: a 429, and none of them stays queued."""
    from minigpt.infer.engine import Engine
    from minigpt.serve.app import ServerState
    from minigpt.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_data)
    engine = Engine(random_model(TINY_MODEL, vocab_size=tok.vocab_size), tok, max_batch_size=1, max_queue=2)
    srv = InProcessServer(ServerState(engine, tok, "tiny"), start_worker=False)  # nothing leaves the queue
    try:
        status, answer = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 3})
        assert status == 429 and answer["error"]["code"] == "queue_full", answer
        assert engine.idle()
    finally:
        srv.stop()
