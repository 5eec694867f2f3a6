"""Tool calls and structured output on the chat endpoint (minigpt.serve.tools): the parsers of both call formats,
the checks of tool definitions and response_format (400s naming the field), and a round trip through the
official `openai` client against a live server, a tiny random model driven by the forcing grammar."""
import json

import pytest
from conftest import QWEN_TOOLS_TEMPLATE, TINY_MODEL, random_model
from serve_helpers import InProcessServer

from minigpt.infer.engine import Engine
from minigpt.serve.app import ServerState
from minigpt.serve.schemas import ApiError
from minigpt.serve.tools import ToolSpec, parse_messages, parse_response_format, parse_tool_calls, parse_tools
from minigpt.tokenizer.chat_template import IM_END, IM_START, add_special_tokens
from minigpt.tokenizer.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
NAMES = ["get_weather", "get_time"]


def args_of(call):
    assert call["type"] == "function" and call["id"].startswith("call_")
    return call["function"]["name"], json.loads(call["function"]["arguments"])


# ------------------------------------------------------------------------------------------------ parsers
def test_hermes_blocks_become_tool_calls():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me look."
    assert [args_of(c) for c in calls] == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    assert len({c["id"] for c in calls}) == 2
    # An unclosed last block (generation cut at the stop string) still counts; no text before: content None.
    content, calls = parse_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {}}', NAMES)
    assert content is None and [args_of(c) for c in calls] == [("get_time", {})]


def test_llama3_json_becomes_tool_calls():
    content, calls = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}', NAMES)
    assert content is None and [args_of(c) for c in calls] == [("get_weather", {"city": "Oslo", "days": 1})]
    text = '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Lima"}}'
    assert [args_of(c) for c in parse_tool_calls(text, NAMES)[1]] == [("get_time", {}),
                                                                      ("get_weather", {"city": "Lima"})]


@pytest.mark.parametrize("text", [
    "just an answer",
    '{"name": "unknown_tool", "parameters": {}}',  # not a defined tool
    '{"name": "get_time", "parameters": {}} and then some words',
    '<tool_call>\n{"name": "get_time", "arguments": {broken}\n</tool_call>',
    '{"a": 1}',
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> trailing text',
])
def test_text_that_is_not_a_clean_call_stays_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


# ------------------------------------------------------------------------------------------------ checks
def test_tool_definitions_and_choice():
    spec = parse_tools({"tools": [WEATHER, TIME]})
    assert spec.choice == "auto" and spec.names == NAMES and spec.parses and not spec.forced
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                                                                    "function": {"name": "get_time"}}})
    assert named.choice == "get_time" and named.forced
    assert parse_tools({}) == ToolSpec([], "none", True)
    assert not parse_tools({"tools": [WEATHER], "tool_choice": "none"}).parses


@pytest.mark.parametrize("body,param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "int"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools[0].function.extra"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools[0].function.description"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_invalid_tools_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_tools(body)
    assert e.value.status == 400 and e.value.param == param


def test_tool_messages_are_prepared_for_the_template():
    messages = parse_messages([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
    ])
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "days": 2}}}]}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize("messages,param", [
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                             "function": {"name": "f", "arguments": "{not json"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": "f()"}], "messages[0].tool_calls"),
    ([{"role": "user", "content": "x", "tool_call_id": "c"}], "messages[0].tool_call_id"),
])
def test_invalid_tool_messages_are_400_naming_the_field(messages, param):
    with pytest.raises(ApiError) as e:
        parse_messages(messages)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("value", [
    "json", {"type": "xml"}, {"type": "json_object", "schema": {}}, {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"schema": {}}},  # no name
    {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
    {"type": "json_schema", "json_schema": {"name": "a", "schema": []}},
    {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}},
])
def test_invalid_response_format_is_400(value):
    with pytest.raises(ApiError) as e:
        parse_response_format(value)
    assert e.value.status == 400 and e.value.param == "response_format"


def test_response_format_without_the_library_is_400(monkeypatch):
    import sys

    assert parse_response_format({"type": "text"}) is None
    monkeypatch.setitem(sys.modules, "llguidance", None)
    for value in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}):
        with pytest.raises(ApiError, match="response_format") as e:
            parse_response_format(value)
        assert e.value.status == 400 and e.value.param == "response_format"


# ------------------------------------------------------------------------------------------------ round trip
@pytest.fixture(scope="module")
def server(tiny_data):
    """A live server: a tiny random model (it would never choose to call a tool) with a Qwen2.5-style template."""
    pytest.importorskip("llguidance", reason="structured output is an extra: pip install -e '.[structured]'")
    tok = add_special_tokens(Tokenizer.from_dir(tiny_data), (IM_START, IM_END))[0]
    model = random_model({**TINY_MODEL, "vocab_size": tok.vocab_size, "max_seq_len": 2048})
    state = ServerState(Engine(model, tok, max_batch_size=4), tok, "tiny", chat_template=QWEN_TOOLS_TEMPLATE)
    srv = InProcessServer(state)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai", reason="the openai client is a dev extra: pip install -e '.[dev]'")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def check_weather(args):
    assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 7


