"""The ``minigpt`` command line. Each subcommand's help is its function's docstring.

Errors a user can fix (bad config, missing data, prompt too long, broken checkpoint) print one line,
``error: ...``, and exit with status 1; no traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from .errors import MiniGPTError


def cmd_prepare(args: argparse.Namespace) -> int:
    """Tokenize a corpus into train.bin / val.bin token shards (numpy memmaps) plus meta.json.

    --data is a bundled corpus (shakespeare, tang-poems), a .txt / .jsonl / .parquet file, a directory saved by
    `datasets`, or a dataset name. Without --tokenizer a byte-level BPE of --vocab-size tokens is trained on the
    training split and saved as tokenizer.json in --out-dir.
    """
    from . import data
    from .tokenizer import Tokenizer

    tok = Tokenizer.from_file(args.tokenizer) if args.tokenizer else None
    meta = data.prepare(args.data, args.out_dir, tokenizer=tok, vocab_size=None if tok else args.vocab_size,
                        val_fraction=args.val_fraction, seed=args.seed)
    print(json.dumps(meta, indent=2))
    return 0


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    """Train a byte-level BPE tokenizer (special tokens <|endoftext|>, <|pad|>) on text files; writes tokenizer.json."""
    from .data import iter_documents, resolve_source
    from .tokenizer import train_tokenizer

    def texts():
        for f in args.files:
            yield from iter_documents(resolve_source(f))

    tok = train_tokenizer(texts(), args.vocab_size)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tok.save(args.out)
    print(f"wrote {args.out} ({tok.vocab_size} tokens)")
    return 0


def _parse_value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def cmd_train(args: argparse.Namespace) -> int:
    """Train a model: AdamW, warmup + cosine schedule, evaluation in nats/token, perplexity and bits per byte.

    Options come from --config FILE.yaml, then flags, then --set key=value (model fields as model.KEY=VALUE).
    """
    import yaml

    from .train import TrainConfig, train

    options: dict[str, Any] = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise MiniGPTError(f"config file {path} does not exist")
        try:
            options = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise MiniGPTError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(options, dict):
            raise MiniGPTError(f"config file {path} must hold a mapping of options")
    flag_map = {"preset": "preset", "data": "data", "out_dir": "out_dir", "max_steps": "max_steps",
                "max_time": "max_time", "device": "device", "dtype": "dtype", "seed": "seed",
                "batch_size": "batch_size", "lr": "lr", "vocab_size": "vocab_size", "threads": "threads"}
    for flag, key in flag_map.items():
        value = getattr(args, flag)
        if value is not None:
            options[key] = value
    if args.resume:
        options["resume"] = True
    if args.compile:
        options["compile"] = True
    for item in args.set or []:
        if "=" not in item:
            raise MiniGPTError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        if key.startswith("model."):
            options.setdefault("model", {})[key[len("model."):]] = _parse_value(value)
        else:
            options[key] = _parse_value(value)
    try:
        cfg = TrainConfig.from_dict(options)
    except (TypeError, ValueError) as e:
        raise MiniGPTError(f"invalid training config: {e}") from None
    train(cfg)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate text from a checkpoint (a run directory, a checkpoint directory or a Hugging Face Llama directory).

    The prompt is prefilled in one pass, then tokens are decoded one at a time through the KV cache and streamed.
    Temperature 0 is greedy decoding.
    """
    import torch

    from .checkpoint import load_model, load_tokenizer, resolve_checkpoint
    from .generate import generate_tokens
    from .tokenizer import StreamDecoder
    from .train import DTYPES, pick_device

    ckpt = resolve_checkpoint(args.ckpt)
    device = pick_device(args.device)
    model = load_model(ckpt, device=device, dtype=DTYPES[args.dtype])
    tokenizer = load_tokenizer(ckpt)
    if args.prompt is not None:
        prompt = args.prompt
    elif args.prompt_file:
        try:
            prompt = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise MiniGPTError(f"cannot read prompt file {args.prompt_file}: {e}") from None
    elif not sys.stdin.isatty():
        prompt = sys.stdin.read()
    else:
        prompt = ""
    ids = tokenizer.encode(prompt)
    if tokenizer.bos_id is not None and (args.bos or not ids):
        ids = [tokenizer.bos_id] + ids
    stop_ids = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    if tokenizer.bos_id is not None and tokenizer.bos_id not in stop_ids:
        stop_ids.append(tokenizer.bos_id)  # llama2.c models mark a new story with BOS
    if args.seed is not None:
        torch.manual_seed(args.seed)
    out = sys.stdout
    if args.echo:
        out.write(prompt)
    decoder = StreamDecoder(tokenizer)
    text = ""
    for token in generate_tokens(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                                 args.seed, stop_ids, truncate=args.truncate_prompt):
        piece = decoder.push(token)
        text += piece
        hit = next((s for s in args.stop or [] if s in text), None)
        if hit is not None:
            cut = text.index(hit)
            out.write(piece[: max(0, len(piece) - (len(text) - cut))])
            break
        out.write(piece)
        out.flush()
    else:
        out.write(decoder.flush())
    out.write("\n")
    out.flush()
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Export a model to the Hugging Face or llama.cpp ecosystem.

    --format hf writes a LlamaForCausalLM directory (MixtralForCausalLM for a mixture of experts with experts on
    every layer and no shared expert; config.json, safetensors, sharded above --max-shard-size,
    generation_config.json, tokenizer files) that transformers loads offline. --format gguf writes a llama GGUF
    (OUT ending in .gguf is the file, else OUT/model.gguf) in float32, float16, bfloat16 or q8_0.
    """
    from .checkpoint import resolve_checkpoint
    from .export import export_gguf, export_hf

    src = resolve_checkpoint(args.ckpt)
    if args.format == "hf":
        path = export_hf(src, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size)
    else:
        path = export_gguf(src, args.out, dtype=args.dtype)
    print(f"wrote {path}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """Import a model into a MiniGPT model directory.

    SRC: a Hugging Face directory (LlamaForCausalLM, MistralForCausalLM without sliding window, Qwen2ForCausalLM;
    single-file or sharded safetensors; fp32/fp16/bf16), a llama GGUF file, or a llama2.c .bin checkpoint (its
    tokenizer.model / tok*.bin is taken from the same folder). Every command that takes a checkpoint also accepts
    SRC directly.
    """
    import torch

    from .checkpoint import import_model, resolve_checkpoint

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    path = import_model(resolve_checkpoint(args.src), args.out, args.tokenizer, dtypes[args.dtype])
    print(f"wrote {path}")
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    """Estimate parameters, FLOPs per token, KV-cache bytes and training memory of a model, without building it.

    The model is --preset NAME (default tiny), or --config FILE (a training YAML, a MiniGPT or Hugging Face
    config.json, or a model directory), with --set FIELD=VALUE overrides (model.FIELD=VALUE works too). The report
    names the accounting behind each number; --json prints everything as JSON.
    """
    from .estimate import EstimateRequest, estimate, format_report, resolve_config

    overrides = {}
    for item in args.set or []:
        if "=" not in item:
            raise MiniGPTError(f"--set expects FIELD=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        overrides[key.removeprefix("model.")] = _parse_value(value)
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

    COMPARISON: norm, norm_position, positions, ffn, heads, attention, tying, moe, or all (default). Every variant
    of a comparison gets the same training tokens, a fixed seed, and (for architectural comparisons) the same
    non-embedding parameter count; the baseline is the preset itself and is shared. At --scale tiny each comparison
    takes a few minutes on 2 CPU cores; small and medium are for bigger machines. Finished runs in --out-dir are
    reused unless --force.
    """
    from .ablate import AblationSettings, run_ablations

    settings = AblationSettings(out_dir=Path(args.out_dir), docs_dir=Path(args.docs_dir), scale=args.scale,
                                threads=args.threads, steps=args.steps, seed=args.seed, force=args.force,
                                data=args.data, command="minigpt ablate " + " ".join(sys.argv[2:]))
    if args.report_only:
        from .ablate import rewrite_report

        print(f"wrote {rewrite_report(settings)}")
        return 0
    records = run_ablations(args.comparisons, settings)
    print(f"wrote {settings.docs_dir / 'ablations.md'} ({records['wall_s'] / 60:.1f} min)")
    return 0


