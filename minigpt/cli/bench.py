"""`minigpt bench` and its sub-commands: `model` (the default: MiniGPT against transformers), `quant`,
`speculative` and `serve`. The measuring is :mod:`minigpt.analysis.bench`; this module only reads the command line,
so building the parser imports no torch."""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from typing import Callable

from minigpt.cli.common import add_command, positive_int
from minigpt.errors import MiniGPTError
from minigpt.paths import check_file_path, write_output

_GIVEN = "_bench_model_options"  # namespace attribute: the model benchmark's options given before a sub-command


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse an unwritable --out/--json before the benchmark, which can run for an hour, rather than after it."""
    for flag, dest in (("--out", "out"), ("--json", "json_path")):
        value = getattr(args, dest, None)
        if value and value != "-":
            check_file_path(value, flag)


def _write_json(path: str, data) -> None:
    """--json: ``data`` as JSON to stdout (``-``) or into a file, written whole or not at all."""
    text = json.dumps(data, indent=1)
    if path == "-":
        print(text)
    else:
        write_output(path, text + "\n", "--json")


def cmd_bench(args: argparse.Namespace) -> int:
    """Benchmark MiniGPT against transformers on identical weights: decode (batch 1 and 8), prefill, training.

    Everything runs in this process, implementations timed round-robin; medians with min-max and ratios. See the
    module docstring of minigpt.analysis.bench.infer for the definitions. A full run (3 presets x 2 dtypes x 4 rows)
    takes long on a small CPU: select with --presets/--dtypes/--rows/--repeats.
    """
    from minigpt.analysis.bench.infer import BenchSettings, run_bench
    from minigpt.analysis.bench.table import format_table

    try:
        settings = BenchSettings(
            presets=_split(args.presets), dtypes=_split(args.dtypes), rows=_split(args.rows), repeats=args.repeats,
            warmup=args.warmup, compile=args.compile, compile_mode=args.compile_mode, quantize=args.quantize,
            model=args.model,
            transformers=args.transformers, threads=args.threads, prompt_len=args.prompt_len,
            new_tokens=args.new_tokens, prefill_len=args.prefill_len, train_batch=args.train_batch,
            train_seq=args.train_seq, seed=args.seed, cold_compile=args.cold_compile)
    except ValueError as e:
        raise MiniGPTError(str(e)) from None
    _check_outputs(args)
    command = "minigpt bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
    t0 = time.perf_counter()
    result = run_bench(settings)
    result["command"] = command
    result["wall_s"] = time.perf_counter() - t0
    table = format_table(result)
    summary = (f"\n{result['machine']['cpu']}, {result['machine']['threads']} threads, torch "
               f"{result['machine']['torch']}, transformers {result['machine']['transformers']}; load average "
               f"{result['machine']['load_before']} -> {result['machine']['load_after']}; {result['wall_s']:.0f} s")
    print(table + "\n" + summary)
    if args.out:
        write_output(args.out, table + "\n" + summary + "\n", "--out")
    if args.json_path:
        _write_json(args.json_path, result)
    return 0


def cmd_bench_quant(args: argparse.Namespace) -> int:
    """int8 weight-only quantization of a trained checkpoint: validation perplexity change and decode speed change.

    Perplexity over the whole validation split of --data (non-overlapping windows of --seq-len), float32 vs int8;
    decode tokens/s at batch 1 (eager fast path, and compiled with --compile), timed round-robin.
    """
    import torch

    from minigpt.analysis.bench.reports import quant_report

    _check_outputs(args)
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
        _write_json(args.json_path, r)
    return 0


def cmd_bench_speculative(args: argparse.Namespace) -> int:
    """Speculative decoding: a draft model proposing for a target, against the target alone.

    Prompts are --prompts windows of --prompt-len tokens from the validation split of --data; each generates
    --new-tokens tokens with and without the draft (--k proposals per round), greedy unless --temperature.
    Prints tokens/s of both, the speed-up, the acceptance rate and whether greedy outputs are identical.
    """
    import torch

    from minigpt.analysis.bench.reports import speculative_report

    _check_outputs(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    r = speculative_report(args.target, args.draft, args.data, args.k, args.prompts, args.prompt_len, args.new_tokens,
                           args.temperature, args.compile, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"target alone {r['plain_tokens_per_s']:.1f} tok/s, speculative (k={r['k']}) "
          f"{r['speculative_tokens_per_s']:.1f} tok/s: {r['speedup']:.2f}x; acceptance {r['acceptance_rate']:.1%}, "
          f"{r['tokens_per_target_forward']:.2f} tokens per target forward; identical outputs "
          f"{r['identical_outputs']}")
    if args.json_path:
        _write_json(args.json_path, r)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Benchmark `minigpt serve`: aggregate tokens/s of N concurrent streaming clients vs sequential, and TTFT.

    Starts the server on a free loopback port (from CKPT, or a random-init --preset model when none is given) or
    uses --url. For each --clients level, sends clients x --rounds greedy streaming completions one after another,
    then from that many concurrent clients, and prints a markdown table (--json: also the numbers as JSON).
    """
    import dataclasses

    from minigpt.analysis.bench.serve import bench_serve

    try:
        clients = tuple(int(c) for c in args.clients.split(","))
    except ValueError:
        raise MiniGPTError(f"--clients takes comma-separated integers, got {args.clients!r}") from None
    if not clients or min(clients) < 1 or args.rounds < 1 or args.max_tokens < 1 or args.repeats < 1:
        raise MiniGPTError("--clients, --rounds, --max-tokens and --repeats must be positive")
    levels = bench_serve(args.ckpt, preset=args.preset, url=args.url, clients=clients, rounds=args.rounds,
                         max_tokens=args.max_tokens, prompt_words=args.prompt_words, api_key=args.api_key,
                         threads=args.threads, max_batch_size=args.max_batch_size, repeats=args.repeats,
                         compile=args.compile_batch or int(args.compile))
    if args.json:
        print(json.dumps([dataclasses.asdict(level) for level in levels], indent=2))
    return 0


