"""Post-training steps, MiniGPT against transformers / PEFT / TRL, side by side in one process (issues 16 and 17).

For each preset (random weights, seeded) the MiniGPT model is saved, exported with
:func:`minigpt.checkpoint.convert.export_hf` and loaded into ``transformers.LlamaForCausalLM`` (float32, no
``torch.compile``, SDPA attention: the kernel MiniGPT also uses), so both sides hold identical weights. One batch of
synthetic chat data (seeded; same token ids and labels on both sides) feeds every step:

* ``sft``: full fine-tuning step -- forward, masked next-token loss on the assistant tokens (MiniGPT:
  :func:`minigpt.posttrain.sft.forward_loss`; transformers: ``model(input_ids, labels=labels).loss`` with ``-100``
  outside the answers), backward, ``AdamW.step``, ``zero_grad``. transformers runs in a plain loop, not TRL's
  ``SFTTrainer``: the trainer adds its data pipeline and bookkeeping, and what is compared here is the model step.
* ``lora``: the same step with rank-8 adapters (alpha 16, no dropout) on q/k/v/o/gate/up/down:
  :func:`minigpt.model.lora.apply_lora` against ``peft.get_peft_model`` (the adapters' A matrices are copied from
  MiniGPT into PEFT, so both start from the same adapter weights).
* ``dpo``: full-model DPO step (sigmoid loss, beta 0.1, a frozen reference copy): MiniGPT's
  :func:`minigpt.posttrain.dpo.batch_loss` against TRL's own loss path, ``DPOTrainer.compute_loss`` on a batch made
  by the trainer's ``data_collator`` (TRL's dataloader and ``training_step`` are not used), then backward, AdamW,
  ``zero_grad`` on both sides. TRL's forward scores only the completion positions through its fused LM head
  (``trl.trainer.utils.add_fused_lm_head``); MiniGPT computes all logits.

Each pair of implementations runs alternately (A B A B ...) after ``--warmup`` rounds; medians and min-max of tokens/s
(every token of the batch: rows are exactly ``--seq-len`` tokens, no padding) and the median of per-round ratios are
printed as markdown. The first step of each pair is checked to give the same loss on both sides (DPO: the same
summed log-probs), or the script stops. Optimizer state: the bytes of AdamW's ``exp_avg`` and ``exp_avg_sq`` after the
timed steps, full against LoRA, and LoRA / full (goal: <= 2 %).

``--compile``: the MiniGPT models run through ``torch.compile`` (default Inductor settings; the compilation happens in
the untimed warm-up round), as ``minigpt sft --compile`` / ``minigpt dpo --compile`` run them through the trainer;
transformers stays eager (its own ``torch_compile`` path is the Trainer's, not the plain loop's).

Run from the repo root: ``.venv/bin/python scripts/bench_posttrain.py --threads 2 [--presets tiny,small] [--compile]``.
"""
import argparse
import contextlib
import copy
import functools
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import datasets
import peft
import tokenizers
import torch
import transformers
import trl

from minigpt.checkpoint.adapter import adapter_state_dict
from minigpt.checkpoint.convert import export_hf
from minigpt.checkpoint.native import save_pretrained
from minigpt.data.chat import IGNORE_INDEX, ChatExample
from minigpt.data.chat_batches import pad_batch
from minigpt.data.preference import PreferencePair, pad_pairs
from minigpt.model.config import preset
from minigpt.model.lora import HF_TARGETS, apply_lora, trainable_parameters
from minigpt.model.transformer import Transformer
from minigpt.posttrain.dpo import Reference, batch_loss, disable_dropout
from minigpt.posttrain.sft import forward_loss
from minigpt.runtime import cpu_name, loadavg

# Synthetic ChatML-like ids: <|im_start|>, <|im_end|>, the three role names, a newline; content ids above them.
IM_START, IM_END, ROLE_IDS, NEWLINE, FIRST_CONTENT = 1, 2, {"system": 3, "user": 4, "assistant": 5}, 6, 16
LORA_RANK, LORA_ALPHA, BETA, LR = 8, 16.0, 0.1, 1e-5
FLAGS_SHOWN = ("avx", "fma", "f16c", "amx")  # the /proc/cpuinfo flags that decide the fp32/bf16 GEMM kernels