def test_forced_tool_calls_round_trip_through_the_openai_client(client):
    question = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
    named = client.chat.completions.create(
        model="tiny", messages=question, tools=[WEATHER, TIME], max_tokens=200, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    check_weather(json.loads(call.function.arguments))

    # "required": calls of either tool, whichever the grammar lets the model pick; one, or one or more in parallel.
    for seed, parallel in [(0, False), (1, False), (2, True), (3, True)]:
        required = client.chat.completions.create(model="tiny", messages=question, tools=[WEATHER, TIME], seed=seed,
                                                  max_tokens=400, tool_choice="required", parallel_tool_calls=parallel)
        assert required.choices[0].finish_reason == "tool_calls"
        calls = required.choices[0].message.tool_calls
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        for call in calls:
            args = json.loads(call.function.arguments)
            if call.function.name == "get_weather":
                check_weather(args)
            else:
                assert (call.function.name, args) == ("get_time", {})

    # The next turn sends the call back with its result: assistant tool_calls and a tool message are accepted.
    history = question + [named.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER, TIME], max_tokens=5,
                                            tool_choice="none")
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None


def test_streamed_tool_calls(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER], max_tokens=200, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
    calls, content, finish = [], "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    assert calls[0].index == 0 and calls[0].function.name == "get_weather"
    check_weather(json.loads(calls[0].function.arguments))


def test_json_schema_response_format_through_the_openai_client(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    for seed in range(3):
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=200, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema,
                                                                    "strict": True}})
        value = json.loads(out.choices[0].message.content)
        assert out.choices[0].finish_reason == "stop"
        assert value["answer"] in ("yes", "no") and 0 <= value["confidence"] <= 100 and set(value) == set(schema["required"])


def test_bad_tools_over_http_are_400_naming_the_field(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"type": "function", "function": {"name": "bad name"}}])
    assert e.value.body["param"] == "tools[0].function.name"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", extra_body={"response_format": {"type": "yaml"}})
    assert e.value.body["param"] == "response_format"


