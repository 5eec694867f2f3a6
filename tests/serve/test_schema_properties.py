"""Property tests of the request parsers: whatever bytes or JSON values a client sends, each parser returns or raises
the server's ApiError with a 4xx status -- never another exception, which the app would turn into a 500."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minigpt.serve.schemas import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    ApiError,
    check_fields,
    parse_json,
    parse_messages,
    parse_sampling,
    parse_stream_flags,
)

SETTINGS = settings(max_examples=300, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text()
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner,
                                                                                              max_size=4),
                      max_leaves=12)
fields = sorted(COMPLETION_FIELDS | CHAT_FIELDS)
bodies = st.dictionaries(st.sampled_from(fields) | st.text(max_size=8), values, max_size=8)


def _only_api_errors(fn, *args):
    try:
        fn(*args)
    except ApiError as e:
        assert 400 <= e.status < 500, e.status


@SETTINGS
@given(st.binary(max_size=200) | st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_parse_json_on_any_bytes(raw):
    _only_api_errors(parse_json, raw)


@SETTINGS
@given(values)
def test_parse_json_on_any_json_value(value):
    _only_api_errors(parse_json, json.dumps(value).encode())


@pytest.mark.slow
@SETTINGS
@given(bodies, st.booleans())
def test_body_parsers_on_any_body(body, chat):
    _only_api_errors(check_fields, body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    _only_api_errors(parse_sampling, body, chat)
    _only_api_errors(parse_stream_flags, body)


@SETTINGS
@given(values)
def test_parse_messages_on_any_value(messages):
    _only_api_errors(parse_messages, messages)