# ------------------------------------------------------------------------------------------------ data
def turn(g: torch.Generator, role: str, lo: int, hi: int, vocab_size: int) -> tuple[list[int], list[int]]:
    """One turn ``<|im_start|>role\\n content <|im_end|>\\n`` and its labels (content and <|im_end|> for the
    assistant, as minigpt.data.chat labels them; -100 elsewhere)."""
    n = int(torch.randint(lo, hi + 1, (), generator=g))
    content = torch.randint(FIRST_CONTENT, vocab_size, (n,), generator=g).tolist()
    ids = [IM_START, ROLE_IDS[role], NEWLINE] + content + [IM_END, NEWLINE]
    scored = role == "assistant"
    labels = [IGNORE_INDEX] * 3 + (content + [IM_END] if scored else [IGNORE_INDEX] * (n + 1)) + [IGNORE_INDEX]
    return ids, labels


def conversation(g: torch.Generator, seq_len: int, vocab_size: int) -> ChatExample:
    """A system turn, then user/assistant turns of random lengths, cut to exactly ``seq_len`` tokens."""
    ids, labels = turn(g, "system", 5, 30, vocab_size)
    while len(ids) < seq_len:
        for role, lo, hi in (("user", 10, 60), ("assistant", 20, 100)):
            i, y = turn(g, role, lo, hi, vocab_size)
            ids, labels = ids + i, labels + y
    return ChatExample(ids[:seq_len], labels[:seq_len], source="synthetic")


def preference_pair(g: torch.Generator, seq_len: int, vocab_size: int) -> PreferencePair:
    """A prompt ending in ``<|im_start|>assistant\\n`` and two answers filling the row to exactly ``seq_len``."""
    prompt = turn(g, "system", 5, 30, vocab_size)[0] + turn(g, "user", 20, 80, vocab_size)[0]
    prompt += [IM_START, ROLE_IDS["assistant"], NEWLINE]
    n = seq_len - len(prompt)
    answer = lambda: torch.randint(FIRST_CONTENT, vocab_size, (n - 1,), generator=g).tolist() + [IM_END]  # noqa: E731
    return PreferencePair(prompt, answer(), answer(), source="synthetic")


