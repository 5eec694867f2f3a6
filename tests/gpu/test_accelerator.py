"""The paths that run on an accelerator (CUDA): the model, the KV cache, the batching engine, pretraining with exact
resume, SFT with LoRA, DPO and the generate CLI, each compared with the CPU or with its own invariant.

CI has no GPU: every test here skips there. ``MINIGPT_TEST_ACCELERATOR=cpu`` runs them against the CPU itself (a dry
run of the tests' own logic, comparing the CPU with itself)."""
import json
import os
import random
import shutil
from functools import partial

import pytest
import torch
from conftest import TINY_MODEL, random_model, run_cli, train_config

from minigpt.checkpoint.native import load_model, save_pretrained
from minigpt.infer.engine import Engine
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.model.transformer import lm_loss
from minigpt.posttrain.dpo import DPOConfig, dpo
from minigpt.posttrain.sft import SFTConfig, sft
from minigpt.tokenizer.chat_template import add_special_tokens
from minigpt.tokenizer.tokenizer import train_tokenizer
from minigpt.train.loop import train

WORDS = "the cat sat on a mat and then it ran to see why sky is blue what do you think about tea".split()


def _accelerator() -> str:
    name = os.environ.get("MINIGPT_TEST_ACCELERATOR", "")
    if name:
        return name
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("no CUDA device (MINIGPT_TEST_ACCELERATOR=cpu runs these tests against the CPU)")


@pytest.fixture(scope="module")
def device() -> str:
    return _accelerator()


SHAPE = dict(vocab_size=320, **{**TINY_MODEL, "max_seq_len": 128})
tiny_model = partial(random_model, SHAPE, noise=0.02)
# fp32 on a GPU: cuBLAS and the SDPA kernels sum in another order than the CPU (TF32 stays off for matmuls by
# default), so logits agree to float32 rounding of sums over dim=32..hidden_dim terms, not bit for bit.
FP32_ATOL = 1e-4


def prompts(n, seed=0, longest=40):
    rng = random.Random(seed)
    return [[rng.randrange(2, SHAPE["vocab_size"]) for _ in range(rng.randrange(1, longest))] for _ in range(n)]


@pytest.mark.parametrize("impl", ["sdpa", "naive", "flash_reference"])
def test_forward_matches_the_cpu(device, impl):
    model = tiny_model(attention_impl=impl, **({"attention_block_size": 8} if impl == "flash_reference" else {}))
    x = torch.randint(0, SHAPE["vocab_size"], (3, 50))
    with torch.no_grad():
        ref = model(x)
        out = model.to(device)(x.to(device)).cpu()
    torch.testing.assert_close(out, ref, atol=FP32_ATOL, rtol=0)


def test_bf16_weights_stay_close_to_fp32(device):
    """bf16 weights and activations (8 bits of mantissa): logits within 2 % of their range of the fp32 CPU ones."""
    model = tiny_model()
    x = torch.randint(0, SHAPE["vocab_size"], (2, 40))
    with torch.no_grad():
        ref = model(x)
        out = model.to(device, torch.bfloat16)(x.to(device)).float().cpu()
    assert (out - ref).abs().max().item() < 0.02 * (ref.max() - ref.min()).item()


def test_cached_greedy_decode_picks_the_cpu_argmax(device):
    """Each token decoded with the KV cache on the device is, within fp32 rounding, the CPU model's argmax over the
    whole context recomputed without a cache."""
    model = tiny_model()
    on_device = tiny_model().to(device)
    for prompt in prompts(3, seed=1):
        new = list(generate_tokens(on_device, prompt, SamplingParams(max_tokens=24, temperature=0)))
        assert len(new) == 24
        with torch.no_grad():
            logits = model(torch.tensor([prompt + new]))[0, len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(new)[:, None])[:, 0]
        assert (logits.max(dim=1).values - chosen).max().item() <= FP32_ATOL


def test_engine_batched_greedy_equals_each_prompt_alone(device):
    """Continuous batching on the device: 12 requests through 4 slots, joining and leaving mid-batch."""
    model = tiny_model().to(device)
    engine = Engine(model, max_batch_size=4, stop_ids=[])
    ps = prompts(12, seed=2)
    budgets = [random.Random(i).randrange(1, 30) for i in range(12)]
    reqs = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(ps, budgets)]
    engine.run_until_idle()
    for req, p, n in zip(reqs, ps, budgets):
        got = []
        while not req.inbox.empty():
            got += req.inbox.get().token_ids
        assert got == list(generate_tokens(model, p, SamplingParams(max_tokens=n, temperature=0)))


