"""``minigpt bench quant`` and ``minigpt bench speculative``: a trained checkpoint against a variant of itself.

* quant: int8 weight-only (:mod:`minigpt.model.quant`) against float32 on one checkpoint: validation perplexity of
  both (:func:`minigpt.eval.loss.validation_loss` over the val split of a prepared directory, non-overlapping
  windows) and greedy decode tokens/s at batch 1, the variants timed round-robin.
* speculative: a draft model proposing ``k`` tokens per round for a target (:mod:`minigpt.infer.speculative`)
  against the target alone, on prompts cut from the val split: tokens/s of both, speed-up, acceptance rate, and
  whether greedy outputs are identical (they must be: speculative decoding does not change the distribution).
"""
from __future__ import annotations

import math
import statistics
import time
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
