"""Chat templates, chat data and loss masking, packing and new special tokens."""
import json
import random

import pytest
import torch
from chat_helpers import chat_tokenizer, conversation, conversations, hf_copy, save_hf_tokenizer, sentence, tiny_model

from minigpt.data.chat import IGNORE_INDEX, SkipReport, load_chat_dataset, read_conversations, tokenize_conversation
from minigpt.data.chat_batches import masked_lm_loss, pack_examples, packed_batch, pad_batch, token_losses
from minigpt.data.preference import read_preferences
from minigpt.errors import MiniGPTError
from minigpt.posttrain.packing import packed_forward
from minigpt.posttrain.vocab import add_chat_tokens
from minigpt.tokenizer.chat_template import CHATML_TEMPLATE, CHATML_TRAINING_TEMPLATE, IM_END, IM_START, ChatTemplate

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (pip install .[dev])")


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, CHATML_TRAINING_TEMPLATE], ids=["plain", "training"])
def test_chatml_ids_equal_transformers_apply_chat_template(tmp_path, tokenizer, template):
    ref = transformers.AutoTokenizer.from_pretrained(save_hf_tokenizer(tokenizer, tmp_path / "tok", template))
    ours = ChatTemplate(tokenizer, template)
    for messages in conversations(12, seed=1) + [[{"role": "user", "content": f"x {IM_END} y"},
                                                  {"role": "assistant", "content": "\n\n  spaced  "}]]:
        for add_generation_prompt in (False, True):
            expected = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
            assert ours.encode(messages, add_generation_prompt) == expected["input_ids"]
            assert ours.render(messages, add_generation_prompt) == ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    rendered = ours.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_assistant_mask_equals_transformers(tmp_path, tokenizer):
    """Generation blocks give the same assistant mask as transformers' return_assistant_tokens_mask; the plain
    template (prefix rendering) labels the same tokens plus the newline after each <|im_end|>."""
    ref = transformers.AutoTokenizer.from_pretrained(
        save_hf_tokenizer(tokenizer, tmp_path / "tok", CHATML_TRAINING_TEMPLATE))
    training, plain = ChatTemplate(tokenizer, CHATML_TRAINING_TEMPLATE), ChatTemplate(tokenizer, CHATML_TEMPLATE)
    newline = tokenizer.encode("\n")
    assert len(newline) == 1
    for messages in conversations(10, seed=2):
        expected = ref.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = training.encode_with_mask(messages)
        assert ids == expected["input_ids"] and [int(m) for m in mask] == expected["assistant_masks"]
        end = tokenizer.token_to_id(IM_END)
        closing = [i for i, (t, m) in enumerate(zip(ids, mask)) if m and t == end]
        assert len(closing) == sum(m["role"] == "assistant" for m in messages)  # every <|im_end|> of a reply
        ids2, mask2 = plain.encode_with_mask(messages)
        assert ids2 == ids
        assert [a or (b and t == newline[0]) for a, b, t in zip(mask, mask2, ids)] == mask2


def test_labels_and_train_on_prompt(tokenizer):
    template = ChatTemplate(tokenizer, CHATML_TRAINING_TEMPLATE)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello there"}]
    ex = tokenize_conversation(template, messages)
    scored = [t for t, y in zip(ex.input_ids, ex.labels) if y != IGNORE_INDEX]
    assert tokenizer.decode(scored) == "hello there" + IM_END
    assert all(y in (IGNORE_INDEX, t) for t, y in zip(ex.input_ids, ex.labels))
    full = tokenize_conversation(template, messages, train_on_prompt=True)
    assert full.labels == full.input_ids