# ------------------------------------------------------------------------------------------------ helpers
def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of AdamW's moment tensors (``exp_avg``, ``exp_avg_sq``) in ``optimizer``'s state."""
    return sum(s[k].numel() * s[k].element_size() for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, betas=(0.9, 0.999))


def load_hf(hf_dir: Path):
    return transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                         attn_implementation="sdpa").train()


def race(a, b, warmup: int, repeats: int) -> tuple[list[float], list[float], tuple[float, float]]:
    """Time ``a`` and ``b`` (each one training step returning a number to compare) alternately; returns their
    step times (s) and their first return values."""
    first = (a(), b())
    for _ in range(warmup - 1):
        a(), b()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, times in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return ta, tb, first


def check_close(what: str, ours: float, theirs: float) -> None:
    if abs(ours - theirs) > 1e-4 * max(1.0, abs(theirs)):
        raise SystemExit(f"{what}: MiniGPT {ours:.6f} != reference {theirs:.6f}; not the same computation")


def trl_trainer(policy, ref, pairs: int, out: Path) -> trl.DPOTrainer:
    """A DPOTrainer over ``policy``/``ref``; its dataset (one dummy row, needed by the constructor) is unused."""
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<pad>": 0, "<eos>": 1, "a": 2}, unk_token="<pad>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")
    args = trl.DPOConfig(output_dir=str(out), beta=BETA, loss_type=["sigmoid"], report_to="none", use_cpu=True,
                         bf16=False, max_length=None, per_device_train_batch_size=pairs, learning_rate=LR)
    return trl.DPOTrainer(model=policy, ref_model=ref, args=args, processing_class=tok,
                          train_dataset=datasets.Dataset.from_list([{"prompt": "a", "chosen": " a",
                                                                     "rejected": " a a"}]))


# ------------------------------------------------------------------------------------------------ the three races
def bench_preset(name: str, args, root: Path) -> tuple[list[dict], list[dict]]:
    torch.manual_seed(args.seed)
    base = Transformer(preset(name, vocab_size=args.vocab_size, max_seq_len=args.seq_len)).train()
    hf_dir = export_hf(save_pretrained(base, root / name), root / f"{name}-hf")
    g = torch.Generator().manual_seed(args.seed)
    batch = pad_batch([conversation(g, args.seq_len, args.vocab_size) for _ in range(args.batch)], pad_id=0)
    assert batch.n_pad == 0
    pairs = [preference_pair(g, args.seq_len, args.vocab_size) for _ in range(args.batch // 2)]
    tokens = batch.tokens.numel()
    scored = int((batch.labels[:, 1:] != IGNORE_INDEX).sum())
    rows, memory = [], []
    if args.compile:
        torch._dynamo.reset()

    def record(step: str, reference: str, ours_t: list[float], theirs_t: list[float], n_tokens: int, note: str):
        rows.append({"preset": name, "step": step, "reference": reference, "ours": [n_tokens / t for t in ours_t],
                     "theirs": [n_tokens / t for t in theirs_t],
                     "round_ratios": [t / o for o, t in zip(ours_t, theirs_t)], "note": note})
        print(f"  {name} {step}: MiniGPT {statistics.median(rows[-1]['ours']):,.0f} tok/s, {reference} "
              f"{statistics.median(rows[-1]['theirs']):,.0f} tok/s", flush=True)

    # --- full SFT
    compiled = torch.compile if args.compile else (lambda m: m)  # the optimizer keeps the original's parameters
    mg, hf = copy.deepcopy(base), load_hf(hf_dir)
    mg_opt, hf_opt = adamw(trainable_parameters(mg)), adamw([p for p in hf.parameters() if p.requires_grad])

    def mg_sft(model=mg, opt=mg_opt):
        loss = forward_loss(model, batch, pack=False)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    def hf_sft(model=hf, opt=hf_opt):
        loss = model(input_ids=batch.tokens, labels=batch.labels, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    mg_forward = compiled(mg)
    ta, tb, (la, lb) = race(functools.partial(mg_sft, mg_forward, mg_opt), hf_sft, args.warmup, args.repeats)
    check_close(f"{name} sft loss", la, lb)
    record("SFT full", "transformers", ta, tb, tokens, f"{scored / (tokens - args.batch):.0%} of targets scored; "
           f"first loss {la:.4f} / {lb:.4f}")
    full_state = (state_bytes(mg_opt), state_bytes(hf_opt), sum(p.numel() for p in trainable_parameters(mg)))
    del mg, hf, mg_opt, hf_opt

    # --- LoRA SFT
    mg = copy.deepcopy(base)
    apply_lora(mg, LORA_RANK, LORA_ALPHA, 0.0, "all-linear")
    hf = peft.get_peft_model(load_hf(hf_dir), peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                                               target_modules=list(HF_TARGETS), bias="none",
                                                               task_type="CAUSAL_LM"))
    result = peft.set_peft_model_state_dict(hf, adapter_state_dict(mg))
    assert not [k for k in result.missing_keys if "lora_" in k] and not result.unexpected_keys
    mg_opt, hf_opt = adamw(trainable_parameters(mg)), adamw([p for p in hf.parameters() if p.requires_grad])
    ta, tb, (la, lb) = race(functools.partial(mg_sft, compiled(mg), mg_opt), functools.partial(hf_sft, hf, hf_opt),
                              args.warmup, args.repeats)
    check_close(f"{name} lora loss", la, lb)
    n_lora = sum(p.numel() for p in trainable_parameters(mg))
    record("LoRA r8 all-linear", "PEFT", ta, tb, tokens, f"{n_lora:,} trainable parameters")
    memory.append({"preset": name, "targets": "q,k,v,o,gate,up,down", "full": full_state,
                   "lora": (state_bytes(mg_opt), state_bytes(hf_opt), n_lora)})
    del mg, hf, mg_opt, hf_opt

    # LoRA on q/v only (the paper's budget), MiniGPT only: one step to fill the optimizer state.
    mg = copy.deepcopy(base)
    apply_lora(mg, LORA_RANK, LORA_ALPHA, 0.0, ("q_proj", "v_proj"))
    mg_opt = adamw(trainable_parameters(mg))
    mg_sft(mg, mg_opt)
    memory.append({"preset": name, "targets": "q,v", "full": full_state,
                   "lora": (state_bytes(mg_opt), None, sum(p.numel() for p in trainable_parameters(mg)))})
    del mg, mg_opt

    # --- DPO, full model, frozen reference copy
    mg, mg_ref = copy.deepcopy(base), copy.deepcopy(base).requires_grad_(False)
    disable_dropout(mg)
    mg_opt = adamw(trainable_parameters(mg))
    reference = Reference(compiled(mg), compiled(mg_ref))
    pair_batch = pad_pairs(pairs, pad_id=0)
    trainer = trl_trainer(load_hf(hf_dir), load_hf(hf_dir).requires_grad_(False), len(pairs), root / "trl")
    torch.set_num_threads(args.threads)  # in case the trainer's setup changed it
    trl_batch = trainer.data_collator([{"prompt_ids": p.prompt_ids, "chosen_ids": p.chosen_ids,
                                        "rejected_ids": p.rejected_ids} for p in pairs])
    assert torch.equal(trl_batch["input_ids"], pair_batch.tokens) and int(trl_batch["attention_mask"].min()) == 1
    trainer.model.train()
    hf_opt = adamw([p for p in trainer.model.parameters() if p.requires_grad])
    logps = {}

    def mg_dpo():
        loss, values = batch_loss(reference.policy, reference, pair_batch, "train", BETA, "sigmoid",
                                  contextlib.nullcontext)
        loss.backward()
        mg_opt.step()
        mg_opt.zero_grad(set_to_none=True)
        logps.setdefault("ours", values["logps/chosen"].mean().item())
        return loss.item()

    def trl_dpo():
        loss = trainer.compute_loss(trainer.model, trl_batch)
        loss.backward()
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)
        logps.setdefault("theirs", trainer._metrics["train"]["logps/chosen"][-1])
        return loss.item()

    ta, tb, (la, lb) = race(mg_dpo, trl_dpo, args.warmup, args.repeats)
    check_close(f"{name} dpo summed log-probs (chosen)", logps["ours"], logps["theirs"])
    record("DPO full (sigmoid)", "TRL DPOTrainer.compute_loss", ta, tb, pair_batch.tokens.numel(),
           f"{len(pairs)} pairs = {pair_batch.tokens.shape[0]} rows, + reference forward; "
           f"first logps/chosen {logps['ours']:.2f} / {logps['theirs']:.2f}")
    return rows, memory


# ------------------------------------------------------------------------------------------------ report
def fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def spread(xs: list[float]) -> str:
    return f"{fmt(statistics.median(xs))} [{fmt(min(xs))}–{fmt(max(xs))}]"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(f for f in line.split(":", 1)[1].split() if f.startswith(FLAGS_SHOWN))
    except OSError:
        pass
    return "?"


def report(rows: list[dict], memory: list[dict], args, load_before, seconds: float) -> str:
    goals = {"SFT full": 1.2, "LoRA r8 all-linear": 1.2}
    out = ["| model | step | reference | reference tok/s | minigpt tok/s | minigpt / ref (medians) | "
           "per-round ratio, median [min–max] | goal | notes |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = statistics.median(r["ours"]) / statistics.median(r["theirs"])
        goal = goals.get(r["step"])
        verdict = f"≥ {goal}×: {'met' if ratio >= goal else 'missed'}" if goal else ""
        rr = r["round_ratios"]
        out.append(f"| {r['preset']} | {r['step']} | {r['reference']} | {spread(r['theirs'])} | {spread(r['ours'])} "
                   f"| **{ratio:.2f}×** | {statistics.median(rr):.2f} [{min(rr):.2f}–{max(rr):.2f}] | {verdict} "
                   f"| {r['note']} |")
    out += ["", "| model | LoRA targets (r 8) | AdamW state, full: minigpt / transformers | AdamW state, LoRA: "
            "minigpt / PEFT | trainable parameters, full / LoRA | LoRA / full | goal ≤ 2 % |", "|---|---|---|---|---|---|---|"]
    mib = lambda b: "–" if b is None else f"{b / 2**20:,.2f} MiB"  # noqa: E731
    for m in memory:
        (f_ours, f_theirs, f_n), (l_ours, l_theirs, l_n) = m["full"], m["lora"]
        share = l_ours / f_ours
        out.append(f"| {m['preset']} | {m['targets']} | {mib(f_ours)} / {mib(f_theirs)} | {mib(l_ours)} / "
                   f"{mib(l_theirs)} | {f_n:,} / {l_n:,} | **{share:.2%}** | {'met' if share <= 0.02 else 'missed'} |")
    versions = (f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
                f"trl {trl.__version__}")
    out += ["", f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()}; flags: {cpu_flags()}), "
            f"{torch.get_num_threads()} threads, {versions}; MiniGPT {'compiled' if args.compile else 'eager'}; batch {args.batch} × {args.seq_len}, vocabulary "
            f"{args.vocab_size}, {args.warmup} warm-up + {args.repeats} timed rounds; load average {load_before} -> "
            f"{loadavg()}; {seconds:.0f} s"]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="rows per step (DPO: batch / 2 pairs)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile the MiniGPT models (transformers stays eager)")
    args = p.parse_args()
    if args.batch < 2 or args.batch % 2 or args.warmup < 1 or args.repeats < 1:
        raise SystemExit("--batch must be even and >= 2; --warmup and --repeats >= 1")
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5's renamed-argument notices
    datasets.disable_progress_bars()
    load_before, t0 = loadavg(), time.perf_counter()
    rows, memory = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.presets.split(","):
            r, m = bench_preset(name, args, Path(tmp))
            rows += r
            memory += m
    print(report(rows, memory, args, load_before, time.perf_counter() - t0))


if __name__ == "__main__":
    main()
