"""`minigpt eval`: benchmark accuracy (ARC, HellaSwag, PIQA, WinoGrande, LAMBADA, CMMLU) and bits per byte."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from minigpt.cli.common import add_command
from minigpt.errors import MiniGPTError, json_loads
from minigpt.paths import check_file_path, write_output


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a model on benchmark tasks, scored as lm-evaluation-harness scores them.

    MODEL: a run directory, checkpoint directory, Hugging Face Llama directory, GGUF or llama2.c file.
    --tasks: comma-separated arc_easy, arc_challenge, hellaswag, piqa, winogrande, lambada_openai, cmmlu (or one
    cmmlu_<subject>), and bpb:PATH (perplexity and bits per byte of a text file). Multiple-choice tasks report acc
    and acc_norm (log-likelihood per character of the choice) with standard errors; LAMBADA last-word accuracy and
    perplexity. Prompts, few-shot examples (--num-fewshot, drawn with lm-eval's seed 1234) and tokenization follow
    lm-eval's task YAMLs; the data is read offline from --data-dir (default ../shared/data/eval).

    Prints a results table; --output writes lm-eval's results JSON layout (--samples adds per-item
    log-likelihoods); --report DIR writes a markdown table and a bar chart (with chance levels and, with
    --reference, the numbers of another results JSON beside ours).
    """
    from minigpt.eval.report import results_table, write_report
    from minigpt.eval.runner import evaluate_source

    tasks = [t for t in args.tasks.split(",") if t.strip()]
    # Output paths and the reference are checked before the evaluation, which can take hours, not after it.
    if args.output:
        check_file_path(args.output, "--output")
    if args.report and (Path(args.report).exists() and not Path(args.report).is_dir()):
        raise MiniGPTError(f"--report {args.report} is a file; give a folder to write results.md and results.png in")
    reference = None
    if args.reference:
        try:
            reference = json_loads(Path(args.reference).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise MiniGPTError(f"cannot read --reference {args.reference}: {e}") from None
        results = reference.get("results") if isinstance(reference, dict) else None
        # The report reads it only after the evaluation: a wrong shape ended that in a traceback.
        if not isinstance(results, dict) or not all(isinstance(v, dict) for v in results.values()):
            raise MiniGPTError(f"--reference {args.reference} is not a results JSON: it needs a \"results\" object "
                               "of one object per task, as --output writes")
    out = evaluate_source(args.model, tasks, device=args.device, dtype=args.dtype, fast=not args.no_fast,
                          bos=args.bos, num_fewshot=args.num_fewshot, limit=args.limit, batch_size=args.batch_size,
                          data_dir=args.data_dir, reuse_prefix=not args.no_reuse, samples=args.samples,
                          log=lambda line: print(line, file=sys.stderr, flush=True))
    if args.output:  # written whole or not at all: a temporary file renamed over the target
        write_output(args.output, json.dumps(out, indent=2, ensure_ascii=False) + "\n", "--output")
    if args.report:
        write_report(out, args.report, reference)
    print(results_table(out))
    return 0


def register(sub) -> None:
    """Add this module's commands to the ``minigpt`` sub-parsers ``sub``."""
    p = add_command(sub, "eval", cmd_eval)
    p.add_argument("model", help="run dir, checkpoint dir, Hugging Face dir, .gguf or llama2.c .bin")
    p.add_argument("--tasks", required=True, help="comma-separated task names, groups or bpb:PATH")
    p.add_argument("--num-fewshot", dest="num_fewshot", type=int, default=0, help="shots per prompt (default 0)")
    p.add_argument("--limit", type=int, default=None, help="first N items of each task (bpb: first N lines)")
    p.add_argument("--batch-size", dest="batch_size", type=int, default=16, help="requests per forward (default 16)")
    p.add_argument("--data-dir", dest="data_dir", default=None,
                   help="folder of the benchmark JSONL files (default ../shared/data/eval)")
    p.add_argument("--output", help="write the results JSON here (lm-eval's layout)")
    p.add_argument("--samples", action="store_true", help="include per-item requests and log-likelihoods")
    p.add_argument("--report", metavar="DIR", help="write results.md and results.png into DIR")
    p.add_argument("--reference", metavar="FILE", help="a results JSON to compare against in the report")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    bos = p.add_mutually_exclusive_group()
    bos.add_argument("--bos", dest="bos", action="store_true", default=None,
                     help="prepend BOS to every prompt (default: as the tokenizer does by default)")
    bos.add_argument("--no-bos", dest="bos", action="store_false")
    p.add_argument("--no-fast", dest="no_fast", action="store_true", help="run the model's own forward")
    p.add_argument("--no-reuse", dest="no_reuse", action="store_true",
                   help="run every choice whole instead of reusing its context's KV cache (same numbers, slower)")