def test_loss_gradient_is_zero_off_assistant_tokens(tokenizer):
    template = ChatTemplate(tokenizer, CHATML_TRAINING_TEMPLATE)
    batch = pad_batch([tokenize_conversation(template, m) for m in conversations(3, seed=3)], tokenizer.pad_id)
    logits = torch.randn(*batch.tokens.shape, tokenizer.vocab_size, requires_grad=True)
    masked_lm_loss(logits, batch.labels).backward()
    scored = torch.zeros(batch.tokens.shape, dtype=torch.bool)
    scored[:, :-1] = batch.labels[:, 1:] != IGNORE_INDEX  # logits at t predict labels[t + 1]
    grad_norm = logits.grad.abs().sum(-1)
    assert torch.all(grad_norm[~scored] == 0)
    assert torch.all(grad_norm[scored] > 0)


def test_masked_loss_equals_transformers_llama_loss(tokenizer):
    template = ChatTemplate(tokenizer, CHATML_TRAINING_TEMPLATE)
    batch = pad_batch([tokenize_conversation(template, m) for m in conversations(4, seed=4)], tokenizer.pad_id)
    model = tiny_model(tokenizer.vocab_size, tie_embeddings=False)
    ref = hf_copy(model)
    with torch.no_grad():
        ours = masked_lm_loss(model(batch.tokens), batch.labels)
        theirs = ref(input_ids=batch.tokens, labels=batch.labels).loss
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kw", [dict(), dict(attention_impl="naive", n_kv_heads=1)], ids=["sdpa", "naive-mqa"])
def test_packed_equals_unpacked_conversation_by_conversation(tokenizer, kw):
    template = ChatTemplate(tokenizer, CHATML_TRAINING_TEMPLATE)
    examples = [tokenize_conversation(template, m, train_on_prompt=True) for m in conversations(7, seed=5, turns=1)]
    model = tiny_model(tokenizer.vocab_size, **kw)
    rows = pack_examples(examples, 256)
    assert any(len(row) > 1 for row in rows) and sorted(i for row in rows for i in row) == list(range(7))
    batch = packed_batch([[examples[i] for i in row] for row in rows], tokenizer.pad_id, seq_len=256)
    with torch.no_grad():
        logits = packed_forward(model, batch.tokens, batch.position_ids, batch.doc_ids)
        packed_losses = token_losses(logits, batch.labels)
        alone_sum, alone_n = 0.0, 0
        for r, row in enumerate(rows):
            start = 0
            for i in row:
                ids = torch.tensor([examples[i].input_ids])
                alone = model(ids)
                end = start + ids.shape[1]
                torch.testing.assert_close(logits[r, start:end], alone[0], atol=1e-5, rtol=0)
                labels = torch.tensor([examples[i].labels])
                losses = token_losses(alone, labels)[0]
                torch.testing.assert_close(packed_losses[r, start:end - 1], losses, atol=1e-5, rtol=0)
                alone_sum += losses.sum().item()
                alone_n += int((labels[0, 1:] != IGNORE_INDEX).sum())
                start = end
        torch.testing.assert_close(masked_lm_loss(logits, batch.labels).item(), alone_sum / alone_n, atol=1e-5, rtol=0)
    assert batch.padding_fraction == pytest.approx(1 - sum(map(len, examples)) / batch.tokens.numel())


def test_packing_refuses_models_without_rope(tokenizer):
    model = tiny_model(tokenizer.vocab_size, pos_encoding="alibi")
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(MiniGPTError, match="--no-pack"):
        packed_forward(model, tokens, tokens, tokens)


def write_jsonl(path, lines):
    path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l, ensure_ascii=False) for l in lines) + "\n",
                    encoding="utf-8")
    return path