def _add_model_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add the model benchmark's options to ``p``; returns them."""
    from minigpt.analysis.bench.table import ROWS

    actions = []

    def add(*names, **kw):
        actions.append(p.add_argument(*names, **kw))

    add("--presets", default="tiny,small,medium", help="comma-separated: tiny,small,medium")
    add("--dtypes", default="float32,bfloat16", help="comma-separated: float32,bfloat16")
    add("--rows", default=",".join(ROWS), help=f"comma-separated: {','.join(ROWS)}")
    add("--repeats", type=int, default=5, help="timed runs per implementation (median reported)")
    add("--warmup", type=int, default=1, help="untimed runs first (compilation happens here)")
    add("--compile", action="store_true", help="add the compiled MiniGPT variant (decode step, training)")
    add("--compile-mode", dest="compile_mode", default=None,
        help="torch.compile mode, e.g. max-autotune-no-cudagraphs (default: inductor's default)")
    add("--quantize", help="add weight-only variants (decode, prefill): int8, int4 or int8,int4")
    add("--model", metavar="PATH", help="benchmark this model (checkpoint, HF dir, .gguf) instead of "
        "random --presets")
    add("--no-transformers", dest="transformers", action="store_false",
        help="MiniGPT only (also automatic when transformers is not installed)")
    add("--threads", type=positive_int, help="torch intra-op threads (default: torch's choice)")
    add("--prompt-len", dest="prompt_len", type=int, default=32)
    add("--new-tokens", dest="new_tokens", type=int, default=128)
    add("--prefill-len", dest="prefill_len", type=int, default=512)
    add("--train-batch", dest="train_batch", type=int, default=8)
    add("--train-seq", dest="train_seq", type=int, default=256)
    add("--seed", type=int, default=0)
    add("--warm-compile-cache", dest="cold_compile", action="store_false",
        help="reuse Inductor's on-disk cache (compile times then show cache hits, not first use)")
    add("--json", dest="json_path", metavar="FILE", help="write every measurement as JSON ('-' = stdout)")
    add("--out", metavar="FILE", help="also write the markdown table here")
    return actions


def _note_given(action: argparse.Action) -> None:
    """Make ``action`` (an option of ``minigpt bench`` itself) also record its flag on the namespace, so that a
    sub-command other than ``model`` can tell it was given: its own parser would silently overwrite the value
    (``bench --threads 4 serve``: serve's own --threads default), or never read it."""
    base = type(action)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, _GIVEN, [*getattr(namespace, _GIVEN, []), option_string])
        base.__call__(self, parser, namespace, values, option_string)

    action.__class__ = type(f"Noted{base.__name__}", (base,), {"__call__": __call__})


