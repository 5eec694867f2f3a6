"""Tool use in SFT data: a ``tools`` column, assistant ``tool_calls`` and ``tool`` messages, tokenized as TRL does,
rendered as the server prompts, and skipped with a reason where unusable."""
import json
import random
from pathlib import Path

import pytest
from chat_helpers import chat_tokenizer, hf_copy, save_hf_tokenizer, sentence, tiny_model

from minigpt.data.chat import IGNORE_INDEX, SkipReport, load_chat_dataset, read_conversations, tokenize_conversation
from minigpt.errors import MiniGPTError
from minigpt.tokenizer.chat_template import (
    CHATML_TEMPLATE,
    CHATML_TRAINING_TEMPLATE,
    PLAIN_TEMPLATE,
    ChatTemplate,
)

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (pip install .[dev])")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CITIES = ("Paris", "Lyon", "Oslo", "Lima", "Kyoto")

# ChatML as minigpt wrote it before it wrote tools (kept as data: models saved then carry it).
OLD_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
              "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
              "{% endif %}")
OLD_CHATML_TRAINING = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
                       "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
                       "{% endgeneration %}{{ '\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\n' + "
                       "message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
                       "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def call(city, name="get_weather"):
    return {"type": "function", "function": {"name": name, "arguments": {"city": city}}}