def test_formats_converted_and_bad_lines_counted(tmp_path, tokenizer):
    long_reply = " ".join(["word"] * 400)
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                      {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"},
                      {"role": "assistant", "content": "a2"}]},
        {"instruction": "Add", "input": "1 and 2", "output": "3"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
        {"conversations": [{"from": "human", "value": "你好"}, {"from": "gpt", "value": "你好！"}]},
        "{not json",
        {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": long_reply}]},
        {"conversations": [{"from": "robot", "value": "x"}]},
    ])
    convs = read_conversations(path, report=SkipReport())
    assert convs[1][1] == [{"role": "user", "content": "Add\n\n1 and 2"}, {"role": "assistant", "content": "3"}]
    assert convs[2][1][0]["content"] == "Say hi"
    assert convs[3][1] == [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "你好！"}]
    assert convs[0][0].endswith("mixed.jsonl:1")
    report = SkipReport()
    examples = load_chat_dataset(path, ChatTemplate(tokenizer, CHATML_TRAINING_TEMPLATE), 128, report=report)
    assert len(examples) == 4
    assert dict(report.skipped) == {"invalid JSON": 1, "unknown role": 2, "no assistant turn": 1, "empty content": 1,
                                    "too long": 1}
    assert report.summary("mixed.jsonl") == ("mixed.jsonl: 4 conversations, 6 skipped (empty content 1, invalid JSON "
                                             "1, no assistant turn 1, too long 1, unknown role 2)")
    with pytest.raises(MiniGPTError) as e:
        load_chat_dataset(path, ChatTemplate(tokenizer), 128, strict=True)
    assert f"{path}:5: invalid JSON" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(MiniGPTError, match="mixed.jsonl:9: too long"):
        load_chat_dataset(write_jsonl(tmp_path / "mixed.jsonl", [
            *[{"instruction": "a", "output": "b"}] * 8, {"instruction": "q", "output": long_reply}]),
            ChatTemplate(tokenizer), 128, strict=True)


def test_adding_chat_tokens_resizes_embeddings_with_the_mean(tokenizer):
    base_tok = chat_tokenizer(with_chat_tokens=False)
    assert base_tok.token_to_id(IM_START) is None
    for tie in (True, False):
        model = tiny_model(base_tok.vocab_size, tie_embeddings=tie)
        old_emb = model.tok_embeddings.weight.detach().clone()
        old_head = model.output.weight.detach().clone()
        x = torch.randint(0, base_tok.vocab_size, (1, 10))
        with torch.no_grad():
            before = model(x)
        tok, new_ids = add_chat_tokens(model, base_tok)
        assert new_ids == [base_tok.vocab_size, base_tok.vocab_size + 1] and tok.vocab_size == base_tok.vocab_size + 2
        assert model.config.vocab_size == tok.vocab_size and model.tok_embeddings.weight.shape[0] == tok.vocab_size
        assert torch.equal(model.tok_embeddings.weight[: len(old_emb)], old_emb)
        for i in new_ids:
            torch.testing.assert_close(model.tok_embeddings.weight[i], old_emb.mean(0))
            torch.testing.assert_close(model.output.weight[i], old_head.mean(0))
        assert (model.output.weight is model.tok_embeddings.weight) == tie
        with torch.no_grad():
            torch.testing.assert_close(model(x)[..., : base_tok.vocab_size], before)
        ids = ChatTemplate(tok).encode([{"role": "user", "content": "hi"}])
        assert ids[0] == tok.token_to_id(IM_START) and tok.token_to_id(IM_END) in ids
        assert tok.encode(IM_START) != [tok.token_to_id(IM_START)]  # plain text stays text
    assert add_chat_tokens(tiny_model(tokenizer.vocab_size), tokenizer)[1] == []


def test_content_that_is_not_a_string_and_a_directory_as_data_say_so(tmp_path):
    """``"content": 5`` (or a content part that is not text) was counted as "empty content"; a directory given as
    the data file was reported as not existing."""
    path = tmp_path / "odd.jsonl"
    image = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x.png"}}]
    path.write_text(json.dumps({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]})
                    + "\n" + json.dumps({"messages": [{"role": "user", "content": image},
                                                      {"role": "assistant", "content": "y"}]}) + "\n")
    report = SkipReport()
    assert read_conversations(path, report=report) == []
    assert dict(report.skipped) == {"content not text": 2}
    with pytest.raises(MiniGPTError, match="user message's content is a JSON int, not a string"):
        read_conversations(path, strict=True)
    path.write_text(path.read_text().splitlines()[1] + "\n")
    with pytest.raises(MiniGPTError, match="a content part of type 'image_url'; only text parts are read"):
        read_conversations(path, strict=True)
    with pytest.raises(MiniGPTError, match="is a directory; give a .jsonl file"):
        read_conversations(tmp_path)


