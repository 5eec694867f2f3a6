"""`minigpt estimate` and `ablate`: measurements about models and this machine (`bench`: :mod:`minigpt.cli.bench`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from minigpt.cli.common import add_command, parse_value, positive_int
from minigpt.errors import MiniGPTError


def cmd_estimate(args: argparse.Namespace) -> int:
    """Estimate parameters, FLOPs per token, KV-cache bytes and training memory of a model, without building it.

    The model is --preset NAME (default tiny), or --config FILE (a training YAML, a MiniGPT or Hugging Face
    config.json, or a model directory), with --set FIELD=VALUE overrides (model.FIELD=VALUE works too). The report
    names the accounting behind each number; --json prints everything as JSON.
    """
    from minigpt.analysis.estimate import EstimateRequest, estimate, format_report, resolve_config

    overrides = {}
    for item in args.set or []:
        if "=" not in item:
            raise MiniGPTError(f"--set expects FIELD=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        overrides[key.removeprefix("model.")] = parse_value(value, f"--set {key}")
    config = resolve_config(args.preset, args.config, overrides)
    try:
        request = EstimateRequest(batch=args.batch, context=args.context, train_batch=args.train_batch,
                                  train_seq_len=args.train_seq_len, dtype=args.dtype)
    except ValueError as e:
        raise MiniGPTError(str(e)) from None
    result = estimate(config, request)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    """Train architecture variants side by side on Tiny Shakespeare and write docs/ablations.md with plots.

    COMPARISON: norm, norm_position, positions, ffn, heads, attention, tying, moe, qk_norm, softcap, optimizer, or
    all (default). Every variant of a comparison gets the same training tokens (--tokens or --steps), the same
    --seeds seeds (default 3), and (for architectural comparisons) the same non-embedding parameter count; the
    baseline is the preset itself and is shared. The report gives each variant's mean validation bits per byte
    with a 95 % interval and each difference to the baseline (paired by seed) with its interval: resolved, equal
    within --equal-within, or not resolved. --jobs N trains N runs at once when N x --threads fits the cores.
    Finished runs in --out-dir are reused unless --force.
    """
    from minigpt.analysis.ablate.run import AblationSettings, parse_tokens, run_ablations

    settings = AblationSettings(out_dir=Path(args.out_dir), docs_dir=Path(args.docs_dir), scale=args.scale,
                                threads=args.threads, steps=args.steps, seed=args.seed, force=args.force,
                                seeds=args.seeds, jobs=args.jobs, equal_within=args.equal_within,
                                tokens=parse_tokens(args.tokens) if args.tokens is not None else None,
                                data=args.data, command="minigpt ablate " + " ".join(sys.argv[2:]))
    settings.check()
    if args.report_only:
        from minigpt.analysis.ablate.run import rewrite_report

        print(f"wrote {rewrite_report(settings)}")
        return 0
    records = run_ablations(args.comparisons, settings)
    print(f"wrote {settings.docs_dir / 'ablations.md'} ({records['wall_s'] / 60:.1f} min)")
    return 0


def register(sub) -> None:
    """Add this module's commands to the ``minigpt`` sub-parsers ``sub``."""
    p = add_command(sub, "estimate", cmd_estimate)
    p.add_argument("--preset", help="model preset: tiny, small, medium, llama2-7b (default tiny)")
    p.add_argument("--config", help="training YAML, config.json or model directory")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="model config override (repeatable)")
    p.add_argument("--batch", type=int, default=1, help="decode batch for the KV-cache total")
    p.add_argument("--context", type=int, help="decode context for the KV-cache total and inference FLOPs "
                                               "(default max_seq_len)")
    p.add_argument("--train-batch", dest="train_batch", type=int, default=16)
    p.add_argument("--train-seq-len", dest="train_seq_len", type=int, help="default max_seq_len")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="training compute dtype (autocast over float32 master weights)")
    p.add_argument("--json", action="store_true", help="print every figure as JSON")

    p = add_command(sub, "ablate", cmd_ablate)
    p.add_argument("comparisons", nargs="*", default=["all"], metavar="COMPARISON")
    p.add_argument("--scale", default="tiny", help="tiny (default), small or medium")
    p.add_argument("--threads", type=positive_int, default=2, help="torch threads per run (default 2)")
    p.add_argument("--steps", type=int, help="override the scale's training steps per run")
    p.add_argument("--tokens", help="training tokens per run instead of --steps, e.g. 500k or 2M")
    p.add_argument("--seed", type=int, default=1337, help="first seed (default 1337)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per variant: SEED, SEED+1, ... (default 3)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs trained at once, each in its own process (JOBS x THREADS must fit the cores)")
    p.add_argument("--equal-within", dest="equal_within", type=float, default=0.02,
                   help="bpb bound: a difference whose 95 %% interval lies inside +-this is called equal "
                        "(default 0.02)")
    p.add_argument("--data", default="shakespeare", help="bundled corpus or text file (default shakespeare)")
    p.add_argument("--out-dir", dest="out_dir", default="runs/ablate", help="run directories (default runs/ablate)")
    p.add_argument("--docs-dir", dest="docs_dir", default="docs", help="where ablations.md and the plots go")
    p.add_argument("--force", action="store_true", help="retrain runs that already finished")
    p.add_argument("--report-only", dest="report_only", action="store_true",
                   help="rewrite the report from the last run's measurements (OUT_DIR/ablations-SCALE.json)")