def test_auto_tool_calls_stream_text_until_a_call_may_begin():
    """tool_choice "auto": the model's text streams as it comes, except what may still become a call; a call found
    at the end arrives whole, in OpenAI's chunk shapes; an answer without a call streams unchanged."""
    from minigpt.infer.request import Event
    from minigpt.serve.responses import Choice, Shaper
    from minigpt.serve.tools import ToolShaper

    def stream(pieces):
        shaper = ToolShaper(NAMES, None, True, "chatcmpl-1", 0, "tiny", [1, 2])
        out = []
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            for sse in shaper.chunks(0, Event(piece, [], "stop" if last else None, None, 2, i + 1)):
                out.append(json.loads(sse[len("data: "):])["choices"][0])
        return out

    pieces = ["Let me", " check.\n<tool", "_call>\n{\"name\": \"get_time\", ", "\"arguments\": {}}\n</tool_call>"]
    chunks = stream(pieces)
    assert [c["delta"].get("content") for c in chunks if c["delta"].get("content")] == ["Let me", " check.\n"]
    (calls,) = [c["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["delta"]]
    assert calls[0]["index"] == 0 and args_of(calls[0]) == ("get_time", {})
    assert chunks[-1]["finish_reason"] == "tool_calls" and chunks[-1]["delta"] == {}

    plain = ["The <tool", " is a hammer", ". {ok}"]
    chunks = stream(plain)
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "".join(plain)
    assert chunks[-1]["finish_reason"] == "stop" and not any("tool_calls" in c["delta"] for c in chunks)

    # Not streamed: the same answers as whole messages.
    shaper = ToolShaper(NAMES, None, True, "chatcmpl-1", 0, "tiny", [1, 2])
    choice = Choice(0, parts=pieces, last=Event("", [], "stop", None, 2, 4))
    message = shaper.answer([choice])["choices"][0]
    assert message["finish_reason"] == "tool_calls" and message["message"]["content"] == "Let me check."
    assert args_of(message["message"]["tool_calls"][0]) == ("get_time", {})
    plain_answer = Shaper(None, True, "chatcmpl-1", 0, "tiny", [1, 2]).answer(
        [Choice(0, parts=plain, last=Event("", [], "stop", None, 2, 3))])
    assert shaper.answer([Choice(0, parts=plain, last=Event("", [], "stop", None, 2, 3))]) == plain_answer


def test_parsers_answer_any_value_with_a_4xx_only(tiny_data):
    """Whatever JSON a client sends in these fields, the parsers (and the grammar compiled from them) return or
    raise ApiError 4xx, never another exception (a 500)."""
    from types import SimpleNamespace

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from minigpt.serve.tools import prepare_structured

    tok = Tokenizer.from_dir(tiny_data)
    state = SimpleNamespace(tokenizer=tok, chat=SimpleNamespace(source="<tool_call>", end_of_turn_id=None),
                            engine=SimpleNamespace(stop_ids=frozenset(tok.stop_ids), model=SimpleNamespace(
                                config=SimpleNamespace(vocab_size=tok.vocab_size))))

    scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=6) | st.sampled_from(
        ["function", "json_schema", "json_object", "text", "get_time", "required", "auto", "tool", "assistant",
         "object", "{}", "[[[", "name", "arguments", "parameters", "schema", "type"])
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "function", "name", "parameters", "json_schema", "schema", "strict", "role",
                         "content", "tool_calls", "tool_call_id", "arguments", "id", "description"]) | st.text(max_size=4),
        inner, max_size=4), max_leaves=14)

    def only_api_errors(fn, *args):
        try:
            fn(*args)
        except ApiError as e:
            assert 400 <= e.status < 500

    schemas = st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "required", "minimum",
                                               "anyOf", "$ref", "additionalProperties"]), values, max_size=3)
    formats = values | schemas.map(lambda x: {"type": "json_schema", "json_schema": {"name": "a", "schema": x}})
    tools = values | schemas.map(lambda x: [{"type": "function", "function": {"name": "f", "parameters": x}}])

    @settings(max_examples=50, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(tools, values | st.just("required"), formats, values)
    def check(tools, choice, response_format, messages):
        only_api_errors(prepare_structured, {"tools": tools, "tool_choice": choice}, state, True)
        only_api_errors(prepare_structured, {"tools": [WEATHER, tools], "tool_choice": choice}, state, True)
        only_api_errors(prepare_structured, {"response_format": response_format}, state, False)
        only_api_errors(parse_messages, messages)
        only_api_errors(parse_messages, [{"role": "assistant", "tool_calls": messages}])

    check()
    only_api_errors(parse_messages, [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}]}])


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_forcing_grammar_writes_calls_the_parser_reads(tiny_data, fmt):
    """Both formats: what the forcing grammar lets a random model write parses back into valid calls."""
    pytest.importorskip("llguidance", reason="structured output is an extra: pip install -e '.[structured]'")
    from minigpt.infer.constrain import GrammarConstraint
    from minigpt.infer.sampling import SamplingParams
    from minigpt.serve.tools import tool_call_grammar, tool_format

    assert tool_format(QWEN_TOOLS_TEMPLATE) == "hermes" and tool_format("{{ messages }}") == "llama3_json"
    tok = Tokenizer.from_dir(tiny_data)
    engine = Engine(random_model({**TINY_MODEL, "vocab_size": tok.vocab_size, "max_seq_len": 512}), tok,
                    max_batch_size=4)
    grammar = tool_call_grammar(parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required",
                                             "parallel_tool_calls": False}), fmt)
    reqs = [engine.submit(tok.encode("call"), SamplingParams(max_tokens=200, temperature=1.0, seed=seed),
                          logits_processors=[GrammarConstraint(grammar, tok, tok.vocab_size, engine.stop_ids)])
            for seed in range(4)]
    engine.run_until_idle()
    for req in reqs:
        events = list(engine.events(req))
        text = "".join(e.text for e in events)
        assert events[-1].finish_reason == "stop"
        assert text.startswith("<tool_call>\n" if fmt == "hermes" else '{"name": ')
        content, (call,) = parse_tool_calls(text, NAMES)
        name, args = args_of(call)
        assert content is None
        if name == "get_weather":
            check_weather(args)
        else:
            assert (name, args) == ("get_time", {})


def test_forced_call_keeps_local_refs_of_the_parameters(tiny_data):
    """Parameters with `$defs` / `$ref` (what pydantic's schemas have) still compile inside the call's schema."""
    pytest.importorskip("llguidance", reason="structured output is an extra: pip install -e '.[structured]'")
    from minigpt.infer.constrain import GrammarConstraint
    from minigpt.infer.sampling import SamplingParams
    from minigpt.serve.tools import tool_call_grammar

    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "$defs": {"Color": {"enum": ["red", "blue"]}},
        "properties": {"color": {"$ref": "#/$defs/Color"}}, "required": ["color"], "additionalProperties": False}}}
    tok = Tokenizer.from_dir(tiny_data)
    engine = Engine(random_model({**TINY_MODEL, "vocab_size": tok.vocab_size, "max_seq_len": 256}), tok)
    grammar = tool_call_grammar(parse_tools({"tools": [tool], "tool_choice": "required"}), "llama3_json")
    req = engine.submit(tok.encode("x"), SamplingParams(max_tokens=100, temperature=1.0, seed=0),
                        logits_processors=[GrammarConstraint(grammar, tok, tok.vocab_size, engine.stop_ids)])
    engine.run_until_idle()
    (call,) = parse_tool_calls("".join(e.text for e in engine.events(req)), ["pick"])[1]
    assert args_of(call)[1]["color"] in ("red", "blue")
