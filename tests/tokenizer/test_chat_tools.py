"""Chat templates with tools: ChatTemplate renders `tools`, assistant `tool_calls` and `tool` messages exactly as
transformers' apply_chat_template(messages, tools=...) does, on a Qwen2.5-style template with a tools section."""
import json
import random

import pytest
from conftest import QWEN_TOOLS_TEMPLATE

from minigpt.tokenizer.chat_template import IM_END, IM_START, ChatTemplate, add_special_tokens
from minigpt.tokenizer.tokenizer import train_tokenizer

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (pip install .[dev])")

WORDS = "the weather in Paris is sunny what time call get_weather city unit celsius 天气".split()
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now, nowhere in particular",
                                      "parameters": {"type": "object", "properties": {}}}},
]
CONVERSATIONS = [
    [{"role": "user", "content": "what is the weather in Paris?"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Paris and the time?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": {"city": "Paris", "unit": "celsius"}}},
         {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "sky": "天气 sunny"})},
     {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
     {"role": "assistant", "content": "It is sunny, 21 C, at noon."},
     {"role": "user", "content": "thanks"}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """tokenizer.json + tokenizer_config.json with the template: what AutoTokenizer reads."""
    rng = random.Random(0)
    tok = train_tokenizer([" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(200)], 300)
    tok = add_special_tokens(tok, (IM_START, IM_END, "<tool_call>", "</tool_call>"))[0]
    path = tmp_path_factory.mktemp("qwen_tools")
    tok.save(path)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>",
        "chat_template": QWEN_TOOLS_TEMPLATE}))
    return path, tok


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("with_tools", [True, False])
def test_tools_render_as_apply_chat_template(model_dir, messages, with_tools):
    path, tok = model_dir
    ref = transformers.AutoTokenizer.from_pretrained(path)
    ours = ChatTemplate(tok, QWEN_TOOLS_TEMPLATE)
    tools = TOOLS if with_tools else None
    text = ours.render(messages, add_generation_prompt=True, tools=tools)
    assert text == ref.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    expected = ref.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                       return_dict=True)["input_ids"]
    assert ours.prompt(messages, tools=tools) == expected
    # The tools section is there exactly when tools are given, each definition as one JSON line.
    assert ("<tools>" in text) == with_tools
    if with_tools:
        assert all(json.dumps(t, ensure_ascii=False) in text for t in TOOLS)
    if len(messages) > 1:
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
        assert "<tool_response>\n12:00\n</tool_response>" in text
