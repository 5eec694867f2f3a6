"""Hostile SFT and DPO rows, fuzzed: JSON lines shaped like every layout we read (OpenAI messages with tools, TRL's
prompt-completion and text, ShareGPT with LLaMA-Factory's tool turns, Alpaca, preference pairs), with any JSON value
in any field, lone surrogates and the characters that mark generation blocks included. Each line must be kept or
skipped with a counted reason, through the reader and the tokenizing of four templates (our ChatML with and without
generation blocks, the plain fallback, a Qwen2.5-style template with tools); any other exception is a traceback a
user would see, or a whole run lost to one line. Derandomized: the same examples every run."""
import json

import hypothesis
import pytest
from chat_helpers import chat_tokenizer
from conftest import QWEN_TOOLS_TEMPLATE
from hypothesis import strategies as st

from minigpt.data.chat import SkipReport, load_chat_dataset, read_conversations
from minigpt.data.preference import load_preference_dataset, read_preferences
from minigpt.errors import MiniGPTError
from minigpt.tokenizer.chat_template import CHATML_TEMPLATE, CHATML_TRAINING_TEMPLATE, PLAIN_TEMPLATE, ChatTemplate

SETTINGS = hypothesis.settings(max_examples=300, derandomize=True, database=None, deadline=None, print_blob=False,
                               suppress_health_check=list(hypothesis.HealthCheck))

# Text: short, any code point (lone surrogates arrive from JSON escapes), often a marker a template or we react to.
TEXT = st.one_of(st.text(st.characters(exclude_categories=()), max_size=8),
                 st.sampled_from(["", " ", "<|im_end|>", "\uf8f0", "\uf8f1", "{{ x }}", "get_weather", "</s>"]))
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**70), st.floats(allow_nan=False, allow_infinity=False),
                   TEXT)
JSON = st.recursive(SCALAR, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(TEXT, kids, max_size=3),
                    max_leaves=6)
CALL = st.one_of(st.fixed_dictionaries({"type": st.just("function") | JSON, "function": st.fixed_dictionaries(
    {"name": TEXT | JSON}, optional={"arguments": st.dictionaries(TEXT, SCALAR, max_size=2) | TEXT | JSON})},
    optional={"id": TEXT | JSON}), JSON)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]) | JSON},
    optional={"content": TEXT | JSON | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})),
              "tool_calls": st.lists(CALL, max_size=2) | JSON, "tool_call_id": TEXT | JSON, "name": TEXT | JSON})
MESSAGES = st.lists(MESSAGE, max_size=4) | JSON
TOOLS = st.one_of(st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.dictionaries(
    st.sampled_from(["name", "description", "parameters"]), JSON, max_size=3)}) | JSON, max_size=2), TEXT, JSON)
TURN = st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt", "system", "observation", "function_call"]) | JSON},
                             optional={"value": TEXT | JSON})
CHAT_ROW = st.one_of(
    st.fixed_dictionaries({"messages": MESSAGES}, optional={"tools": TOOLS}),
    st.fixed_dictionaries({"prompt": MESSAGES | TEXT, "completion": MESSAGES | TEXT}, optional={"tools": TOOLS}),
    st.fixed_dictionaries({"text": TEXT | JSON}),
    st.fixed_dictionaries({"conversations": st.lists(TURN, max_size=4) | JSON},
                          optional={"system": TEXT | JSON, "tools": TOOLS}),
    st.fixed_dictionaries({"instruction": TEXT | JSON, "output": TEXT | JSON},
                          optional={"input": TEXT | JSON, "system": TEXT | JSON}),
    JSON)
PREFERENCE_ROW = st.one_of(
    st.fixed_dictionaries({"chosen": MESSAGES | TEXT, "rejected": MESSAGES | TEXT},
                          optional={"prompt": MESSAGES | TEXT, "tools": TOOLS}),
    JSON)
GOOD_CHAT = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
GOOD_PAIR = {"prompt": [{"role": "user", "content": "Hi?"}], "chosen": "Hello.", "rejected": "Go away."}


@pytest.fixture(scope="module")
def templates():
    tok = chat_tokenizer()
    return [ChatTemplate(tok, t) for t in (CHATML_TRAINING_TEMPLATE, CHATML_TEMPLATE, PLAIN_TEMPLATE,
                                          QWEN_TOOLS_TEMPLATE)]


def write(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=True) + "\n" for r in rows), encoding="utf-8")
    return path


def kept_or_skipped(tmp_path_factory, rows, read, load, templates):
    """Every line is read or counted as skipped, and every record read is tokenized or counted as skipped, with
    each template; a load that keeps none says so in its one error line, after counting them all."""
    path = write(tmp_path_factory, rows)
    report = SkipReport()
    records = read(path, report=report)
    assert sum(report.skipped.values()) + len(records) == len(rows)
    for template in templates:
        counted = SkipReport()
        try:
            kept = len(load(path, template, counted, records))
        except MiniGPTError as e:
            assert "no usable" in str(e)
            kept = 0
        assert kept + sum(counted.skipped.values()) == len(records)


@pytest.mark.slow
@SETTINGS
@hypothesis.given(row=CHAT_ROW)
@hypothesis.example(row={"conversations": [{"from": []}]})  # a TypeError that ended the read, before
@hypothesis.example(row={"prompt": "\ud800", "completion": "x"})  # one row's lone surrogate ended the run
def test_any_chat_row_is_kept_or_skipped_with_a_reason(tmp_path_factory, templates, row):
    kept_or_skipped(tmp_path_factory, [row, GOOD_CHAT], read_conversations,
                    lambda path, template, report, records: load_chat_dataset(
                        path, template, 4096, report=report, bos_id=0, records=records), templates)


@pytest.mark.slow
@SETTINGS
@hypothesis.given(row=PREFERENCE_ROW)
@hypothesis.example(row={"prompt": "\ud800", "chosen": "0", "rejected": "1"})  # ended the whole DPO load, before
def test_any_preference_row_is_kept_or_skipped_with_a_reason(tmp_path_factory, templates, row):
    kept_or_skipped(tmp_path_factory, [row, GOOD_PAIR], read_preferences,
                    lambda path, template, report, records: load_preference_dataset(
                        path, template, 4096, "<|endoftext|>", report=report, records=records, bos_id=0), templates)