def test_openai_text_parts_are_read_as_their_joined_text(tmp_path):
    """The chat completions API's list form of a message's content (text parts), as exported conversations keep
    it, reads as the string it stands for, in SFT data and in DPO pairs; it was skipped as "content not text"."""
    parts = [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]
    path = tmp_path / "parts.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": parts},
                                             {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]})
                    + "\n")
    (_, messages), = read_conversations(path, strict=True)
    assert messages == [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": [{"role": "user", "content": parts}],
                                 "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "Red."}]}],
                                 "rejected": [{"role": "assistant", "content": "No."}]}) + "\n")
    record, = read_preferences(pairs, strict=True)
    assert record.prompt == [{"role": "user", "content": "Name a colour."}]
    assert record.chosen == [{"role": "assistant", "content": "Red."}]


def _prompt_completion_rows(layout, n=6, seed=3):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        if layout == "standard":
            words = sentence(rng, rng.randint(2, 5)).split()
            rows.append({"prompt": " ".join(words), "completion": " " + " ".join(reversed(words))})
        elif layout == "text":  # TRL's standard language modeling: every token scored
            rows.append({"text": sentence(rng, rng.randint(3, 9))})
        else:
            history = conversation(rng, turns=rng.randint(1, 2), system=rng.random() < 0.5)
            rows.append({"prompt": history[:-1], "completion": history[-1:]})
    return rows


@pytest.mark.parametrize("layout", ["standard", "conversational", "text"])
def test_trl_layouts_tokenized_as_trl_sft_trainer_does(tmp_path, layout):
    """TRL's prompt-completion layout: TRL's SFTTrainer tokenizes the rows (its EOS appended to standard
    completions, the chat template with the generation prompt for the prompt of conversational ones) and builds
    labels that mask the prompt (its ``completion_only_loss``); our ids and labels equal its ``input_ids`` and
    ``labels``; so for its language-modeling rows (``{"text"}``: EOS appended, every token scored). Before, these
    rows were skipped as an unknown layout."""
    trl = pytest.importorskip("trl", reason="trl is a test-only dependency")
    datasets = pytest.importorskip("datasets", reason="datasets comes with trl")
    tok = chat_tokenizer()
    rows = _prompt_completion_rows(layout)
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, bf16=False,
                         max_length=None, packing=False)
    trainer = trl.SFTTrainer(model=hf_copy(tiny_model(tok.vocab_size)), args=args,
                             train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=transformers.AutoTokenizer.from_pretrained(
                                 save_hf_tokenizer(tok, tmp_path / "tok")))
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = read_conversations(path, strict=True)
    assert len(records) == len(rows)
    template = ChatTemplate(tok, CHATML_TEMPLATE)
    for i, (where, record) in enumerate(records):
        theirs = trainer.train_dataset[i]
        ours = tokenize_conversation(template, record, source=where)
        assert ours.input_ids == theirs["input_ids"]
        assert ours.labels == theirs["labels"] and ours.n_targets > 0
        assert (ours.labels == ours.input_ids) == (layout == "text")  # else the prompt is masked
        everything = tokenize_conversation(template, record, train_on_prompt=True)
        assert everything.labels == everything.input_ids == ours.input_ids


