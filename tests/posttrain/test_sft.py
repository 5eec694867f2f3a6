"""`minigpt sft`: full and LoRA fine-tuning end to end on tiny synthetic conversations, and the real chat data."""
import json
from pathlib import Path

import pytest
import torch
from chat_helpers import assert_same_run, chat_tokenizer, conversations, crash_after, record_results, tiny_model
from conftest import assert_one_line_error, run_cli

from minigpt.checkpoint.adapter import CONFIG_NAME, load_adapter
from minigpt.checkpoint.native import load_chat_template, load_model, load_tokenizer, save_pretrained
from minigpt.data.chat import SkipReport, load_chat_dataset, read_conversations
from minigpt.data.chat_batches import iterate_batches, masked_lm_loss
from minigpt.errors import MiniGPTError
from minigpt.model.quant import quantize_weight
from minigpt.posttrain.packing import with_packed_forward
from minigpt.posttrain.recipe import pad_to, quantize_blocks
from minigpt.posttrain.sft import SFT, SFTConfig, sft
from minigpt.posttrain.vocab import add_chat_tokens
from minigpt.tokenizer.chat_template import CHATML_TEMPLATE, CHATML_TRAINING_TEMPLATE, IM_END, IM_START, ChatTemplate


def write_chat(path, n, seed):
    """Synthetic conversations whose answers are predictable: the assistant repeats the user's words reversed."""
    rows = []
    for messages in conversations(n, seed=seed, turns=1, system=False):
        question = messages[0]["content"]
        rows.append({"messages": [messages[0], {"role": "assistant",
                                                "content": " ".join(reversed(question.rstrip("?").split()))}]})
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny base model directory whose tokenizer lacks the ChatML tokens, plus train/val chat files."""
    root = tmp_path_factory.mktemp("sft")
    tok = chat_tokenizer(with_chat_tokens=False)
    save_pretrained(tiny_model(tok.vocab_size), root / "base", tok)
    return root / "base", write_chat(root / "train.jsonl", 48, seed=10), write_chat(root / "val.jsonl", 8, seed=11)


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_full_sft_learns_and_writes_a_chat_model(tmp_path, base):
    model_dir, train, val = base
    last = sft(SFTConfig(model=str(model_dir), data=str(train), val_data=str(val), out_dir=str(tmp_path / "out"),
                         max_steps=40, lr=3e-3, batch_size=4, eval_interval=20, log_interval=5, device="cpu"))
    rows = metrics(tmp_path / "out")
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "padding_fraction"} <= set(rows[0])
    assert rows[-1]["step"] == 40 and last["val_loss"] == rows[-1]["val_loss"]
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    tok = load_tokenizer(tmp_path / "out")
    assert tok.token_to_id(IM_START) is not None and tok.token_to_id(IM_END) is not None
    assert load_chat_template(tmp_path / "out") == CHATML_TEMPLATE
    model = load_model(tmp_path / "out")
    assert model.config.vocab_size == tok.vocab_size
    # the validation loss on assistant tokens went down from the (resized) base model's
    untuned = load_model(model_dir)
    add_chat_tokens(untuned, load_tokenizer(model_dir))
    from minigpt.data.chat import load_chat_dataset
    from minigpt.data.chat_batches import masked_lm_loss, pad_batch
    examples = load_chat_dataset(val, ChatTemplate(tok, CHATML_TRAINING_TEMPLATE), 256)
    batch = pad_batch(examples, tok.pad_id)
    with torch.no_grad():
        before = masked_lm_loss(untuned(batch.tokens), batch.labels).item()
        after = masked_lm_loss(model(batch.tokens), batch.labels).item()
    assert after == pytest.approx(last["val_loss"], abs=1e-4) and after < before - 0.5


def test_lora_sft_writes_a_peft_adapter_equal_to_the_merged_model(tmp_path, base):
    model_dir, train, _ = base
    sft(SFTConfig(model=str(model_dir), data=str(train), out_dir=str(tmp_path / "out"), lora_rank=4,
                  lora_alpha=8, lora_targets="q_proj,v_proj,down_proj", max_steps=10, lr=1e-2, batch_size=4,
                  pack=False, device="cpu"))
    config = json.loads((tmp_path / "out" / "adapter" / CONFIG_NAME).read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert config["modules_to_save"] == ["embed_tokens"] and config["base_model_name_or_path"] == str(model_dir)
    merged = load_model(tmp_path / "out")
    rebuilt = load_model(model_dir)
    add_chat_tokens(rebuilt, load_tokenizer(model_dir))  # the adapter's base: the vocabulary resized as in training
    base_norm = rebuilt.layers[0].attention_norm.weight.clone()
    load_adapter(rebuilt, tmp_path / "out" / "adapter")
    x = torch.randint(0, merged.config.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), merged(x), atol=1e-5, rtol=0)
    assert torch.equal(merged.layers[0].attention_norm.weight, base_norm)  # the base stayed frozen
    assert not torch.equal(merged.layers[0].attention.wq.weight, load_model(model_dir).layers[0].attention.wq.weight)


@pytest.mark.slow
def test_sft_cli_then_generate(tmp_path, base):
    model_dir, train, val = base
    proc = run_cli("sft", "--model", model_dir, "--data", train, "--val-data", val, "--out-dir", tmp_path / "out",
                   "--max-steps", 3, "--batch-size", 2, "--device", "cpu", "--lora-rank", 2)
    assert proc.returncode == 0, proc.stderr
    assert "train.jsonl: 48 conversations" in proc.stdout and (tmp_path / "out" / "adapter").is_dir()
    proc = run_cli("generate", tmp_path / "out", "--prompt", "the cat", "--max-new-tokens", 5, "--seed", 0,
                   "--device", "cpu")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow  # many CLI processes, ~12 s (make test-slow, CI's second stage)
def test_sft_cli_errors_are_one_line(tmp_path, base):
    model_dir, train, _ = base
    bad = tmp_path / "bad.jsonl"
    bad.write_text(train.read_text() + "{oops\n")
    common = ("--model", model_dir, "--out-dir", tmp_path / "out", "--max-steps", 1, "--device", "cpu")
    assert_one_line_error(run_cli("sft", "--data", train, "--lora-rank", 0, *common), "lora_rank")
    assert_one_line_error(run_cli("sft", "--data", train, "--lora-rank", 2, "--lora-targets", "qkv", *common), "qkv")
    assert_one_line_error(run_cli("sft", "--data", bad, "--strict", *common), "bad.jsonl:49", "invalid JSON")
    assert_one_line_error(run_cli("sft", "--data", tmp_path / "none.jsonl", *common), "does not exist")
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    assert_one_line_error(run_cli("sft", "--data", train, "--model", model_dir, "--out-dir", tmp_path / "precious",
                                  "--max-steps", 1), "not an SFT output")


# ---------------------------------------------------------------------------------------- real data
def test_real_sft_files_load(shared_data):
    """The chat files of shared/data/sft (built from Alpaca and ShareGPT; never copied into the repository) load in
    full, except the Alpaca items whose output is empty (7 English, 5 Chinese), which are skipped and counted."""
    expected = {"alpaca_en.jsonl": (18000, 7), "alpaca_zh.jsonl": (10855, 5), "sharegpt_zh_multiturn.jsonl": (893, 0)}
    for name, (n, empty) in expected.items():
        path = shared_data / "sft" / name
        if not path.is_file():
            pytest.skip(f"{path} is absent")
        report = SkipReport()
        convs = read_conversations(path, report=report)
        assert len(convs) == n - empty and dict(report.skipped) == ({"empty content": empty} if empty else {})
    multi = read_conversations(shared_data / "sft" / "sharegpt_zh_multiturn.jsonl")
    assert sum(sum(m["role"] == "user" for m in c) > 1 for _, c in multi) == 562


def test_real_alpaca_sft_steps(tmp_path, shared_data, base):
    path = shared_data / "sft" / "alpaca_en.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    head = tmp_path / "head.jsonl"  # a temporary slice, outside the repository
    with open(path, encoding="utf-8") as f:
        head.write_text("".join(next(f) for _ in range(64)), encoding="utf-8")
    last = sft(SFTConfig(model=str(base[0]), data=str(head), out_dir=str(tmp_path / "out"), max_steps=4,
                         batch_size=2, device="cpu", lora_rank=4))
    assert last["step"] == 4 and last["loss"] > 0
    assert Path(tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()


# ---------------------------------------------------------------------------------------- the shared trainer
@pytest.mark.parametrize("lora", [False, True])
def test_sft_resume_reproduces_the_uninterrupted_run(tmp_path, base, lora):
    """Six steps in one go, and the same run killed after its step-3 checkpoint and resumed with --resume: the same
    weights (and adapter), bit for bit, and the same metrics rows. LoRA runs padded with adapter dropout, so the
    restored RNG state matters too."""
    model_dir, train, val = base
    config = dict(model=str(model_dir), data=str(train), val_data=str(val), max_steps=6, batch_size=4, lr=3e-3,
                  log_interval=1, eval_interval=3, ckpt_interval=3, keep_checkpoints=5, device="cpu")
    if lora:
        config.update(lora_rank=2, lora_dropout=0.2, pack=False, lr=1e-2)
    sft(SFTConfig(**config, out_dir=str(tmp_path / "full")))
    crashed = crash_after(tmp_path / "full", tmp_path / "crashed", 3)
    last = sft(SFTConfig(**config, out_dir=str(crashed), resume=True))
    assert last["step"] == 6 and (crashed / "loss_curve.png").is_file()
    assert_same_run(tmp_path / "full", crashed)
    assert (crashed / "adapter").is_dir() == lora


@pytest.mark.slow
def test_sft_cli_config_yaml_flags_and_run_files(tmp_path, base):
    """--config sets any option by name; a flag given as well wins. The run directory has the trainer's files
    (config.yaml, metrics.jsonl, loss_curve.png, checkpoints, latest) next to the model."""
    model_dir, train, _ = base
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {model_dir}\ndata: {train}\nmax_steps: 2\nbatch_size: 2\npack: false\n"
                      "lora_rank: 2\nlora_targets: q_proj,v_proj\nlog_interval: 1\ndevice: cpu\n")
    out = tmp_path / "out"
    proc = run_cli("sft", "--config", recipe, "--out-dir", out, "--max-steps", 3)
    assert proc.returncode == 0, proc.stderr
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["padding_fraction"] > 0 for r in rows)  # padded rows
    adapter = json.loads((out / "adapter" / CONFIG_NAME).read_text())
    assert adapter["r"] == 2 and sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    options = json.loads((out / "sft_config.json").read_text())
    assert options["pack"] is False and options["max_steps"] == 3 and options["batch_size"] == 2
    assert {"config.yaml", "loss_curve.png", "checkpoints", "latest", "manifest.json"} <= {p.name for p in out.iterdir()}
    assert (out / "checkpoints" / "step_0000003" / "dcp").is_dir()


class TrainedModel(SFT):
    """The SFT recipe, keeping a copy of the trained state as it is before the output merges the adapters."""

    def finish(self, result):
        self.trained = {name: t.detach().clone() for name, t in self.model.state_dict().items()}
        self.optimized = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        self.trainable = {name for name, p in self.model.named_parameters() if id(p) in self.optimized}
        return super().finish(result)


def test_lora_over_an_int8_base(tmp_path, base):
    """--quantize int8: LoRA adapters train over frozen int8 block projections. The loss falls, the int8 weights and
    scales end bit-identical to the quantized base, only adapters (and the new chat-token rows) are optimized, and
    the saved PEFT adapter on the float base gives logits close to the int8 base with the same adapter."""
    model_dir, train, _ = base
    out = tmp_path / "out"
    recipe = TrainedModel(SFTConfig(model=str(model_dir), data=str(train), out_dir=str(out), lora_rank=4,
                                    lora_alpha=8, quantize="int8", max_steps=30, lr=1e-2, batch_size=4,
                                    log_interval=5, device="cpu"))
    recipe.run()
    rows = metrics(out)
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    float_base = load_model(model_dir).state_dict()
    int8 = {n: t for n, t in recipe.trained.items() if n.endswith(".base_layer.weight")}
    assert len(int8) == 14 and all(t.dtype == torch.int8 for t in int8.values())
    for name, q in int8.items():
        expected_q, expected_scale = quantize_weight(float_base[name.replace(".base_layer", "")])
        assert torch.equal(q, expected_q) and torch.equal(recipe.trained[name + "_scale"], expected_scale)
    assert recipe.trainable == {n for n in recipe.trained if "lora_" in n} | {"tok_embeddings.weight"}
    tok = load_tokenizer(model_dir)
    fp32, quantized = load_model(model_dir), quantize_blocks(load_model(model_dir))
    for model in (fp32, quantized):
        add_chat_tokens(model, tok)
        load_adapter(model, out / "adapter")
    x = torch.randint(0, fp32.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    untuned = load_model(model_dir)
    add_chat_tokens(untuned, tok)
    with torch.no_grad():
        expected, got, scale = fp32(x), quantized(x), fp32(x).std()
        # int8 rounding (at most half a step, 1/254 of a row's largest weight) compounds through 14 projections:
        # measured |difference| mean 1.2 % and max 18 % of the logits' standard deviation; tolerances 2 % and 30 %,
        # against a mean change of 120 % that the adapter made (the untuned float base is far from both).
        assert (got - expected).abs().mean() < 0.02 * scale and (got - expected).abs().max() < 0.3 * scale
        assert (untuned(x) - expected).abs().mean() > 0.2 * scale
        torch.testing.assert_close(load_model(out)(x), expected, atol=1e-5, rtol=0)  # the output: float base merged
    for name, q in int8.items():  # and the int8 model rebuilt from the adapter is the one that trained
        assert torch.equal(quantized.get_submodule(name.rsplit(".", 1)[0]).weight, q)


def test_quantize_needs_lora(tmp_path, base):
    model_dir, train, _ = base
    assert_one_line_error(run_cli("sft", "--model", model_dir, "--data", train, "--out-dir", tmp_path / "out",
                                  "--quantize", "int8", "--max-steps", 1), "--quantize int8 needs --lora-rank")


@pytest.mark.slow
@pytest.mark.distributed
def test_sft_under_torchrun_matches_one_process(tmp_path, base):
    """LoRA SFT on 2 gloo ranks (DDP, and FSDP2 gathering the weights for the output) equals one process
    accumulating the same two micro-batches per step: metrics rows and output weights (1e-6)."""
    import os
    import socket
    import subprocess
    import sys

    model_dir, train, val = base
    args = ["-m", "minigpt", "sft", "--model", model_dir, "--data", train, "--val-data", val, "--max-steps", 4,
            "--batch-size", 2, "--threads", 1, "--log-interval", 1, "--eval-interval", 2, "--lr", 3e-3,
            "--lora-rank", 2, "--lora-dropout", 0, "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}

    def run(out, *extra, nproc=1):
        launcher = [sys.executable]
        if nproc > 1:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            launcher += ["-m", "torch.distributed.run", "--nnodes", "1", f"--nproc-per-node={nproc}",
                         "--rdzv-backend", "c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
        proc = subprocess.run([*launcher, *map(str, args), "--out-dir", str(out), *extra], capture_output=True,
                              text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return metrics(out), load_model(out).state_dict()

    one_rows, one_weights = run(tmp_path / "one", "--grad-accum", "2")
    for parallel in ("ddp", "fsdp"):
        rows, weights = run(tmp_path / parallel, "--parallel", parallel, nproc=2)
        for a, b in zip(one_rows, rows):
            assert a["tokens"] == b["tokens"]
            for k in ("loss", "grad_norm", "val_loss", "padding_fraction"):
                assert (k in a) == (k in b) and a.get(k) == pytest.approx(b.get(k), abs=1e-6), (parallel, k)
        for k, v in one_weights.items():
            torch.testing.assert_close(weights[k], v, atol=1e-6, rtol=0)


def test_compile_padding_leaves_the_loss_unchanged(base):
    """--compile pads every batch to --seq-len columns and --batch-size rows (one shape, one graph): the masked loss
    and the real-token count stay those of the unpadded batch, packed or padded."""
    model = load_model(base[0])
    tok, _ = add_chat_tokens(model, load_tokenizer(base[0]))
    examples = load_chat_dataset(base[1], ChatTemplate(tok, CHATML_TRAINING_TEMPLATE), 64)[:5]
    model = with_packed_forward(model)
    for pack in (True, False):
        batch = next(iter(iterate_batches(examples, 3, tok.pad_id, pack, 64)))
        padded = pad_to(batch, 64, tok.pad_id, rows=4)
        assert padded.tokens.shape == (4, 64) and batch.tokens.shape[0] < 4
        assert padded.tokens.numel() - padded.n_pad == batch.tokens.numel() - batch.n_pad
        with torch.no_grad():
            losses = [masked_lm_loss(model(b.tokens, position_ids=b.position_ids, doc_ids=b.doc_ids), b.labels)
                      for b in (batch, padded)]
        torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("option,value,fragment", [("seq_len", 0, "--seq-len must be a positive integer"),
                                                   ("warmup_steps", -1, "--warmup-steps must be an integer >= 0"),
                                                   ("lr", float("nan"), "--lr must be a positive number"),
                                                   ("lr", 0.0, "--lr must be a positive number")])
def test_bad_schedule_options_are_refused_before_the_data_loads(option, value, fragment):
    """``--seq-len 0`` silently meant the model's context and ``--warmup-steps -1`` was accepted; ``--lr nan``
    failed in AdamW only after the data had loaded. The paths here do not exist: the option must fail first."""
    with pytest.raises(MiniGPTError, match=fragment):
        SFTConfig(model="no_model", data="no_data.jsonl", out_dir="no_out", **{option: value})


def test_standard_rows_get_bos_exactly_where_the_source_tokenizer_adds_it(tmp_path, shared_data, base, monkeypatch):
    """`{text}` and string prompt-completion rows are encoded as ``tokenizer(text)`` encodes them (TRL's way): with
    BOS first for a Llama SentencePiece model, without it for a MiniGPT byte-level BPE base; with no conversational
    row, the model keeps its vocabulary and chat template."""
    from minigpt.posttrain import sft as sft_module

    seen = record_results(monkeypatch, sft_module, "load_chat_dataset", lambda examples: [e.input_ids for e in examples])
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"text": "Once upon a time there was a cat."}) + "\n"
                    + json.dumps({"prompt": "The dog", "completion": " ran home."}) + "\n")
    llama = shared_data / "models" / "stories260K" / "hf"
    for source, name in ((llama, "llama"), (base[0], "minigpt")):
        sft(SFTConfig(model=str(source), data=str(data), out_dir=str(tmp_path / name), max_steps=1, batch_size=2,
                      device="cpu"))
        tok = load_tokenizer(source)
        starts = {ids[0] for ids in seen[-1]}
        assert (starts == {tok.bos_id}) == (name == "llama"), (name, starts)
        assert all(ids[-1] == tok.eos_id for ids in seen[-1])
        # Only plain rows: no chat template is used, so none is added (ChatML's tokens grew the vocabulary before).
        out = load_tokenizer(tmp_path / name)
        assert out.vocab_size == tok.vocab_size and out.token_to_id(IM_START) is None
        assert load_chat_template(tmp_path / name) == load_chat_template(source)
