"""``minigpt bench quant`` and ``minigpt bench speculative``: a trained checkpoint against a variant of itself.

* quant: int8 weight-only (:mod:`minigpt.model.quant`) against float32 on one checkpoint: validation perplexity of
  both (:func:`minigpt.eval.loss.validation_loss` over the val split of a prepared directory, non-overlapping
  windows) and greedy decode tokens/s at batch 1, the variants timed round-robin.
* speculative: a draft model proposing ``k`` tokens per round for a target (:mod:`minigpt.infer.speculative`)
  against the target alone, on prompts cut from the val split: tokens/s of both, speed-up, acceptance rate, and
  whether greedy outputs are identical (they must be: speculative decoding does not change the distribution).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from minigpt.analysis.bench.timing import time_round_robin
from minigpt.checkpoint.native import load_model, resolve_checkpoint
from minigpt.data.loader import load_split
from minigpt.eval.loss import validation_loss
from minigpt.infer.fastpath import load_for_inference, prepare
from minigpt.infer.generate import generate_batch, generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.infer.speculative import SpeculativeStats, speculative_tokens
from minigpt.model.quant import quantize_model


def _val_tokens(data_dir: str) -> torch.Tensor:
    return torch.from_numpy(load_split(data_dir, "val").astype("int64"))


def _prompts_from(tokens: torch.Tensor, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens evenly spaced over ``tokens`` (deterministic)."""
    step = max(1, (len(tokens) - length) // n)
    return [tokens[i * step:i * step + length].tolist() for i in range(n)]


def quant_report(ckpt: str, data: str, seq_len: int = 256, max_windows: Optional[int] = None, repeats: int = 5,
                 compile: bool = False, new_tokens: int = 128, log=lambda m: None) -> dict[str, Any]:
    """int8 weight-only vs float32 on one checkpoint: validation perplexity of both on ``data``'s val split, and
    greedy decode tokens/s at batch 1 (eager fast path, and compiled with ``compile``), timed round-robin.
    Returns a dict (perplexities, relative change, tokens/s medians and ranges, weight bytes)."""
    src = resolve_checkpoint(ckpt)
    tokens = _val_tokens(data)
    float_model = load_model(src)
    int8_model = quantize_model(load_model(src))
    log("evaluating validation loss (float32, int8)")
    with torch.inference_mode():
        loss_f = validation_loss(float_model, tokens, seq_len, max_windows)
        loss_q = validation_loss(int8_model, tokens, seq_len, max_windows)
    out: dict[str, Any] = {"checkpoint": str(src), "data": data, "seq_len": seq_len,
                           "val_tokens_scored": ((len(tokens) - 1) // seq_len if not max_windows else
                                                 min(max_windows, (len(tokens) - 1) // seq_len)) * seq_len,
                           "ppl_float32": math.exp(loss_f), "ppl_int8": math.exp(loss_q)}
    out["ppl_relative_change"] = out["ppl_int8"] / out["ppl_float32"] - 1
    prompt = _prompts_from(tokens, 1, 32)
    variants = {"float32": prepare(float_model), "int8": prepare(int8_model)}
    if compile:
        variants["float32+compile"] = prepare(load_model(src), compile=True)
        variants["int8+compile"] = prepare(load_model(src), quantize="int8", compile=True)
    out["weight_bytes"] = {k: v.weight_bytes() for k, v in variants.items()}
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0)
    workloads = {k: (lambda v=v: generate_batch(v, prompt, greedy)) for k, v in variants.items()}
    times, _, first, _ = time_round_robin(workloads, repeats, 1, log)
    out["decode_b1_tokens_per_s"] = {k: {"median": new_tokens / statistics.median(t), "min": new_tokens / max(t),
                                         "max": new_tokens / min(t)} for k, t in times.items()}
    out["compile_s"] = {k: v.compile_seconds for k, v in variants.items() if v.compiled}
    return out


def speculative_report(target_ckpt: str, draft_ckpt: str, data: str, k: int = 4, n_prompts: int = 8,
                       prompt_len: int = 32, new_tokens: int = 128, temperature: float = 0.0,
                       compile: bool = False, log=lambda m: None) -> dict[str, Any]:
    """Speculative decoding against the target alone on ``n_prompts`` prompts from ``data``'s val split: both
    timed round-robin per prompt, greedy outputs compared, acceptance counted. Returns a dict (tokens/s of each,
    speed-up = ratio of total times, acceptance rate, tokens per target forward, identical outputs)."""
    target = load_for_inference(resolve_checkpoint(target_ckpt), compile=compile)
    draft = load_for_inference(resolve_checkpoint(draft_ckpt), compile=compile)
    prompts = _prompts_from(_val_tokens(data), n_prompts, prompt_len)
    stats = SpeculativeStats()
    t_plain, t_spec, n_plain, n_spec, same = 0.0, 0.0, 0, 0, 0
    # Warm-up (and compilation) on the first prompt, untimed, at the timed length: a compiled step is specialised to
    # its cache length (bucketed), so a shorter warm-up would leave the compilation inside the first timed prompt.
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0)
    list(generate_tokens(target, prompts[0], greedy))
    list(speculative_tokens(target, draft, prompts[0], greedy, k))
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=new_tokens, temperature=temperature, seed=i)
        t0 = time.perf_counter()
        plain = list(generate_tokens(target, prompt, params))
        t1 = time.perf_counter()
        spec = list(speculative_tokens(target, draft, prompt, params, k, stats=stats))
        t2 = time.perf_counter()
        t_plain, t_spec = t_plain + t1 - t0, t_spec + t2 - t1
        n_plain, n_spec = n_plain + len(plain), n_spec + len(spec)
        same += plain == spec
        log(f"    prompt {i + 1}/{len(prompts)}: plain {len(plain) / (t1 - t0):.1f} tok/s, speculative "
            f"{len(spec) / (t2 - t1):.1f} tok/s, acceptance so far {stats.acceptance_rate:.1%}")
    return {"target": target_ckpt, "draft": draft_ckpt, "k": k, "temperature": temperature, "prompts": n_prompts,
            "new_tokens": new_tokens, "compile": compile, "plain_tokens_per_s": n_plain / t_plain,
            "speculative_tokens_per_s": n_spec / t_spec, "speedup": (n_spec / t_spec) / (n_plain / t_plain),
            "acceptance_rate": stats.acceptance_rate, "tokens_per_target_forward": stats.tokens_per_round,
            "identical_outputs": f"{same}/{len(prompts)}"}