def _common_train_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="model preset: tiny, small, medium")
    p.add_argument("--config", help="YAML file of training options")
    p.add_argument("--data", help="prepared data dir, bundled corpus name, or text/jsonl/parquet path")
    p.add_argument("--out-dir", dest="out_dir", help="run directory")
    p.add_argument("--max-steps", dest="max_steps", type=int)
    p.add_argument("--max-time", dest="max_time", type=float, help="seconds of training")
    p.add_argument("--resume", action="store_true", help="continue from the latest good checkpoint in --out-dir")
    p.add_argument("--device", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int)
    p.add_argument("--batch-size", dest="batch_size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--vocab-size", dest="vocab_size", type=int, help="tokenizer size if the data is prepared here")
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (compile time counts as training)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="any training option, or model.FIELD=VALUE for the model config (repeatable)")


def _add(sub, name: str, func: Callable, **kw) -> argparse.ArgumentParser:
    doc = func.__doc__ or ""
    p = sub.add_parser(name, help=doc.strip().splitlines()[0], description=doc,
                       formatter_class=argparse.RawDescriptionHelpFormatter, **kw)
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minigpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = _add(sub, "prepare", cmd_prepare)
    p.add_argument("--data", required=True, help="bundled corpus name or path")
    p.add_argument("--out-dir", dest="out_dir", required=True)
    p.add_argument("--tokenizer", help="an existing tokenizer.json (else one is trained)")
    p.add_argument("--vocab-size", dest="vocab_size", type=int, default=4096)
    p.add_argument("--val-fraction", dest="val_fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1234, help="seed of the document-level validation split")

    tok = sub.add_parser("tokenizer", help="tokenizer tools").add_subparsers(dest="tokenizer_command", required=True)
    p = _add(tok, "train", cmd_tokenizer_train)
    p.add_argument("files", nargs="+", help="text files or bundled corpus names")
    p.add_argument("--vocab-size", dest="vocab_size", type=int, default=4096)
    p.add_argument("--out", default="tokenizer.json")

    p = _add(sub, "train", cmd_train)
    _common_train_flags(p)

    p = _add(sub, "generate", cmd_generate)
    p.add_argument("ckpt", help="run dir, checkpoint dir, or Hugging Face Llama dir")
    p.add_argument("--prompt")
    p.add_argument("--prompt-file", dest="prompt_file")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", dest="top_k", type=int, default=None)
    p.add_argument("--top-p", dest="top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--bos", action="store_true", help="prepend the BOS token to the prompt")
    p.add_argument("--echo", action="store_true", help="print the prompt before the generated text")
    p.add_argument("--truncate-prompt", dest="truncate_prompt", action="store_true",
                   help="drop the oldest prompt tokens instead of failing when the context is too short")

    p = _add(sub, "export", cmd_export)
    p.add_argument("ckpt", help="run dir, checkpoint dir, HF model dir, .gguf or llama2.c .bin")
    p.add_argument("out", help="output directory (or .gguf file for --format gguf)")
    p.add_argument("--format", required=True, choices=["hf", "gguf"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "q8_0"],
                   help="weight type (q8_0: gguf only)")
    p.add_argument("--max-shard-size", dest="max_shard_size", default="5GB",
                   help="largest safetensors file for --format hf, e.g. 500MB (default 5GB)")

    p = _add(sub, "import", cmd_import)
    p.add_argument("src", help="HF model dir, .gguf file or llama2.c .bin file")
    p.add_argument("out", help="MiniGPT model directory to write")
    p.add_argument("--tokenizer", help="tokenizer.json / tokenizer.model to use instead of the source's")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])

    p = _add(sub, "estimate", cmd_estimate)
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

    p = _add(sub, "ablate", cmd_ablate)
    p.add_argument("comparisons", nargs="*", default=["all"], metavar="COMPARISON")
    p.add_argument("--scale", default="tiny", help="tiny (default), small or medium")
    p.add_argument("--threads", type=int, default=2, help="torch threads per run (default 2)")
    p.add_argument("--steps", type=int, help="override the scale's training steps per run")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--data", default="shakespeare", help="bundled corpus or text file (default shakespeare)")
    p.add_argument("--out-dir", dest="out_dir", default="runs/ablate", help="run directories (default runs/ablate)")
    p.add_argument("--docs-dir", dest="docs_dir", default="docs", help="where ablations.md and the plots go")
    p.add_argument("--force", action="store_true", help="retrain runs that already finished")
    p.add_argument("--report-only", dest="report_only", action="store_true",
                   help="rewrite the report from the last run's measurements (OUT_DIR/ablations-SCALE.json)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MiniGPTError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:  # anything else a user can cause; MINIGPT_DEBUG=1 shows the traceback
        if os.environ.get("MINIGPT_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
