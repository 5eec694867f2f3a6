"""The compiled decode step in its two saved forms, side by side in one process: the ``torch.compile`` step
(``minigpt.infer.fastpath.aot``) against the AOTInductor package (``minigpt.infer.fastpath.aoti``), same weights.

``python scripts/bench_compiled_step.py MODEL [--precisions fp32,bf16,int8,int4] [--rounds 5] [--threads 2]``
loads MODEL (any source ``minigpt generate`` takes) once per form and precision, compiles or loads each step, then
times ``--new-tokens`` greedy tokens from BOS, the two forms interleaved round by round, and prints the medians
(tokens/s), their ratio and whether both wrote the same tokens.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from minigpt.infer.fastpath import load_for_inference
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams

PRECISIONS = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "int8": (torch.float32, "int8"),
              "int4": (torch.float32, "int4")}
FORMS = {"torch.compile": False, "AOTInductor": True}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--precisions", default="fp32,bf16,int8,int4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", dest="new_tokens", type=int, default=128)
    args = ap.parse_args()
    kinds = [k.strip() for k in args.precisions.split(",") if k.strip()]
    if any(k not in PRECISIONS for k in kinds) or args.rounds < 1:
        ap.error(f"precisions are {', '.join(PRECISIONS)}; --rounds >= 1")
    torch.set_num_threads(args.threads)
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0)
    for kind in kinds:
        dtype, quantize = PRECISIONS[kind]
        steps, tokens = {}, {}
        with torch.inference_mode():
            for form, aoti in FORMS.items():
                t = time.perf_counter()
                steps[form] = load_for_inference(args.model, dtype=dtype, quantize=quantize, compile=True, aoti=aoti)
                tokens[form] = list(generate_tokens(steps[form], [1], greedy))  # compiles or loads the step
                print(f"{kind} {form}: ready in {time.perf_counter() - t:.1f} s ({steps[form].compile_sources})",
                      flush=True)
            rates: dict[str, list[float]] = {form: [] for form in FORMS}
            for _ in range(args.rounds):
                for form, fp in steps.items():
                    t = time.perf_counter()
                    n = len(list(generate_tokens(fp, [1], greedy)))
                    rates[form].append(n / (time.perf_counter() - t))
        a, b = (statistics.median(rates[form]) for form in FORMS)
        same = tokens["torch.compile"] == tokens["AOTInductor"]
        print(f"{kind}: torch.compile {a:.2f} tok/s, AOTInductor {b:.2f} tok/s, ratio {b / a:.3f}x, same tokens: "
              f"{same}; rounds {[[round(r, 1) for r in rates[form]] for form in FORMS]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