def test_compiled_forward_equals_eager(device):
    model = tiny_model().to(device)
    x = torch.randint(0, SHAPE["vocab_size"], (2, 32), device=device)
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model)(x)
    torch.testing.assert_close(compiled, eager, atol=FP32_ATOL, rtol=0)


def test_bf16_pretraining_learns_and_resumes_exactly(device, tiny_data, tmp_path):
    """bf16 autocast on the device: the loss falls, and a run killed after its step-8 checkpoint and resumed ends
    with the uninterrupted run's weights and losses, bit for bit (the claim the CPU tests make)."""
    common = dict(device=device, dtype="bfloat16", max_steps=16, ckpt_interval=8, keep_checkpoints=5,
                  log_interval=1, eval_interval=8, lr=5e-3, batch_size=16, model={**TINY_MODEL, "dropout": 0.1})
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    train(train_config(tiny_data, full, **common))
    rows_a = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert rows_a[-1]["loss"] < rows_a[0]["loss"] - 0.5, [r["loss"] for r in rows_a]
    shutil.copytree(full, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step_0000016")
    (crashed / "latest").write_text("checkpoints/step_0000008\n")
    train(train_config(tiny_data, crashed, **common, resume=True))
    a = load_model(full / "checkpoints" / "step_0000016").state_dict()
    b = load_model(crashed / "checkpoints" / "step_0000016").state_dict()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed weights differ from the uninterrupted run's: {different[:4]}"
    rows_b = [json.loads(line) for line in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows_b] == [r["loss"] for r in rows_a]


def test_sft_and_lora_dpo_run_on_the_device(device, tmp_path):
    """The chat data are made-up word lists; the assistant answers the user's words reversed (learnable)."""
    rng = random.Random(5)
    sentence = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    tok, _ = add_special_tokens(train_tokenizer([sentence(12) for _ in range(300)], 300))
    save_pretrained(random_model(dict(vocab_size=tok.vocab_size, **{**TINY_MODEL, "max_seq_len": 256}), noise=0.01),
                    tmp_path / "base", tok)
    rows = []
    for _ in range(32):
        words = sentence(rng.randint(2, 6)).split()
        rows.append({"messages": [{"role": "user", "content": " ".join(words) + "?"},
                                  {"role": "assistant", "content": " ".join(reversed(words))}]})
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft(SFTConfig(model=str(tmp_path / "base"), data=str(tmp_path / "chat.jsonl"), out_dir=str(tmp_path / "sft"),
                  max_steps=40, lr=3e-3, batch_size=8, log_interval=1, device=device,
                  dtype="bfloat16"))
    sft_rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert sft_rows[-1]["loss"] < 0.8 * sft_rows[0]["loss"]
    pairs = []
    for _ in range(16):
        words = sentence(rng.randint(2, 5)).split()
        pairs.append({"prompt": " ".join(words), "chosen": " " + " ".join(reversed(words)),
                      "rejected": " " + sentence(rng.randint(1, 6))})
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    dpo(DPOConfig(model=str(tmp_path / "sft"), data=str(tmp_path / "pairs.jsonl"), out_dir=str(tmp_path / "dpo"),
                  lora_rank=4, lora_alpha=8, max_steps=12, batch_size=8, lr=1e-2, beta=0.1, log_interval=1,
                  device=device, dtype="bfloat16"))
    dpo_rows = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert dpo_rows[0]["rewards/margins"] == 0 and dpo_rows[-1]["rewards/margins"] > 0
    # the trained chat model decodes through the CLI on the device
    proc = run_cli("generate", tmp_path / "dpo", "--prompt", "the cat", "--max-new-tokens", 8, "--temperature", 0,
                   "--device", device, "--stats")
    assert proc.returncode == 0, proc.stderr


def test_lm_loss_backward_matches_the_cpu(device):
    """Gradients of the fp32 loss on the device equal the CPU's to fp32 rounding (relative 1e-4 per tensor)."""
    model = tiny_model()
    x, y = torch.randint(0, 320, (2, 48)), torch.randint(0, 320, (2, 48))
    lm_loss(model(x), y).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.to(device)
    lm_loss(model(x.to(device)), y.to(device)).backward()
    for n, p in model.named_parameters():
        err = ((p.grad.cpu() - ref[n]).norm() / ref[n].norm().clamp_min(1e-12)).item()
        assert err < 1e-4, (n, err)