def tool_rows(n, seed=0):
    """Rows with a tools column (a JSON string, as datasets often hold it), one or two calls of ``get_weather``
    (after words or not), their results and a final answer; every row has the same keys, so that ``datasets``
    adds no empty fields."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        cities = rng.sample(CITIES, rng.randint(1, 2))
        results = [f"{rng.randint(-5, 30)} C and {rng.choice(['sunny', 'rain', 'snow'])}" for _ in cities]
        messages = [{"role": "system", "content": sentence(rng)},
                    {"role": "user", "content": "Weather in " + " and ".join(cities) + "?"},
                    {"role": "assistant", "content": rng.choice(["", sentence(rng, 3) + "."]),
                     "tool_calls": [call(c) for c in cities]}]
        messages += [{"role": "tool", "content": r} for r in results]
        messages.append({"role": "assistant", "content": sentence(rng) + "."})
        rows.append({"messages": messages, "tools": json.dumps([WEATHER, CLOCK])})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def trl_dataset(tmp_path, rows, template, tok):
    """TRL 1.x's SFTTrainer's tokenized dataset for ``rows`` (assistant-only loss: ``template`` has generation
    blocks)."""
    trl = pytest.importorskip("trl", reason="trl is a test-only dependency")
    datasets = pytest.importorskip("datasets", reason="datasets comes with trl")
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, bf16=False,
                         max_length=None, packing=False, assistant_only_loss=True)
    trainer = trl.SFTTrainer(model=hf_copy(tiny_model(tok.vocab_size)), args=args,
                             train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=transformers.AutoTokenizer.from_pretrained(
                                 save_hf_tokenizer(tok, tmp_path / "tok", template)))
    return trainer.train_dataset


def qwen25_training_template():
    trl = pytest.importorskip("trl", reason="trl is a test-only dependency")
    path = Path(trl.__file__).parent / "chat_templates" / "qwen2_5_training.jinja"
    if not path.is_file():
        pytest.skip("this TRL has no qwen2_5_training.jinja")
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("which", ["chatml", "qwen2.5"])
def test_tool_rows_tokenized_as_trl_sft_trainer_does(tmp_path, which):
    """Our ids and labels equal TRL's SFTTrainer's (``assistant_only_loss``, the row's ``tools`` column decoded and
    given to the template) for our ChatML and for TRL's own Qwen2.5 training template; the calls are scored, the
    tool results are not. Before, these rows were skipped (``unknown role``: ``tool``)."""
    tok = chat_tokenizer()
    template = CHATML_TRAINING_TEMPLATE if which == "chatml" else qwen25_training_template()
    rows = tool_rows(6, seed=1)
    theirs = trl_dataset(tmp_path, rows, template, tok)
    records = read_conversations(write_jsonl(tmp_path / "tools.jsonl", rows), strict=True)
    ours_template = ChatTemplate(tok, template)
    for i, (where, record) in enumerate(records):
        assert record.tools == [WEATHER, CLOCK]
        ours = tokenize_conversation(ours_template, record, source=where)
        assert ours.input_ids == theirs[i]["input_ids"]
        assert ours.labels == theirs[i]["labels"]
        scored = tok.decode([t for t, y in zip(ours.input_ids, ours.labels) if y != IGNORE_INDEX])
        for c in record[2]["tool_calls"]:
            assert f'"arguments": {{"city": "{c["function"]["arguments"]["city"]}"}}' in scored
        for m in record[3:-1]:
            assert m["content"] not in scored  # tool results are read, not learned
        assert '{"name": "get_time"' in tok.decode(ours.input_ids)  # the tools column reached the template


def test_json_string_arguments_and_tools_list_read_as_the_objects(tmp_path):
    """OpenAI's API sends ``arguments`` as a JSON string; they are decoded (as the server decodes a request's), so
    the row trains on the text it would be prompted with. A ``tools`` list and its JSON string read the same."""
    row = tool_rows(1, seed=2)[0]
    as_strings = json.loads(json.dumps(row))
    for c in as_strings["messages"][2]["tool_calls"]:
        c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
        c["id"] = "call_1"
    as_strings["tools"] = json.loads(row["tools"])
    (_, a), (_, b) = read_conversations(write_jsonl(tmp_path / "t.jsonl", [row, as_strings]), strict=True)
    template = ChatTemplate(chat_tokenizer(), CHATML_TRAINING_TEMPLATE)
    assert tokenize_conversation(template, a).input_ids == tokenize_conversation(template, b).input_ids
    assert b.tools == a.tools and b[2]["tool_calls"][0]["id"] == "call_1"


def test_training_text_is_what_the_server_prompts_and_parses(tmp_path):
    """The prompt ``minigpt serve`` builds for the conversation before a call (its ``parse_messages``, the saved
    ChatML with the request's tools) is the training row's text up to the call; the call as trained parses back
    (Hermes format) into the OpenAI call of the data."""
    from minigpt.serve.tools import parse_messages, parse_tool_calls, tool_format

    tok = chat_tokenizer()
    (_, record), = read_conversations(write_jsonl(tmp_path / "t.jsonl", tool_rows(1, seed=3)), strict=True)
    example = tokenize_conversation(ChatTemplate(tok, CHATML_TRAINING_TEMPLATE), record)
    request = json.loads(json.dumps(record[:2]))
    prompt = ChatTemplate(tok, CHATML_TEMPLATE).prompt(parse_messages(request), tools=record.tools)
    assert example.input_ids[:len(prompt)] == prompt
    first = next(i for i, y in enumerate(example.labels) if y != IGNORE_INDEX)
    assert first == len(prompt)  # the answer is scored from its first token
    answer = tok.decode(example.input_ids[first:]).split("<|im_end|>")[0]
    assert tool_format(CHATML_TEMPLATE) == "hermes"
    content, calls = parse_tool_calls(answer, ["get_weather", "get_time"])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in record[2]["tool_calls"]]
    assert content == (record[2]["content"] or None)


def test_a_template_that_leaves_the_tools_out_skips_those_rows(tmp_path):
    """A row with tools, calls or results cannot be trained with a template that does not write them: it is skipped
    as ``tools not rendered`` (``--strict``: an error naming the line), while plain rows still load."""
    tok = chat_tokenizer()
    plain_row = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    path = write_jsonl(tmp_path / "t.jsonl", tool_rows(2) + [plain_row])
    report = SkipReport()
    examples = load_chat_dataset(path, ChatTemplate(tok, PLAIN_TEMPLATE), 512, report=report)
    assert len(examples) == 1 and dict(report.skipped) == {"tools not rendered": 2}
    with pytest.raises(MiniGPTError, match=r"t\.jsonl:1: tools not rendered"):
        load_chat_dataset(path, ChatTemplate(tok, PLAIN_TEMPLATE), 512, strict=True)
    assert len(load_chat_dataset(path, ChatTemplate(tok, CHATML_TRAINING_TEMPLATE), 4096)) == 3


def test_rows_the_template_rejects_are_skipped_not_fatal(tmp_path):
    """A template's ``raise_exception`` (roles that must alternate, here) skips that row as ``template rejected``;
    before, the first such row ended the whole SFT run."""
    tok = chat_tokenizer()
    strict_roles = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
                    "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")
    rows = [{"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]},
            {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "Hi?"},
                          {"role": "assistant", "content": "Hello."}]}]
    report = SkipReport()
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    assert len(load_chat_dataset(path, ChatTemplate(tok, strict_roles), 512, report=report)) == 1
    assert dict(report.skipped) == {"template rejected": 1}
    with pytest.raises(MiniGPTError, match=r"t\.jsonl:2: .*roles must alternate"):
        load_chat_dataset(path, ChatTemplate(tok, strict_roles), 512, strict=True)


@pytest.mark.parametrize("change, reason", [
    (lambda r: r["messages"][2].update(tool_calls={"function": "x"}), "bad tool call"),
    (lambda r: r["messages"][2]["tool_calls"][0]["function"].update(arguments="{not json"), "bad tool call"),
    (lambda r: r["messages"][2]["tool_calls"][0]["function"].update(name=7), "bad tool call"),
    (lambda r: r["messages"][2]["tool_calls"][0].update(id=3), "bad tool call"),
    (lambda r: r.update(tools="[{"), "bad tools"),
    (lambda r: r.update(tools=["get_weather"]), "bad tools"),
    (lambda r: r["messages"][3].update(content={"temp": 3}), "content not text"),
    (lambda r: r["messages"][2].update(tool_calls=None, content=""), "empty content"),  # no call, no words
])
def test_malformed_tool_parts_are_skipped_with_their_reason(tmp_path, change, reason):
    bad = tool_rows(1)[0]
    change(bad)
    report = SkipReport()
    assert len(read_conversations(write_jsonl(tmp_path / "t.jsonl", [bad] + tool_rows(1)), report=report)) == 1
    assert dict(report.skipped) == {reason: 1}


def test_empty_tools_column_is_none_and_renders_no_preamble(tmp_path):
    """TRL passes ``tools or None``: an empty list renders as no tools at all."""
    row = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}], "tools": []}
    (_, record), = read_conversations(write_jsonl(tmp_path / "t.jsonl", [row]), strict=True)
    assert record.tools is None
    text = ChatTemplate(chat_tokenizer(), CHATML_TEMPLATE).render(record, tools=record.tools)
    assert text == "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"


def test_prompt_completion_rows_with_tools_as_trl(tmp_path):
    """TRL's conversational prompt-completion rows take the ``tools`` column too: the prompt is masked, the
    completion (a call, here) scored; ids and labels equal TRL's."""
    trl = pytest.importorskip("trl", reason="trl is a test-only dependency")
    datasets = pytest.importorskip("datasets", reason="datasets comes with trl")
    tok = chat_tokenizer()
    rows = [{"prompt": r["messages"][:2], "completion": [r["messages"][2]], "tools": r["tools"]} for r in tool_rows(4)]
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, bf16=False,
                         max_length=None, packing=False)
    theirs = trl.SFTTrainer(model=hf_copy(tiny_model(tok.vocab_size)), args=args,
                            train_dataset=datasets.Dataset.from_list(rows),
                            processing_class=transformers.AutoTokenizer.from_pretrained(
                                save_hf_tokenizer(tok, tmp_path / "tok", CHATML_TEMPLATE))).train_dataset
    records = read_conversations(write_jsonl(tmp_path / "pc.jsonl", rows), strict=True)
    for i, (_, record) in enumerate(records):
        ours = tokenize_conversation(ChatTemplate(tok, CHATML_TEMPLATE), record)
        assert (ours.input_ids, ours.labels) == (theirs[i]["input_ids"], theirs[i]["labels"])
        assert "<tool_call>" in tok.decode([t for t, y in zip(ours.input_ids, ours.labels) if y != IGNORE_INDEX])


