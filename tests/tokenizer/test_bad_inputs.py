"""Bad input to tokenizers and chat templates gets one clear error, never a traceback or a 500: a model's chat
template that raises while rendering (``{{ 1/0 }}``), a ``chat_template`` that is not a string (and Hugging Face's
list of named templates, which is supported), a special token that is not a string, and text that is not UTF-8
(bytes from the command line or a pipe, which Python carries as lone surrogates)."""
import json
import random
import subprocess
import sys

import pytest
from conftest import CLI_ENV, QWEN_TOOLS_TEMPLATE, TINY_MODEL, assert_one_line_error, random_model, run_cli
from serve.serve_helpers import InProcessServer

from minigpt.checkpoint.convert import export_gguf
from minigpt.checkpoint.native import load_chat_template, load_tokenizer, save_pretrained
from minigpt.errors import MiniGPTError
from minigpt.tokenizer.chat_template import (
    CHATML_TEMPLATE,
    IM_END,
    IM_START,
    ChatTemplate,
    TemplateFailed,
    TemplateRejected,
    add_special_tokens,
)
from minigpt.tokenizer.tokenizer import InvalidText, Tokenizer, train_tokenizer

WORDS = "the cat sat on a mat why is sky blue tell me about tea weather Paris 猫 喜欢 鱼".split()
HI = [{"role": "user", "content": "hi"}]
ZERO_DIVISION = "{{ 1/0 }}"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
NOT_UTF8 = "ab\udcff\udcfe"  # b"ab\xff\xfe" as Python decodes it from argv or stdin (surrogateescape)


def tokenizer() -> Tokenizer:
    rng = random.Random(0)
    tok = train_tokenizer([" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(200)], 300)
    return add_special_tokens(tok, (IM_START, IM_END))[0]


def model_dir(path, config=None, jinja=None):
    """A tiny random model directory whose tokenizer_config.json holds ``config`` (and chat_template.jinja
    ``jinja``)."""
    tok = tokenizer()
    save_pretrained(random_model(TINY_MODEL, vocab_size=tok.vocab_size), path, tokenizer=tok)
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


# ------------------------------------------------------------------------------ 1. templates that raise
@pytest.mark.parametrize("template, error", [
    (ZERO_DIVISION, "ZeroDivisionError: division by zero"),
    ("{{ range(10**9)|list }}", "OverflowError: Range too big"),
])
@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
def test_template_raising_while_rendering_is_one_error_naming_its_file(tmp_path, template, error, where):
    path = model_dir(tmp_path / "m", {"chat_template": template} if where == "tokenizer_config.json" else None,
                     template if where == "chat_template.jinja" else None)
    chat = ChatTemplate.for_model(load_tokenizer(path), load_chat_template(path))
    with pytest.raises(TemplateFailed) as e:
        chat.prompt(HI)
    assert isinstance(e.value, TemplateRejected) and isinstance(e.value, MiniGPTError)
    assert str(e.value).startswith(f"the chat template of {path / where} failed while rendering: {error}")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("template, error", [
    # 10^10 loop iterations: each range is within Jinja's sandbox limit, together they never end
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "draws more than 1,000,000 items from range()"),
    ("{{ ('ab' * 3000000000)|length }}", "repeats a value to more than 1,000,000 items"),  # was 6 GB and 4 s
    ("{{ (3 * [1, 2])|length }}{{ [0] * 2000000 }}", "repeats a value"),
])
def test_a_template_that_would_not_end_is_stopped_in_one_error(tmp_path, template, error):
    path = model_dir(tmp_path / "m", {"chat_template": template})
    chat = ChatTemplate.for_model(load_tokenizer(path), load_chat_template(path))
    with pytest.raises(TemplateFailed, match=error):
        chat.prompt(HI)


def test_the_range_budget_is_per_render_and_ordinary_loops_keep_working(tmp_path):
    """Each render draws from a fresh budget: 15 renders of 100,000 range items each all succeed."""
    template = "{% for i in range(100000) %}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    chat = ChatTemplate.for_model(load_tokenizer(path := model_dir(tmp_path / "m", {"chat_template": template})),
                                  load_chat_template(path))
    for _ in range(15):
        assert chat.render(HI) == HI[-1]["content"]


def test_template_raising_in_a_gguf_names_the_gguf(tmp_path):
    gguf = export_gguf(model_dir(tmp_path / "m", {"chat_template": ZERO_DIVISION}), tmp_path / "m.gguf")
    chat = ChatTemplate.for_model(load_tokenizer(gguf), load_chat_template(gguf))
    with pytest.raises(TemplateFailed, match=r"m\.gguf \(tokenizer\.chat_template\) failed while rendering: "
                                             "ZeroDivisionError"):
        chat.prompt(HI)


@pytest.mark.parametrize("where, text", [("chat_template.jinja", ""), ("chat_template.jinja", " \n\t"),
                                         ("tokenizer_config.json", "   ")])