def cmd_bench_quant(args: argparse.Namespace) -> int:
    """int8 weight-only quantization of a trained checkpoint: validation perplexity change and decode speed change.

    Perplexity over the whole validation split of --data (non-overlapping windows of --seq-len), float32 vs int8;
    decode tokens/s at batch 1 (eager fast path, and compiled with --compile), timed round-robin.
    """
    if args.threads:
        torch.set_num_threads(args.threads)
    r = quant_report(args.ckpt, args.data, args.seq_len, args.max_windows, args.repeats, args.compile,
                     log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"validation perplexity ({r['val_tokens_scored']:,} tokens): float32 {r['ppl_float32']:.4f}, int8 "
          f"{r['ppl_int8']:.4f} ({100 * r['ppl_relative_change']:+.3f} %)")
    base = r["decode_b1_tokens_per_s"]["float32"]["median"]
    for name, v in r["decode_b1_tokens_per_s"].items():
        print(f"decode b1 {name}: {v['median']:.1f} tok/s [{v['min']:.1f}-{v['max']:.1f}] ({v['median'] / base:.2f}x "
              f"float32 eager), weights {r['weight_bytes'][name] / 2**20:.1f} MiB"
              + (f", compile {r['compile_s'][name]:.0f} s" if name in r["compile_s"] else ""))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(r, indent=1) + "\n")
    return 0


def cmd_bench_speculative(args: argparse.Namespace) -> int:
    """Speculative decoding: a draft model proposing for a target, against the target alone.

    Prompts are --prompts windows of --prompt-len tokens from the validation split of --data; each generates
    --new-tokens tokens with and without the draft (--k proposals per round), greedy unless --temperature.
    Prints tokens/s of both, the speed-up, the acceptance rate and whether greedy outputs are identical.
    """
    if args.threads:
        torch.set_num_threads(args.threads)
    r = speculative_report(args.target, args.draft, args.data, args.k, args.prompts, args.prompt_len, args.new_tokens,
                           args.temperature, args.compile, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"target alone {r['plain_tokens_per_s']:.1f} tok/s, speculative (k={r['k']}) "
          f"{r['speculative_tokens_per_s']:.1f} tok/s: {r['speedup']:.2f}x; acceptance {r['acceptance_rate']:.1%}, "
          f"{r['tokens_per_target_forward']:.2f} tokens per target forward; identical outputs "
          f"{r['identical_outputs']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(r, indent=1) + "\n")
    return 0


def add_report_parsers(group) -> None:
    """Register ``quant`` and ``speculative`` in the ``minigpt bench`` sub-command ``group``."""
    for name, func in (("quant", cmd_bench_quant), ("speculative", cmd_bench_speculative)):
        d = func.__doc__ or ""
        q = group.add_parser(name, help=d.strip().splitlines()[0], description=d,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        q.set_defaults(func=func)
        if name == "quant":
            q.add_argument("ckpt", help="a trained checkpoint (run dir or model dir)")
            q.add_argument("--seq-len", dest="seq_len", type=int, default=256, help="evaluation window (tokens)")
            q.add_argument("--max-windows", dest="max_windows", type=int, help="cap on windows (default: all)")
            q.add_argument("--repeats", type=int, default=5)
        else:
            q.add_argument("target", help="target checkpoint")
            q.add_argument("draft", help="draft checkpoint (same tokenizer)")
            q.add_argument("--k", type=int, default=4, help="draft tokens per round")
            q.add_argument("--prompts", type=int, default=8)
            q.add_argument("--prompt-len", dest="prompt_len", type=int, default=32)
            q.add_argument("--new-tokens", dest="new_tokens", type=int, default=128)
            q.add_argument("--temperature", type=float, default=0.0)
        q.add_argument("--data", required=True, help="prepared data directory (its val split is used)")
        q.add_argument("--compile", action="store_true", help="also / instead run the compiled decode step")
        q.add_argument("--threads", type=int)
        q.add_argument("--json", dest="json_path", metavar="FILE")
