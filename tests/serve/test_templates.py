"""Chat templates and prompts at inference, checked against transformers: the ids `minigpt chat` and the chat
endpoint send for a conversation equal `apply_chat_template`'s (ChatML, a Llama-3-style template), and a
/v1/completions prompt written with special tokens is tokenized as `tokenizer(prompt)` tokenizes it."""
import json
import random
from datetime import datetime

import pytest
import torch
from conftest import TINY_MODEL
from serve_helpers import InProcessServer

from minigpt.checkpoint.native import load_chat_template, load_tokenizer
from minigpt.infer.engine import Engine
from minigpt.infer.stops import default_stop_ids
from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer
from minigpt.serve.app import ServerState
from minigpt.serve.chat import prompt_bos
from minigpt.tokenizer.chat_template import (
    CHATML_TEMPLATE,
    IM_END,
    IM_START,
    PLAIN_STOP,
    ChatTemplate,
    TemplateRejected,
    add_special_tokens,
)
from minigpt.tokenizer.tokenizer import train_tokenizer

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (pip install .[dev])")

WORDS = "the cat sat on a mat why is sky blue tell me about tea please answer briefly 猫 喜欢 鱼".split()
BEGIN, HEADER_START, HEADER_END, EOT = "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
# The shape of Meta's Llama 3 template (BOS written by the template, a header per message, <|eot_id|> after it).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "why is the sky blue?"}],
    [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "tell me about tea"},
     {"role": "assistant", "content": "  tea is 猫 喜欢 鱼 "}, {"role": "user", "content": "and the cat?"}],
    [{"role": "user", "content": f"a written {IM_END} and {EOT} inside"}],
]


def tokenizer_with(tokens):
    rng = random.Random(0)
    tok = train_tokenizer([" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(200)], 300)
    return add_special_tokens(tok, tokens)[0]


def model_dir(path, tokens, config, generation=None):
    """tokenizer.json + tokenizer_config.json (+ generation_config.json): what both AutoTokenizer and
    `load_tokenizer` / `load_chat_template` read."""
    path.mkdir(parents=True)
    tokenizer_with(tokens).save(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("chatml") / "m", (IM_START, IM_END),
                     {"bos_token": None, "eos_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE})


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("llama3") / "m", (BEGIN, HEADER_START, HEADER_END, EOT),
                     {"bos_token": BEGIN, "eos_token": "<|endoftext|>", "chat_template": LLAMA3_TEMPLATE})


@pytest.mark.parametrize("which,end", [("chatml", IM_END), ("llama3", EOT)])
def test_chat_prompt_ids_equal_apply_chat_template(request, which, end):
    """The path of `minigpt chat` (and the chat endpoint): the model's template from its files, rendered with the
    generation prompt; the end-of-turn token is found and stops generation though no file lists it."""
    path = request.getfixturevalue(which)
    ref = transformers.AutoTokenizer.from_pretrained(path)
    tok = load_tokenizer(path)
    chat = ChatTemplate.for_model(tok, load_chat_template(path))
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        assert chat.prompt(messages) == expected["input_ids"]
    eot = tok.token_to_id(end)
    assert chat.end_of_turn_id == eot and chat.stop == (end,)
    assert eot not in tok.stop_ids and eot in default_stop_ids(tok, chat)
    assert default_stop_ids(tok, chat)[: len(tok.stop_ids)] == list(tok.stop_ids)


def test_plain_fallback_without_a_template(tmp_path):
    tok = tokenizer_with((IM_START, IM_END))
    chat = ChatTemplate.for_model(tok, None)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat.render(messages, add_generation_prompt=True) == "System: be brief\nUser: hi\nAssistant:"
    assert chat.prompt(messages) == tok.encode("System: be brief\nUser: hi\nAssistant:")
    assert chat.end_of_turn_id is None and chat.stop == (PLAIN_STOP,)


def test_template_helpers_and_rejections():
    tok = tokenizer_with((IM_START, IM_END))
    assert ChatTemplate(tok, "{{ strftime_now('%Y') }}").render([]) == str(datetime.now().year)
    strict = ChatTemplate(tok, "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}"
                               "{% endif %}")
    with pytest.raises(TemplateRejected, match="system first"):
        strict.prompt([{"role": "user", "content": "hi"}])
    assert strict.end_of_turn_id is None


def test_completion_prompt_with_special_tokens_is_tokenized_as_transformers(chatml, tmp_path):
    """"<|im_start|>user..." sent to /v1/completions: the same ids as transformers' tokenizer(prompt), not the
    longer plain-text encoding; usage.prompt_tokens counts them."""
    ref = transformers.AutoTokenizer.from_pretrained(chatml)
    tok = load_tokenizer(chatml)
    prompt = f"{IM_START}user\nwhy is the sky blue?{IM_END}\n{IM_START}assistant\n"
    expected = ref(prompt)["input_ids"]
    assert len(tok.encode(prompt)) > len(expected)  # the plain encoding spells <|im_start|> out
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, **TINY_MODEL)).eval()
    state = ServerState(Engine(model, tok, max_batch_size=1), tok, "m", chat_template=load_chat_template(chatml),
                        add_bos=prompt_bos(chatml, tok))
    assert state.prompt_ids(prompt) == expected
    srv = InProcessServer(state)
    try:
        import urllib.request

        body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
        req = urllib.request.Request(srv.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
    finally:
        srv.stop()
    assert answer["usage"]["prompt_tokens"] == len(expected)


def test_completion_prompt_gets_bos_as_transformers_adds_it(tmp_path):
    """A tokenizer whose post-processor adds BOS (Llama 3's tokenizer.json): the prompt starts with it, once."""
    path = model_dir(tmp_path / "m", (BEGIN, EOT), {"bos_token": BEGIN, "eos_token": EOT})
    data = json.loads((path / "tokenizer.json").read_text())
    begin = tokenizer_with((BEGIN, EOT)).token_to_id(BEGIN)
    data["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": BEGIN, "type_id": 0}},
                                                                        {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"SpecialToken": {"id": BEGIN, "type_id": 0}},
                                       {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {BEGIN: {"id": BEGIN, "ids": [begin], "tokens": [BEGIN]}}}
    (path / "tokenizer.json").write_text(json.dumps(data))
    ref = transformers.AutoTokenizer.from_pretrained(path)
    tok = load_tokenizer(path)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, **TINY_MODEL)).eval()
    state = ServerState(Engine(model, tok, max_batch_size=1), tok, "m", add_bos=prompt_bos(path, tok))
    plain = "tell me about tea"
    expected = ref(plain)["input_ids"]
    assert expected[0] == begin and state.prompt_ids(plain) == expected
    assert state.prompt_ids(BEGIN + plain) == expected  # written BOS: kept once (transformers would double it)