def test_sft_cli_trains_on_tool_rows_and_saves_a_template_that_writes_tools(tmp_path, capsys):
    """``minigpt sft`` on tool rows over a base without a chat template: every row is used (none skipped), and the
    saved template renders the tools section the rows were trained with, which the server then reads as Hermes."""
    from minigpt.checkpoint.native import load_chat_template, load_tokenizer, save_pretrained
    from minigpt.cli import main

    tok = chat_tokenizer(with_chat_tokens=False)
    save_pretrained(tiny_model(tok.vocab_size, max_seq_len=1024), tmp_path / "base", tok)
    data = write_jsonl(tmp_path / "tools.jsonl", tool_rows(6, seed=4))
    assert main(["sft", "--model", str(tmp_path / "base"), "--data", str(data), "--out-dir", str(tmp_path / "out"),
                 "--max-steps", "2", "--batch-size", "2", "--device", "cpu"]) == 0
    assert f"{data}: 6 conversations" in capsys.readouterr().out
    saved = ChatTemplate(load_tokenizer(tmp_path / "out"), load_chat_template(tmp_path / "out"))
    assert "<tools>\n" + json.dumps(WEATHER) in saved.render([{"role": "user", "content": "Hi"}], tools=[WEATHER])


def test_preference_pairs_with_tools_tokenized_as_trl_dpo_trainer_does(tmp_path):
    """A pair that prefers a call to an answer: prompt, chosen and rejected ids equal TRL's DPOTrainer's, the
    ``tools`` column given to the template; with a template that leaves the tools out the pair is skipped."""
    trl = pytest.importorskip("trl", reason="trl is a test-only dependency")
    datasets = pytest.importorskip("datasets", reason="datasets comes with trl")
    from minigpt.data.preference import load_preference_dataset, read_preferences, tokenize_preference

    tok = chat_tokenizer()
    rows = [{"prompt": r["messages"][:2], "chosen": [r["messages"][2]],
             "rejected": [{"role": "assistant", "content": "I cannot know the weather."}], "tools": r["tools"]}
            for r in tool_rows(4, seed=5)]
    args = trl.DPOConfig(output_dir=str(tmp_path / "dpo"), report_to="none", use_cpu=True, bf16=False, max_length=None)
    model = tiny_model(tok.vocab_size)
    theirs = trl.DPOTrainer(model=hf_copy(model), ref_model=hf_copy(model), args=args,
                            train_dataset=datasets.Dataset.from_list(rows),
                            processing_class=transformers.AutoTokenizer.from_pretrained(
                                save_hf_tokenizer(tok, tmp_path / "tok", CHATML_TEMPLATE))).train_dataset
    path = write_jsonl(tmp_path / "prefs.jsonl", rows)
    records = read_preferences(path, strict=True)
    for i, record in enumerate(records):
        assert record.tools == [WEATHER, CLOCK]
        pair = tokenize_preference(ChatTemplate(tok, CHATML_TEMPLATE), record)
        assert (pair.prompt_ids, pair.chosen_ids, pair.rejected_ids) == (
            theirs[i]["prompt_ids"], theirs[i]["chosen_ids"], theirs[i]["rejected_ids"])
        assert "<tool_call>\n{\"name\": \"get_weather\"" in tok.decode(pair.chosen_ids)
    report = SkipReport()
    with pytest.raises(MiniGPTError, match="no usable preference pair"):
        load_preference_dataset(path, ChatTemplate(tok, PLAIN_TEMPLATE), 4096, report=report)
    assert dict(report.skipped) == {"tools not rendered": 4}