@pytest.mark.parametrize("row, reason", [
    ({"prompt": "Hi", "completion": ""}, "empty content"),
    ({"prompt": "Hi", "completion": [{"role": "assistant", "content": "x"}]}, "unknown format"),
    ({"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "user", "content": "x"}]},
     "no assistant turn"),
    ({"prompt": [], "completion": [{"role": "assistant", "content": "x"}]}, "unknown format"),
    ({"text": " "}, "empty content"),
    ({"text": "Hi", "messages": []}, "no assistant turn"),  # read as messages, not text
    ({"prompt": [{"role": "robot", "content": "Hi"}], "completion": [{"role": "assistant", "content": "x"}]},
     "unknown role"),
])
def test_unusable_prompt_completion_rows_are_skipped_with_their_reason(tmp_path, row, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({"prompt": "Hi", "completion": " there"}) + "\n")
    report = SkipReport()
    assert len(read_conversations(path, report=report)) == 1
    assert dict(report.skipped) == {reason: 1}


def test_standard_rows_start_with_bos_where_the_tokenizer_adds_one_as_trl(tmp_path, shared_data):
    """A Llama SentencePiece tokenizer prepends BOS to plain text (``tokenizer(text)``, which TRL 1.x's SFT and
    DPO trainers call for standard rows): our standard prompt-completion, text and preference rows start with it
    too, and equal TRL's ids and labels. (TRL appends EOS as the text ``</s>``: our export writes
    ``split_special_tokens``, under which that text is characters, so TRL is given the tokenizer without it; ours
    appends the EOS id, which has no text in SentencePiece.)"""
    trl = pytest.importorskip("trl", reason="trl is a test-only dependency")
    datasets = pytest.importorskip("datasets", reason="datasets comes with trl")
    from minigpt.checkpoint.convert import export_hf
    from minigpt.checkpoint.native import load_tokenizer
    from minigpt.checkpoint.tokenizer_bos import adds_bos
    from minigpt.data.chat import to_record
    from minigpt.data.preference import PreferenceRecord, to_preference, tokenize_preference

    hf_dir = export_hf(shared_data / "models" / "stories260K" / "stories260K.bin", tmp_path / "hf")
    tok = load_tokenizer(hf_dir)
    assert adds_bos(hf_dir, tok) and tok.decode([tok.eos_id]) == ""
    template = ChatTemplate(tok)
    theirs_tok = transformers.AutoTokenizer.from_pretrained(hf_dir, split_special_tokens=False)
    rows = [{"prompt": "Once upon a time", "completion": " there was a cat."}, {"text": "The dog ran home."}]
    for i, row in enumerate(rows):
        args = trl.SFTConfig(output_dir=str(tmp_path / f"trl{i}"), report_to="none", use_cpu=True, bf16=False,
                             max_length=None, packing=False)
        theirs = trl.SFTTrainer(model=hf_copy(tiny_model(tok.vocab_size)), args=args,
                                train_dataset=datasets.Dataset.from_list([row]),
                                processing_class=theirs_tok).train_dataset[0]
        ours = tokenize_conversation(template, to_record(row), bos_id=tok.bos_id)
        assert (ours.input_ids, ours.labels) == (theirs["input_ids"], theirs["labels"])
        assert ours.input_ids[0] == tok.bos_id and ours.input_ids[-1] == tok.eos_id
        assert tokenize_conversation(template, to_record(row)).input_ids == ours.input_ids[1:]  # no bos_id: none
    row = {"prompt": "Once upon a time", "chosen": " a cat.", "rejected": " a"}
    args = trl.DPOConfig(output_dir=str(tmp_path / "dpo"), report_to="none", use_cpu=True, bf16=False,
                         max_length=None)
    model = tiny_model(tok.vocab_size)
    theirs = trl.DPOTrainer(model=hf_copy(model), ref_model=hf_copy(model), args=args,
                            train_dataset=datasets.Dataset.from_list([row]),
                            processing_class=theirs_tok).train_dataset[0]
    pair = tokenize_preference(template, PreferenceRecord(*to_preference(row)), "", tok.eos_id, tok.bos_id)
    assert (pair.prompt_ids, pair.chosen_ids, pair.rejected_ids) == (
        theirs["prompt_ids"], theirs["chosen_ids"], theirs["rejected_ids"])
    assert pair.prompt_ids[0] == tok.bos_id