def _own_options_only(name: str, func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``func`` refusing the model benchmark's options given before the sub-command ``name`` (one line)."""

    @functools.wraps(func)
    def checked(args: argparse.Namespace) -> int:
        given = getattr(args, _GIVEN, [])
        if given:
            raise MiniGPTError(f"{', '.join(dict.fromkeys(given))} before `{name}` belong to the model benchmark "
                               f"(`minigpt bench`); give the options of `minigpt bench {name}` after `{name}`")
        return func(args)

    return checked


def register(sub) -> None:
    """Add ``minigpt bench`` (the model benchmark, also as ``minigpt bench model``) and its ``quant``,
    ``speculative`` and ``serve`` sub-commands to the ``minigpt`` sub-parsers ``sub``."""
    doc = cmd_bench.__doc__ or ""
    p = sub.add_parser("bench", help=doc.strip().splitlines()[0], description=doc,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    for action in _add_model_args(p):
        _note_given(action)
    p.set_defaults(func=cmd_bench)
    group = p.add_subparsers(dest="bench_command", metavar="{model,quant,speculative,serve}")
    m = group.add_parser("model", help="the model benchmark (the default)", description=doc,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    m.set_defaults(func=cmd_bench)
    for action in _add_model_args(m):  # defaults would overwrite options given before `model` (`bench --x model`)
        action.default = argparse.SUPPRESS

    q = add_command(group, "quant", _own_options_only("quant", cmd_bench_quant))
    q.add_argument("ckpt", help="a trained checkpoint (run dir or model dir)")
    q.add_argument("--seq-len", dest="seq_len", type=int, default=256, help="evaluation window (tokens)")
    q.add_argument("--max-windows", dest="max_windows", type=int, help="cap on windows (default: all)")
    q.add_argument("--repeats", type=int, default=5)
    s = add_command(group, "speculative", _own_options_only("speculative", cmd_bench_speculative))
    s.add_argument("target", help="target checkpoint")
    s.add_argument("draft", help="draft checkpoint (same tokenizer)")
    s.add_argument("--k", type=int, default=4, help="draft tokens per round")
    s.add_argument("--prompts", type=int, default=8)
    s.add_argument("--prompt-len", dest="prompt_len", type=int, default=32)
    s.add_argument("--new-tokens", dest="new_tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=0.0)
    for r in (q, s):
        r.add_argument("--data", required=True, help="prepared data directory (its val split is used)")
        r.add_argument("--compile", action="store_true", help="also / instead run the compiled decode step")
        r.add_argument("--threads", type=positive_int)
        r.add_argument("--json", dest="json_path", metavar="FILE", help="write the measurements as JSON ('-' = stdout)")

    v = add_command(group, "serve", _own_options_only("serve", cmd_bench_serve))
    v.add_argument("ckpt", nargs="?", help="model to serve (default: a random-init --preset model)")
    v.add_argument("--preset", default="small", help="preset of the random-init model (default small)")
    v.add_argument("--url", help="benchmark a running server instead of starting one")
    v.add_argument("--api-key", dest="api_key", help="API key of the server at --url")
    v.add_argument("--clients", default="1,4,16,32", help="concurrency levels (default 1,4,16,32)")
    v.add_argument("--rounds", type=int, default=2, help="requests per client at each level (default 2)")
    v.add_argument("--repeats", type=int, default=1, help="measure each level this many times; report medians")
    v.add_argument("--max-tokens", dest="max_tokens", type=int, default=64, help="new tokens per request")
    v.add_argument("--prompt-words", dest="prompt_words", type=int, default=24, help="words per prompt")
    v.add_argument("--max-batch-size", dest="max_batch_size", type=int, default=None,
                   help="server slots (default: the largest --clients)")
    v.add_argument("--threads", type=positive_int, help="torch threads of the server it starts")
    v.add_argument("--compile", action="store_true", help="start the server with --compile")
    v.add_argument("--compile-batch", dest="compile_batch", type=int, default=None, metavar="N",
                   help="start the server with --compile-batch N")
    v.add_argument("--json", action="store_true", help="also print the rows as JSON")