def test_llama_factory_sharegpt_tool_rows_read_as_the_openai_row(tmp_path):
    """LLaMA-Factory's ShareGPT layout with tools (``function_call`` / ``observation`` turns, a top-level ``system``
    and a ``tools`` JSON string) reads as the same conversation as its OpenAI ``messages`` twin."""
    row = tool_rows(1, seed=6)[0]
    m = row["messages"]
    calls = [c["function"] for c in m[2]["tool_calls"]]
    sharegpt = {"system": m[0]["content"], "tools": row["tools"],
                "conversations": [{"from": "human", "value": m[1]["content"]},
                                  {"from": "function_call", "value": json.dumps(calls if len(calls) > 1 else calls[0])}]
                + [{"from": "observation", "value": t["content"]} for t in m[3:-1]]
                + [{"from": "gpt", "value": m[-1]["content"]}]}
    m[2]["content"] = ""
    (_, ours), (_, theirs) = read_conversations(write_jsonl(tmp_path / "t.jsonl", [row, sharegpt]), strict=True)
    assert theirs == ours and theirs.tools == ours.tools
    bad = dict(sharegpt, conversations=sharegpt["conversations"][:1] + [{"from": "function_call", "value": "{x"}])
    report = SkipReport()
    read_conversations(write_jsonl(tmp_path / "bad.jsonl", [bad]), report=report)
    assert dict(report.skipped) == {"bad tool call": 1}