def test_an_empty_template_is_ignored_with_a_warning_naming_its_file(tmp_path, where, text):
    """It renders nothing for any conversation: it was taken as no template, the plain fallback, without a word."""
    path = model_dir(tmp_path / "m", {"chat_template": text} if where == "tokenizer_config.json" else None,
                     text if where == "chat_template.jinja" else None)
    with pytest.warns(RuntimeWarning, match=f"the chat template in {path / where} is empty; it is ignored"):
        assert load_chat_template(path) is None


def test_generate_chat_with_an_empty_template_says_so_and_answers(tmp_path):
    path = model_dir(tmp_path / "m", jinja="\n")
    proc = run_cli("generate", path, "--chat", "hi", "--max-new-tokens", "2", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    # One line, as errors are: not Python's "file:line: RuntimeWarning: ..." and the source line under it.
    assert proc.stderr.splitlines()[0].startswith(
        f"warning: the chat template in {path / 'chat_template.jinja'} is empty; it is ignored"), proc.stderr
    assert "RuntimeWarning" not in proc.stderr and "load_chat_template" not in proc.stderr


def test_generate_chat_with_a_raising_template_is_a_one_line_error(tmp_path):
    path = model_dir(tmp_path / "m", {"chat_template": ZERO_DIVISION})
    proc = run_cli("generate", path, "--chat", "hi", "--max-new-tokens", "2")
    assert_one_line_error(proc, f"the chat template of {path / 'tokenizer_config.json'} failed while rendering",
                          "ZeroDivisionError: division by zero")


def test_server_answers_a_raising_template_with_400_and_an_openai_error(tmp_path):
    path = model_dir(tmp_path / "m", {"chat_template": ZERO_DIVISION})
    srv = InProcessServer.for_model_dir(path)
    try:
        status, answer = srv.post("/v1/chat/completions", {"messages": HI, "max_tokens": 2})
    finally:
        srv.stop()
    assert status == 400, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == "messages"
    assert "failed while rendering: ZeroDivisionError: division by zero" in answer["error"]["message"]


# ------------------------------------------------------------------------------ 2. chat_template not a string
@pytest.mark.parametrize("value", [5, [5], [{"name": "default"}], [{"name": "default", "template": 5}], True])
def test_chat_template_that_is_not_a_string_is_refused_naming_the_file(tmp_path, value):
    path = model_dir(tmp_path / "m", {"chat_template": value})
    with pytest.raises(MiniGPTError, match=rf"'chat_template' in {path / 'tokenizer_config.json'} must be a string"
                                           r" or a list of \{\"name\""):
        load_chat_template(path)


def test_generate_chat_with_a_numeric_chat_template_is_a_one_line_error(tmp_path):
    path = model_dir(tmp_path / "m", {"chat_template": 5})
    proc = run_cli("generate", path, "--chat", "hi", "--max-new-tokens", "2")
    assert_one_line_error(proc, f"'chat_template' in {path / 'tokenizer_config.json'} must be a string")


def test_named_templates_default_renders_as_the_plain_template_and_tool_use_takes_tools(tmp_path):
    """Hugging Face's layout for several templates: "default" for chat, "tool_use" when tools are given, as
    transformers' get_chat_template picks."""
    layout = [{"name": "default", "template": CHATML_TEMPLATE}, {"name": "tool_use", "template": QWEN_TOOLS_TEMPLATE}]
    path = model_dir(tmp_path / "m", {"chat_template": layout})
    tok = load_tokenizer(path)
    chat = ChatTemplate.for_model(tok, load_chat_template(path))
    plain, tools = ChatTemplate(tok, CHATML_TEMPLATE), ChatTemplate(tok, QWEN_TOOLS_TEMPLATE)
    assert chat.render(HI, add_generation_prompt=True) == plain.render(HI, add_generation_prompt=True)
    assert chat.prompt(HI) == plain.prompt(HI)
    assert chat.end_of_turn_id == plain.end_of_turn_id == tok.token_to_id(IM_END)
    with_tools = chat.render(HI, add_generation_prompt=True, tools=TOOLS)
    assert with_tools == tools.render(HI, add_generation_prompt=True, tools=TOOLS) and "get_weather" in with_tools


def test_named_templates_without_a_default_are_refused(tmp_path):
    path = model_dir(tmp_path / "m", {"chat_template": [{"name": "tool_use", "template": QWEN_TOOLS_TEMPLATE}]})
    with pytest.raises(MiniGPTError, match=r"has templates named \['tool_use'\] but none named 'default'"):
        load_chat_template(path)


# ------------------------------------------------------------------------------ 3. special tokens not strings
@pytest.mark.parametrize("key, value, shown", [
    ("bos_token", 5, "not 5"), ("eos_token", {"content": 7}, 'not {"content": 7}'), ("pad_token", ["<|pad|>"], "not [")])
@pytest.mark.parametrize("file", ["tokenizer_config.json", "special_tokens_map.json"])
def test_special_token_that_is_not_a_string_is_refused_naming_file_and_key(tmp_path, key, value, shown, file):
    path = model_dir(tmp_path / "m")
    (path / file).write_text(json.dumps({key: value}))
    with pytest.raises(MiniGPTError, match=rf"'{key}' in {path / file} must be the token's text") as e:
        load_tokenizer(path)
    assert shown in str(e.value)


def test_special_token_as_an_added_token_object_still_works(tmp_path):
    path = model_dir(tmp_path / "m", {"bos_token": {"content": IM_START, "lstrip": False, "special": True},
                                      "eos_token": {"content": IM_END}})
    tok = load_tokenizer(path)
    assert (tok.bos_id, tok.eos_id) == (tok.token_to_id(IM_START), tok.token_to_id(IM_END))


# ------------------------------------------------------------------------------ 4. text that is not UTF-8
@pytest.fixture(params=["tokenizers", "sentencepiece"])
def any_tokenizer(request):
    if request.param == "tokenizers":
        return tokenizer()
    stories = request.getfixturevalue("shared_data") / "models" / "stories260K" / "hf" / "tokenizer.model"
    return Tokenizer.from_file(stories)


def test_encode_refuses_text_that_is_not_utf8_before_the_back_end(any_tokenizer):
    for special in (False, True):
        with pytest.raises(InvalidText, match=r"^the text is not valid UTF-8 \(byte 0xff at position 2\); "):
            any_tokenizer.encode(NOT_UTF8, special=special)
    with pytest.raises(ValueError, match=r"byte 0xfe at position 0"):
        any_tokenizer.encode_batch(["fine", "\udcfe"])
    with pytest.raises(MiniGPTError, match=r"not valid Unicode \(a lone surrogate U\+D800 at position 1\)"):
        any_tokenizer.encode("a\ud800")
    assert any_tokenizer.encode("héllo 猫 😀") == any_tokenizer.encode_batch(["héllo 猫 😀"])[0]


def test_chat_template_refuses_a_message_that_is_not_utf8():
    chat = ChatTemplate(tokenizer())
    with pytest.raises(TemplateRejected, match=r"^message 2 \(user\): the text is not valid UTF-8 \(byte 0xff at "
                                               "position 2\\)"):
        chat.prompt([{"role": "system", "content": "be brief"}, {"role": "user", "content": NOT_UTF8}])
    with pytest.raises(InvalidText):
        chat.encode_text(NOT_UTF8)


def test_generate_with_a_prompt_or_chat_not_utf8_is_a_one_line_error(tmp_path):
    path = model_dir(tmp_path / "m")
    proc = run_cli("generate", path, "--prompt", NOT_UTF8, "--max-new-tokens", "2")
    assert_one_line_error(proc, "the text is not valid UTF-8 (byte 0xff at position 2)")
    proc = run_cli("generate", path, "--chat", NOT_UTF8, "--max-new-tokens", "2")
    assert_one_line_error(proc, "message 1 (user): the text is not valid UTF-8 (byte 0xff at position 2)")


def test_chat_refuses_a_line_not_utf8_and_goes_on(tmp_path):
    """Also where stdin and stdout decode and encode strictly (en_US.UTF-8: no surrogateescape, forced here)."""
    path = model_dir(tmp_path / "m")
    proc = subprocess.run([sys.executable, "-m", "minigpt", "chat", str(path), "--max-tokens", "2"],
                          input=b"ab\xff\xfe\nhello\n/quit\n", capture_output=True, timeout=300,
                          env={**CLI_ENV, "PYTHONIOENCODING": "utf-8:strict"})
    out = proc.stdout.decode("utf-8")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr.decode(), proc.stderr
    assert "you> ab\ufffd\ufffd\n(message 1 (user): the text is not valid UTF-8 (byte 0xff at position 2);" in out
    assert out.count("assistant> ") == 1  # the next line was answered


# ------------------------------------------------------------------------------ token ids of the side files
@pytest.mark.parametrize("value", ["2", 1.5, True, [2, "x"], {"id": 2}])
@pytest.mark.parametrize("file, key", [("generation_config.json", "eos_token_id"),
                                       ("generation_config.json", "pad_token_id"),
                                       ("config.json", "eos_token_id")])
def test_a_token_id_of_the_wrong_type_is_one_error_naming_its_file(tmp_path, file, key, value):
    """Ignored, a wrong EOS left the model without a stop id: generation ran to its token limit."""
    path = model_dir(tmp_path / "m")  # weights, config.json and tokenizer.json: no other side file
    data = json.loads((path / file).read_text()) if file == "config.json" else {}
    (path / file).write_text(json.dumps({**data, key: value}))
    with pytest.raises(MiniGPTError) as e:
        load_tokenizer(path)
    assert str(e.value).startswith(f"'{key}' in {path / file} must be a token id, a list of ids or null, not ")
    assert "\n" not in str(e.value)


def test_token_ids_as_ints_lists_and_null_still_load(tmp_path):
    path = model_dir(tmp_path / "m")
    for eos, want in ((2, {2}), ([2, 3], {2, 3}), (None, set())):
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        assert want <= set(load_tokenizer(path).stop_ids)
