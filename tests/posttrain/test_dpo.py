"""DPO / IPO: parity with TRL's DPOTrainer, the formulas by hand, the reference (live, precomputed, LoRA with adapters
disabled), preference data loading and errors, and `minigpt dpo` end to end on tiny synthetic pairs."""
import contextlib
import json
import math
import random

import pytest
import torch
from chat_helpers import (
    assert_same_run,
    chat_tokenizer,
    crash_after,
    hf_copy,
    record_results,
    save_hf_tokenizer,
    sentence,
    tiny_model,
)
from conftest import assert_one_line_error, run_cli

from minigpt.checkpoint.adapter import CONFIG_NAME, load_adapter
from minigpt.checkpoint.native import load_model, load_tokenizer, save_pretrained
from minigpt.data.chat import SkipReport
from minigpt.data.preference import (
    PreferenceRecord,
    load_preference_dataset,
    pad_pairs,
    read_preferences,
    to_preference,
    tokenize_preference,
)
from minigpt.errors import MiniGPTError
from minigpt.interop.hf import to_hf_key
from minigpt.model.lora import adapters_disabled, apply_lora, lora_layers
from minigpt.posttrain.dpo import DPO, METRICS, DPOConfig, Reference, batch_loss, dpo, dpo_loss
from minigpt.tokenizer.chat_template import CHATML_TEMPLATE, ChatTemplate