def test_template_chatml_trains_tool_rows_on_a_model_whose_template_has_no_tools(tmp_path, capsys):
    """A model saved with a ChatML that writes no tools (as SFT outputs were before): its tool rows are all skipped,
    in one error line that names ``--template chatml``; with that flag they train, and the saved template writes
    tools."""
    from minigpt.checkpoint.native import load_chat_template, save_pretrained
    from minigpt.cli import main

    tok = chat_tokenizer()
    save_pretrained(tiny_model(tok.vocab_size, max_seq_len=1024), tmp_path / "base", tok, OLD_CHATML)
    data = write_jsonl(tmp_path / "tools.jsonl", tool_rows(4, seed=7))
    args = ["sft", "--model", str(tmp_path / "base"), "--data", str(data), "--max-steps", "1", "--batch-size", "2",
            "--device", "cpu"]
    assert main(args + ["--out-dir", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert "tools not rendered 4" in err and "no usable conversation; train with a template that writes tools (--template chatml" in err
    assert main(args + ["--out-dir", str(tmp_path / "b"), "--template", "chatml"]) == 0
    assert f"{data}: 4 conversations" in capsys.readouterr().out
    assert load_chat_template(tmp_path / "b") == CHATML_TEMPLATE


def test_dpo_cli_trains_on_pairs_that_prefer_a_call(tmp_path, capsys):
    """``minigpt dpo`` on pairs whose chosen answer is a call and rejected one a refusal, the ``tools`` column
    given: every pair is used, and the reward margin is logged."""
    from minigpt.checkpoint.native import save_pretrained
    from minigpt.cli import main

    tok = chat_tokenizer(with_chat_tokens=False)
    save_pretrained(tiny_model(tok.vocab_size, max_seq_len=1024), tmp_path / "base", tok)
    rows = [{"prompt": r["messages"][:2], "chosen": [{**r["messages"][2], "content": None}],  # a call, no words
             "rejected": [{"role": "assistant", "content": "I cannot know that."}], "tools": r["tools"]}
            for r in tool_rows(4, seed=8)]
    data = write_jsonl(tmp_path / "prefs.jsonl", rows)
    assert main(["dpo", "--model", str(tmp_path / "base"), "--data", str(data), "--out-dir", str(tmp_path / "out"),
                 "--max-steps", "2", "--batch-size", "2", "--device", "cpu"]) == 0
    assert f"{data}: 4 pairs" in capsys.readouterr().out
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert "rewards/margins" in logged[-1]



def test_conversations_without_tools_render_as_the_chatml_before_tools():
    """Writing tools changed nothing else: every tool-free conversation renders to the same text and the same
    assistant spans as the templates minigpt saved before, with and without the generation prompt."""
    from chat_helpers import conversations

    tok = chat_tokenizer()
    for new, old in ((CHATML_TEMPLATE, OLD_CHATML), (CHATML_TRAINING_TEMPLATE, OLD_CHATML_TRAINING)):
        new, old = ChatTemplate(tok, new), ChatTemplate(tok, old)
        for messages in conversations(12, seed=9) + [[{"role": "user", "content": "x"}]]:
            for add_generation_prompt in (False, True):
                assert new.render(messages, add_generation_prompt) == old.render(messages, add_generation_prompt)
            if any(m["role"] == "assistant" for m in messages):
                assert new.render_with_spans(messages) == old.render_with_spans(messages)
