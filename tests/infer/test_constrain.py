"""Grammar-constrained decoding (minigpt.infer.constrain): a tiny random model, which otherwise writes garbage,
emits valid JSON every time, matching the schema; its neighbours in the batch are unaffected."""
import json
from functools import partial

import pytest
import torch
from conftest import TINY_MODEL, random_model

from minigpt.infer.engine import Engine
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import InvalidRequest, SamplingParams
from minigpt.tokenizer.tokenizer import Tokenizer

pytest.importorskip("llguidance", reason="structured output is an extra: pip install -e '.[structured]'")
from minigpt.infer.constrain import GrammarConstraint, json_grammar, lark_grammar  # noqa: E402

SHAPE = dict(vocab_size=320, **{**TINY_MODEL, "max_seq_len": 256})
tiny_model = partial(random_model, SHAPE)
N = 12  # samples per grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tiny_data):
    return Tokenizer.from_dir(tiny_data)


def check_schema(value):
    """SCHEMA by hand (and by jsonschema_rs where installed)."""
    try:
        import jsonschema_rs
    except ImportError:
        pass
    else:
        jsonschema_rs.validate(SCHEMA, value)
    assert isinstance(value, dict) and {"name", "age", "ok"} <= set(value) <= set(SCHEMA["properties"])
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    assert type(value["age"]) is int and 0 <= value["age"] <= 120
    assert type(value["ok"]) is bool
    tags = value.get("tags", [])
    assert isinstance(tags, list) and len(tags) <= 3 and set(tags) <= {"red", "green", "blue"}


def run(engine, tokenizer, grammar, extra=(), n=N, max_tokens=200):
    reqs = []
    for seed in range(n):
        procs = [GrammarConstraint(grammar, tokenizer, SHAPE["vocab_size"], engine.stop_ids), *extra]
        reqs.append(engine.submit(tokenizer.encode("To be"), SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                                            seed=seed), logits_processors=procs))
    engine.run_until_idle()
    out = []
    for r in reqs:
        events = list(engine.events(r))
        out.append(("".join(e.text for e in events), events[-1].finish_reason))
    return out


def test_every_sample_matches_the_json_schema(tokenizer):
    engine = Engine(tiny_model(), tokenizer, max_batch_size=N)
    free = engine.submit(tokenizer.encode("To be"), SamplingParams(max_tokens=40, temperature=1.0, seed=0))
    engine.run_until_idle()
    garbage = "".join(e.text for e in engine.events(free))
    with pytest.raises(ValueError):  # what the model writes on its own
        json.loads(garbage)
    outputs = run(engine, tokenizer, json_grammar(SCHEMA))
    for text, reason in outputs:
        assert reason == "stop", text  # ended by the grammar (EOS), not cut by max_tokens
        check_schema(json.loads(text))
    assert len({t for t, _ in outputs}) > N // 2  # still sampled: the grammar narrows, the seed picks


def test_json_object_mode_gives_json_objects(tokenizer):
    """Any JSON object: strings and objects may run long under a near-uniform random model, so a second processor
    favours quotes and closing braces (a model that likes to close what it opened); the grammar alone decides what
    is valid."""
    closing = torch.tensor([i for i in range(tokenizer.vocab_size) if set('"}]') & set(tokenizer.decode([i]))])

    def likes_closing(ids, logits):
        logits = logits.clone()
        logits[closing] += 4.0
        return logits

    engine = Engine(tiny_model(), tokenizer, max_batch_size=N)
    for text, reason in run(engine, tokenizer, json_grammar(None), extra=[likes_closing]):
        assert reason == "stop", text
        assert isinstance(json.loads(text), dict)


def test_constrained_neighbour_leaves_other_rows_unchanged(tokenizer):
    model = tiny_model()
    prompt = tokenizer.encode("First Citizen:")
    params = SamplingParams(max_tokens=30, temperature=1.0, top_k=50, seed=7)
    ref = list(generate_tokens(model, prompt, params))
    engine = Engine(model, tokenizer, max_batch_size=4, stop_ids=[])
    grammar = json_grammar(SCHEMA)
    neighbours = [engine.submit(tokenizer.encode("To be"), SamplingParams(max_tokens=60, temperature=1.0, seed=s),
                                logits_processors=[GrammarConstraint(grammar, tokenizer, 320, tokenizer.stop_ids)])
                  for s in range(3)]
    req = engine.submit(prompt, params)
    engine.run_until_idle()
    assert [t for e in engine.events(req) for t in e.token_ids] == ref
    for n in neighbours:  # the neighbours were constrained all along: what they wrote so far parses as a prefix
        text = "".join(e.text for e in engine.events(n))
        assert text.startswith("{")


def test_lark_grammar_and_greedy_decoding(tokenizer):
    engine = Engine(tiny_model(), tokenizer, max_batch_size=2)
    grammar = lark_grammar('start: "<tool_call>" call "</tool_call>"\ncall: %json {"type": "object", '
                           '"properties": {"name": {"const": "f"}}, "required": ["name"], '
                           '"additionalProperties": false, '
                           '"x-guidance": {"whitespace_flexible": false}}')
    req = engine.submit(tokenizer.encode("x"), SamplingParams(max_tokens=60, temperature=0),
                        logits_processors=[GrammarConstraint(grammar, tokenizer, 320, engine.stop_ids)])
    engine.run_until_idle()
    events = list(engine.events(req))
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop", repr(text)
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
    assert json.loads(text[len("<tool_call>"):-len("</tool_call>")]) == {"name": "f"}


def test_bad_grammars_name_the_field(tokenizer):
    with pytest.raises(InvalidRequest) as e:
        GrammarConstraint(json_grammar({"type": "no-such-type"}), tokenizer, 320, [0])
    assert e.value.param == "response_format"
    with pytest.raises(InvalidRequest) as e:
        GrammarConstraint(json_grammar(SCHEMA), tokenizer, 320, [], param="tool_choice")
    assert e.value.param == "tool_choice"


def test_missing_library_is_an_invalid_request(monkeypatch, tokenizer):
    import sys

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now raises ImportError
    with pytest.raises(InvalidRequest, match="response_format") as e:
        json_grammar(SCHEMA)
    assert e.value.param == "response_format"


def test_sentencepiece_vocabulary(shared_data):
    """A SentencePiece model (stories260K's, with byte-fallback pieces) goes through the same path."""
    tok = Tokenizer.from_file(shared_data / "models" / "stories260K" / "tok512.model")
    engine = Engine(random_model({**TINY_MODEL, "vocab_size": tok.vocab_size, "max_seq_len": 256}), tok,
                    max_batch_size=4)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    reqs = [engine.submit(tok.encode("Once", bos=True), SamplingParams(max_tokens=150, temperature=1.0, seed=s),
                          logits_processors=[GrammarConstraint(json_grammar(schema), tok, tok.vocab_size,
                                                               engine.stop_ids)]) for s in range(4)]
    engine.run_until_idle()
    for req in reqs:
        events = list(engine.events(req))
        value = json.loads("".join(e.text for e in events))
        assert events[-1].finish_reason == "stop" and set(value) == {"name", "age"} and 0 <= value["age"] <= 120