NULL = contextlib.nullcontext  # the autocast context factory of a float32 run


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def standard_rows(n, seed):
    """String pairs whose chosen answer is the prompt's words reversed and the rejected one random words."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = sentence(rng, rng.randint(2, 5)).split()
        rows.append({"prompt": " ".join(words), "chosen": " " + " ".join(reversed(words)),
                     "rejected": " " + sentence(rng, rng.randint(1, 6))})
    return rows


def conversational_rows(n, seed):
    """The same task as chat: message-list prompts (some with a system turn, some multi-turn), one-message answers."""
    rows = []
    for i, row in enumerate(standard_rows(n, seed)):
        prompt = [{"role": "user", "content": row["prompt"] + "?"}]
        if i % 3 == 1:
            prompt.insert(0, {"role": "system", "content": "answer briefly"})
        if i % 3 == 2:
            prompt = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "sure"}] + prompt
        rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": row["chosen"].strip()}],
                     "rejected": [{"role": "assistant", "content": row["rejected"].strip()}]})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def tokenize_rows(tokenizer, rows):
    template = ChatTemplate(tokenizer, CHATML_TEMPLATE)
    eos = tokenizer.decode([tokenizer.eos_id])
    return [tokenize_preference(template, PreferenceRecord(*to_preference(r)), eos) for r in rows]


# ---------------------------------------------------------------------------------------- the loss
def test_dpo_and_ipo_losses_by_hand():
    """One pair from the formulas: DPO eq. 7 of Rafailov et al. 2023, IPO eq. 17 of Azar et al. 2023 with TRL's
    per-token averaging of the log-ratios."""
    pi_c, pi_r, ref_c, ref_r, beta = -5.0, -7.0, -6.0, -6.5, 0.1
    t = lambda x: torch.tensor([x])  # noqa: E731
    losses, chosen, rejected = dpo_loss(t(pi_c), t(pi_r), t(ref_c), t(ref_r), beta)
    logits = beta * ((pi_c - ref_c) - (pi_r - ref_r))  # 0.1 * (1 - (-0.5)) = 0.15
    assert losses.item() == pytest.approx(math.log(1 + math.exp(-logits)), abs=1e-6)
    assert chosen.item() == pytest.approx(0.1) and rejected.item() == pytest.approx(-0.05)
    losses, _, _ = dpo_loss(t(pi_c), t(pi_r), t(ref_c), t(ref_r), beta, "ipo", t(4), t(2))
    h = (pi_c - ref_c) / 4 - (pi_r - ref_r) / 2  # 0.25 + 0.25
    assert losses.item() == pytest.approx((h - 1 / (2 * beta)) ** 2, abs=1e-5) == pytest.approx(20.25)
    with pytest.raises(MiniGPTError, match="hinge"):
        dpo_loss(t(pi_c), t(pi_r), t(ref_c), t(ref_r), beta, "hinge")


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "sigmoid+sft"])
@pytest.mark.parametrize("layout", ["standard", "conversational"])
def test_parity_with_trl_dpo_trainer(tmp_path, tokenizer, loss_type, layout):
    """The same tiny Llama (policy) and another (reference) in MiniGPT and transformers; TRL's DPOTrainer tokenizes
    the pairs, collates them and computes the loss and its logged metrics: ours equal them in float32, and so do the
    gradients. "sigmoid+sft": TRL's loss_type ["sigmoid", "sft"] with loss_weights [1, 0.7], ours sft_weight 0.7."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    trl = pytest.importorskip("trl", reason="trl is a test-only dependency")
    datasets = pytest.importorskip("datasets", reason="datasets comes with trl")
    rows = (standard_rows if layout == "standard" else conversational_rows)(6, seed=1)
    policy, ref = tiny_model(tokenizer.vocab_size, seed=0), tiny_model(tokenizer.vocab_size, seed=4)
    loss_type, sft_weight = ("sigmoid", 0.7) if loss_type == "sigmoid+sft" else (loss_type, 0.0)
    weights = dict(loss_type=[loss_type, "sft"], loss_weights=[1.0, sft_weight]) if sft_weight else \
        dict(loss_type=[loss_type])
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.2, report_to="none", **weights,
                         use_cpu=True, bf16=False, max_length=None, per_device_train_batch_size=len(rows))
    trainer = trl.DPOTrainer(model=hf_copy(policy), ref_model=hf_copy(ref), args=args,
                             train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=transformers.AutoTokenizer.from_pretrained(
                                 save_hf_tokenizer(tokenizer, tmp_path / "tok")))
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    pairs = tokenize_rows(tokenizer, rows)
    for theirs, ours in zip(examples, pairs):
        assert (ours.prompt_ids, ours.chosen_ids, ours.rejected_ids) == (
            theirs["prompt_ids"], theirs["chosen_ids"], theirs["rejected_ids"])
    trainer.model.train()
    expected_loss = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
    expected = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    policy.train()
    loss, values = batch_loss(policy, Reference(policy, ref), pad_pairs(pairs, tokenizer.pad_id), "train", 0.2,
                              loss_type, NULL, sft_weight)
    torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-6)
    for k in METRICS[1:]:
        assert values[k].mean().item() == pytest.approx(expected[k], abs=1e-5, rel=1e-6), k
    assert 0 < expected["rewards/accuracies"] < 1  # both outcomes occur: the comparison is informative
    loss.backward()
    expected_loss.backward()
    theirs = dict(trainer.model.named_parameters())
    for name, p in policy.named_parameters():
        torch.testing.assert_close(p.grad, theirs[to_hf_key(name)].grad, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------- the reference
def test_precomputed_reference_equals_live_reference(tmp_path, tokenizer, base):
    """Five steps with --precompute-ref log the same metrics and end at the same weights as with a frozen copy."""
    rows = conversational_rows(12, seed=2)
    train, val = write_jsonl(tmp_path / "t.jsonl", rows), write_jsonl(tmp_path / "v.jsonl", rows[:5])
    for precompute in (False, True):
        dpo(DPOConfig(model=str(base[0]), data=str(train), val_data=str(val), out_dir=str(tmp_path / f"o{precompute}"),
                      max_steps=5, batch_size=4, lr=1e-2, log_interval=1, device="cpu", precompute_ref=precompute))
    live, pre = load_model(tmp_path / "oFalse"), load_model(tmp_path / "oTrue")
    for (name, a), b in zip(live.named_parameters(), pre.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
    assert not torch.equal(live.layers[0].attention.wq.weight, load_model(base[0]).layers[0].attention.wq.weight)
    pairs = tokenize_rows(tokenizer, rows)
    model = tiny_model(tokenizer.vocab_size, seed=0)
    reference = Reference(model)
    reference.precompute("train", pairs, 5, tokenizer.pad_id, torch.device("cpu"), NULL)
    batch = pad_pairs([pairs[i] for i in (7, 2, 11)], tokenizer.pad_id, [7, 2, 11])
    torch.testing.assert_close(reference(batch, "train", NULL), reference.live(batch, NULL), atol=1e-5, rtol=0)


def test_metrics_rows_equal_with_precomputed_reference(tmp_path, base):
    rows = standard_rows(10, seed=3)
    train, val = write_jsonl(tmp_path / "t.jsonl", rows), write_jsonl(tmp_path / "v.jsonl", rows[:4])
    logged = []
    for precompute in (False, True):
        out = tmp_path / f"o{precompute}"
        dpo(DPOConfig(model=str(base[0]), data=str(train), val_data=str(val), out_dir=str(out), max_steps=4,
                      batch_size=3, lr=1e-2, log_interval=1, precompute_ref=precompute, device="cpu", loss="ipo"))
        logged.append(metrics(out))
    assert len(logged[0]) == len(logged[1]) == 4
    for a, b in zip(*logged):
        for k in METRICS + tuple(f"val_{m}" for m in METRICS):
            if k in a:
                assert a[k] == pytest.approx(b[k], abs=1e-5), k


def test_adapters_disabled_gives_the_base_model(tokenizer):
    model = tiny_model(tokenizer.vocab_size)
    x = torch.randint(0, tokenizer.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(x)
        apply_lora(model, lora_rank=2, lora_alpha=4, targets="all-linear")
        for layer in lora_layers(model).values():
            layer.lora_B.weight.normal_()
        adapted = model(x)
        with adapters_disabled(model):
            assert torch.equal(model(x), base)
        assert torch.equal(model(x), adapted) and not torch.equal(adapted, base)
        with pytest.raises(RuntimeError), adapters_disabled(model):
            raise RuntimeError("restored even so")
        assert torch.equal(model(x), adapted)


class TrainedModel(DPO):
    """The DPO recipe, keeping a copy of the trained model as it is before the output merges its adapters."""

    def finish(self, result):
        self.trained = {name: t.detach().clone() for name, t in self.model.state_dict().items()}
        self.frozen = {name for name, p in self.model.named_parameters() if not p.requires_grad}
        self.dropout = [layer.lora_dropout.p for layer in lora_layers(self.model).values()]
        return super().finish(result)


def test_lora_dpo_leaves_the_base_weights_bit_identical(tmp_path, base):
    model_dir, train, _ = base
    recipe = TrainedModel(DPOConfig(model=str(model_dir), data=str(train), out_dir=str(tmp_path / "out"),
                                    max_steps=6, batch_size=4, lr=5e-2, log_interval=1, device="cpu", lora_rank=4,
                                    lora_alpha=8, lora_targets="all-linear", lora_dropout=0.1))
    recipe.run()
    start = load_model(model_dir).state_dict()
    base_weights = {n: t for n, t in recipe.trained.items() if "lora_" not in n}
    assert recipe.frozen and set(recipe.frozen) <= set(base_weights)
    assert all(torch.equal(t, start[n.replace(".base_layer", "")]) for n, t in base_weights.items())
    lora_b = [t for n, t in recipe.trained.items() if n.endswith("lora_B.weight")]
    assert len(lora_b) == 14 and all(torch.count_nonzero(t) > 0 for t in lora_b)
    assert recipe.dropout == [0.0] * 14  # DPO disables dropout
    assert recipe.last_row["rewards/margins"] > 0


def test_dpo_resume_reproduces_the_uninterrupted_run(tmp_path, base):
    """Six steps in one go, and the same run killed after its step-3 checkpoint and resumed with --resume: the same
    weights, bit for bit, and the same metrics rows."""
    model_dir, train, val = base
    config = dict(model=str(model_dir), data=str(train), val_data=str(val), max_steps=6, batch_size=4, lr=1e-2,
                  log_interval=1, eval_interval=3, ckpt_interval=3, keep_checkpoints=5, device="cpu")
    dpo(DPOConfig(**config, out_dir=str(tmp_path / "full")))
    crashed = crash_after(tmp_path / "full", tmp_path / "crashed", 3)
    dpo(DPOConfig(**config, out_dir=str(crashed), resume=True))
    assert_same_run(tmp_path / "full", crashed)


# ---------------------------------------------------------------------------------------- data
def test_preference_layouts():
    user = [{"role": "user", "content": "q"}]
    answer = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    assert to_preference({"prompt": "a b", "chosen": " c", "rejected": " d"}) == ("a b", " c", " d")
    assert to_preference({"prompt": user, "chosen": answer("c"), "rejected": answer("d")}) == (
        user, answer("c"), answer("d"))
    # shared/data/dpo's layout: a message-list prompt with plain-string answers
    assert to_preference({"id": 1, "prompt": user, "chosen": "c", "rejected": "d"}) == (user, answer("c"), answer("d"))
    # implicit prompt (TRL's extract_prompt): whole messages, or characters without the separating space
    assert to_preference({"chosen": user + answer("c"), "rejected": user + answer("d")}) == (
        user, answer("c"), answer("d"))
    assert to_preference({"chosen": "The sky is blue.", "rejected": "The sky is green."}) == (
        "The sky is", " blue.", " green.")


@pytest.mark.parametrize("line, reason", [
    ("{oops", "invalid JSON"),
    ('[1, 2]', "unknown format"),
    ('{"prompt": "p", "chosen": "c"}', "unknown format"),
    ('{"prompt": "p", "chosen": [{"role": "assistant", "content": "c"}], "rejected": "r"}', "unknown format"),
    ('{"prompt": [{"role": "robot", "content": "p"}], "chosen": "c", "rejected": "r"}', "unknown role"),
    ('{"prompt": [{"role": "user", "content": " "}], "chosen": "c", "rejected": "r"}', "empty content"),
    ('{"prompt": "p", "chosen": "", "rejected": "r"}', "empty content"),
    ('{"prompt": "", "chosen": "c", "rejected": "r"}', "empty prompt"),
    ('{"prompt": "p", "chosen": "same", "rejected": "same"}', "identical answers"),
    ('{"chosen": "abc", "rejected": "xyz"}', "empty prompt"),
])
def test_bad_preference_lines_are_counted_or_raise_with_file_and_line(tmp_path, line, reason):
    good = json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"})
    path = tmp_path / "prefs.jsonl"
    path.write_text(f"{good}\n\n{line}\n{good}\n", encoding="utf-8")
    report = SkipReport()
    assert len(read_preferences(path, report=report)) == 2 and dict(report.skipped) == {reason: 1}
    assert report.summary("prefs", "pairs") == f"prefs: 2 pairs, 1 skipped ({reason} 1)"
    with pytest.raises(MiniGPTError, match=f"prefs.jsonl:3: {reason}"):
        read_preferences(path, strict=True)


def test_too_long_pairs_are_skipped_not_truncated(tmp_path, tokenizer):
    rows = standard_rows(4, seed=5) + [{"prompt": "the cat", "chosen": " sat" * 80, "rejected": " ran"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    template = ChatTemplate(tokenizer)
    report = SkipReport()
    pairs = load_preference_dataset(path, template, 60, "<|endoftext|>", report=report)
    assert len(pairs) == 4 and dict(report.skipped) == {"too long": 1}
    with pytest.raises(MiniGPTError, match="p.jsonl:5: too long"):
        load_preference_dataset(path, template, 60, "<|endoftext|>", strict=True)
    # standard answers end with EOS; prompt tokens are never part of a completion
    assert all(p.chosen_ids[-1] == tokenizer.eos_id == p.rejected_ids[-1] for p in pairs)
    batch = pad_pairs(pairs, tokenizer.pad_id)
    assert batch.tokens.shape[0] == 8 and torch.equal(batch.tokens[0, : len(pairs[0].prompt_ids)],
                                                      batch.tokens[4, : len(pairs[0].prompt_ids)])
    assert (batch.labels != -100).sum(1).tolist() == batch.completion_lengths.tolist()


# ---------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer):
    """A tiny model directory (its tokenizer has the ChatML tokens) and train/val preference files."""
    root = tmp_path_factory.mktemp("dpo")
    save_pretrained(tiny_model(tokenizer.vocab_size), root / "sft", tokenizer)
    return (root / "sft", write_jsonl(root / "train.jsonl", conversational_rows(24, seed=6)),
            write_jsonl(root / "val.jsonl", conversational_rows(6, seed=7)))


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_dpo_cli_raises_the_reward_margin_on_the_training_pairs(tmp_path, base):
    model_dir, train, _ = base
    out = tmp_path / "out"
    proc = run_cli("dpo", "--model", model_dir, "--data", train, "--val-data", train, "--out-dir", out,
                   "--max-steps", 12, "--batch-size", 8, "--lr", 3e-3, "--beta", 0.1, "--log-interval", 1,
                   "--eval-interval", 100, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "train.jsonl: 24 pairs" in proc.stdout and "reference: frozen copy" in proc.stdout
    rows = metrics(out)
    assert set(METRICS) <= set(rows[0]) and len(rows) == 12
    # step 1 is scored before any update: the policy is the reference, every reward is exactly 0
    assert rows[0]["rewards/margins"] == 0 and rows[0]["rewards/accuracies"] == 0
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[-1]["val_rewards/margins"] > 0.1 and rows[-1]["val_rewards/accuracies"] >= 0.75
    assert rows[-1]["val_loss"] < math.log(2)
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "dpo_config.json",
            "metrics.jsonl"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "dpo_config.json").read_text())["beta"] == 0.1


@pytest.mark.slow
def test_lora_dpo_cli_with_precomputed_reference_and_ipo(tmp_path, base):
    model_dir, train, val = base
    out = tmp_path / "out"
    proc = run_cli("dpo", "--model", model_dir, "--data", train, "--val-data", val, "--out-dir", out,
                   "--max-steps", 3, "--batch-size", 4, "--lora-rank", 2, "--lora-targets", "q_proj,v_proj",
                   "--precompute-ref", "--loss", "ipo", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "reference: precomputed" in proc.stdout
    assert json.loads((out / "adapter" / CONFIG_NAME).read_text())["r"] == 2
    assert "val_rewards/accuracies" in metrics(out)[-1]
    rebuilt = load_model(model_dir)
    load_adapter(rebuilt, out / "adapter")
    x = torch.randint(0, rebuilt.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), load_model(out)(x), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_dpo_cli_errors_are_one_line(tmp_path, base):
    model_dir, train, _ = base
    bad = tmp_path / "bad.jsonl"
    bad.write_text(train.read_text() + '{"prompt": "p", "chosen": "x", "rejected": "x"}\n')
    common = ("--model", model_dir, "--out-dir", tmp_path / "out", "--max-steps", 1, "--device", "cpu")
    assert_one_line_error(run_cli("dpo", "--data", bad, "--strict", *common), "bad.jsonl:25", "identical answers")
    assert_one_line_error(run_cli("dpo", "--data", train, "--beta", 0, *common), "--beta")
    assert_one_line_error(run_cli("dpo", "--data", tmp_path / "none.jsonl", *common), "does not exist")
    for weight in (-1, "nan", "inf"):
        assert_one_line_error(run_cli("dpo", "--data", train, "--sft-weight", weight, *common), "--sft-weight")
    proc = run_cli("dpo", "--data", bad, "--sft-weight", 0.5, *common)
    assert proc.returncode == 0 and "24 pairs, 1 skipped (identical answers 1)" in proc.stdout
    assert "DPO (sigmoid, beta 0.1, SFT term x 0.5) of" in proc.stdout


# ---------------------------------------------------------------------------------------- real data
@pytest.mark.parametrize("name, n", [("hh_rlhf_harmless_en.jsonl", 2073), ("dpo_zh.jsonl", 450)])
def test_real_preference_files_load(shared_data, name, n, tokenizer):
    """shared/data/dpo (never copied into the repository): message-list prompts with plain-string answers."""
    path = shared_data / "dpo" / name
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    report = SkipReport()
    records = read_preferences(path, report=report)
    assert len(records) == n and not report.skipped
    assert all(r.conversational and r.prompt[-1]["role"] == "user" and len(r.chosen) == 1 for r in records)
    template = ChatTemplate(tokenizer, CHATML_TEMPLATE)
    for record in records[:20]:
        pair = tokenize_preference(template, record)
        assert tokenizer.decode(pair.chosen_ids) == record.chosen[0]["content"] + "<|im_end|>\n"


def test_real_dpo_steps(tmp_path, shared_data, base):
    path = shared_data / "dpo" / "hh_rlhf_harmless_en.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    short = []  # a temporary slice of short pairs (the tiny model's context is 256 tokens), outside the repository
    with open(path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if sum(len(m["content"]) for m in r["prompt"]) + max(len(r["chosen"]), len(r["rejected"])) < 100:
                short.append(line)
    head = tmp_path / "head.jsonl"
    head.write_text("".join(short[:8]), encoding="utf-8")
    from minigpt.posttrain.dpo import dpo

    last = dpo(DPOConfig(model=str(base[0]), data=str(head), out_dir=str(tmp_path / "out"), max_steps=2,
                         batch_size=4, device="cpu", lora_rank=2, precompute_ref=True))
    assert last["step"] == 2 and math.isfinite(last["loss"])


def test_standard_string_pairs_end_with_a_sentencepiece_eos_id(tmp_path, shared_data):
    """SentencePiece's ``</s>`` is a control piece that decodes to no text: standard (string) pairs used to be
    refused with "the tokenizer has no EOS token" although it has one (id 2). The id is now appended, and `minigpt
    dpo` trains a step on such data."""
    folder = shared_data / "models" / "stories260K" / "hf"
    if not (folder / "config.json").is_file():
        pytest.skip(f"stories260K is not in {folder}")
    tok = load_tokenizer(folder)
    assert tok.eos_id is not None and tok.decode([tok.eos_id]) == ""
    record = PreferenceRecord(*to_preference({"prompt": "Once upon", "chosen": " a time", "rejected": " the sea"}))
    pair = tokenize_preference(ChatTemplate(tok), record, "", tok.eos_id)
    assert pair.chosen_ids[-1] == tok.eos_id and pair.rejected_ids[-1] == tok.eos_id
    assert tok.decode(pair.chosen_ids[:-1]).strip() == "a time"
    data = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Once upon", "chosen": " a time", "rejected": " a sea"},
                                                  {"prompt": "The cat", "chosen": " sat", "rejected": " flew"}])
    last = dpo(DPOConfig(model=str(folder), data=str(data), out_dir=str(tmp_path / "out"), max_steps=1,
                         batch_size=2, device="cpu"))
    assert last["step"] == 1 and math.isfinite(last["loss"])


def test_standard_pairs_get_bos_exactly_where_the_source_tokenizer_adds_it(tmp_path, shared_data, base, monkeypatch):
    """String pairs are encoded as ``tokenizer(text)`` encodes them (TRL 1.x's way): the prompt starts with BOS for
    a Llama SentencePiece model, not for a MiniGPT byte-level BPE base."""
    from minigpt.posttrain import dpo as dpo_module

    seen = record_results(monkeypatch, dpo_module, "load_preference_dataset", lambda pairs: [p.prompt_ids for p in pairs])
    data = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Once upon a time", "chosen": " a cat.",
                                                   "rejected": " a dog ran."}] * 2)
    llama = shared_data / "models" / "stories260K" / "hf"
    for source, name in ((llama, "llama"), (base[0], "minigpt")):
        dpo(DPOConfig(model=str(source), data=str(data), out_dir=str(tmp_path / name), max_steps=1, batch_size=2,
                      device="cpu"))
        starts = {ids[0] for ids in seen[-1]}
        assert (starts == {load_tokenizer(source).bos_id}) == (name == "llama"), (name, starts)
