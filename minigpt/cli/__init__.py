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

from minigpt.errors import MiniGPTError


def cmd_prepare(args: argparse.Namespace) -> int:
    """Tokenize a corpus into train.bin / val.bin token shards (numpy memmaps) plus meta.json.

    --data is a bundled corpus (shakespeare, tang-poems), a .txt / .jsonl / .parquet file, a directory saved by
    `datasets`, a dataset name, or hf:NAME[:CONFIG][:SPLIT] to stream a Hugging Face dataset (hub names need
    network access; a local directory of parquet/jsonl files works offline). Without --tokenizer a byte-level BPE
    of --vocab-size tokens is trained on the first --tokenizer-sample-bytes of the training split and saved as
    tokenizer.json in --out-dir.

    The input is streamed with bounded memory whatever its size, and tokenized in --workers processes (the output
    is byte-identical for any number). Progress goes to stderr (a bar on a terminal, else a line every 15 s), then
    one line with the throughput in MB/s of input text; stdout gets the meta.json contents. An interrupted run can
    simply be re-run: the token files are renamed into place only when complete.
    """
    from minigpt.data import prepare as data
    from minigpt.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_file(args.tokenizer) if args.tokenizer else None
    sample = (data.DEFAULT_TOKENIZER_SAMPLE_BYTES if args.tokenizer_sample_bytes is None
              else parse_size(args.tokenizer_sample_bytes, "--tokenizer-sample-bytes"))
    meta = data.prepare(args.data, args.out_dir, tokenizer=tok, vocab_size=None if tok else args.vocab_size,
                        val_fraction=args.val_fraction, seed=args.seed, workers=args.workers,
                        tokenizer_sample_bytes=sample, progress=True)
    print(json.dumps(meta, indent=2))
    return 0


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    """Train a byte-level BPE tokenizer (special tokens <|endoftext|>, <|pad|>) on text files; writes tokenizer.json."""
    from minigpt.data.sources import iter_documents, resolve_source
    from minigpt.tokenizer.tokenizer import train_tokenizer

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

    from minigpt.train.loop import TrainConfig, train

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
                "batch_size": "batch_size", "lr": "lr", "vocab_size": "vocab_size", "threads": "threads",
                "parallel": "parallel", "keep_checkpoints": "keep_checkpoints"}
    for flag, key in flag_map.items():
        value = getattr(args, flag)
        if value is not None:
            options[key] = value
    if args.resume:
        options["resume"] = True
    if args.compile:
        options["compile"] = True
    if args.activation_checkpointing:
        options["activation_checkpointing"] = True
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
    Temperature 0 is greedy decoding. Several prompts (--prompt repeated, or --prompt-file with --batch: one prompt
    per line) are generated together in one left-padded batch, each row stopping on its own; their completions are
    printed in order, separated by blank lines (--jsonl: one JSON object per prompt).

    Speed: the fast path (fused projections; --no-fast turns it off) runs by default; --compile compiles the
    single-token step (compile time is printed with --stats); --quantize int8 quantizes the weights at load time
    (a directory written by `minigpt quantize` is already quantized); --draft CKPT decodes speculatively with a
    small draft model sharing the tokenizer (--draft-k tokens per round; the output is distributed exactly as
    without it, and identical when greedy).
    """
    import time

    import torch

    from minigpt.checkpoint.native import load_tokenizer, resolve_checkpoint
    from minigpt.infer.fastpath import load_for_inference
    from minigpt.infer.generate import generate_batch, generate_tokens
    from minigpt.runtime import DTYPES, pick_device
    from minigpt.tokenizer.tokenizer import StreamDecoder

    ckpt = resolve_checkpoint(args.ckpt)
    device = pick_device(args.device)
    options = dict(device=device, dtype=DTYPES[args.dtype], quantize=args.quantize, compile=args.compile,
                   compile_mode=args.compile_mode, fast=not args.no_fast)
    model = load_for_inference(ckpt, **options)
    tokenizer = load_tokenizer(ckpt)
    prompts = _read_prompts(args)

    def encode(text: str) -> list[int]:
        ids = tokenizer.encode(text)
        if tokenizer.bos_id is not None and (args.bos or not ids):
            ids = [tokenizer.bos_id] + ids
        return ids

    stop_ids = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    if tokenizer.bos_id is not None and tokenizer.bos_id not in stop_ids:
        stop_ids.append(tokenizer.bos_id)  # llama2.c models mark a new story with BOS
    if args.seed is not None:
        torch.manual_seed(args.seed)
    out = sys.stdout
    t0 = time.perf_counter()
    n_tokens, extra = 0, ""
    if len(prompts) > 1:
        if args.draft:
            raise MiniGPTError("--draft decodes one prompt at a time; give a single prompt")
        results = generate_batch(model, [encode(p) for p in prompts], args.max_new_tokens, args.temperature,
                                 args.top_k, args.top_p, args.seed, stop_ids, args.stop or [], tokenizer,
                                 truncate=args.truncate_prompt)
        for i, (prompt, r) in enumerate(zip(prompts, results)):
            n_tokens += len(r.tokens)
            if args.jsonl:
                out.write(json.dumps({"index": i, "prompt": prompt, "completion": r.text, "tokens": len(r.tokens),
                                      "finish_reason": r.finish_reason}, ensure_ascii=False) + "\n")
            else:
                out.write(("\n" if i else "") + (prompt if args.echo else "") + r.text + "\n")
        out.flush()
    else:
        ids = encode(prompts[0])
        if args.draft:
            from minigpt.infer.speculative import SpeculativeStats, speculative_tokens

            draft = load_for_inference(resolve_checkpoint(args.draft), **options)
            stats = SpeculativeStats()
            tokens = speculative_tokens(model, draft, ids, args.max_new_tokens, args.draft_k, args.temperature,
                                        args.top_k, args.top_p, args.seed, stop_ids, args.truncate_prompt, stats)
        else:
            tokens = generate_tokens(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                                     args.seed, stop_ids, truncate=args.truncate_prompt)
        if args.echo:
            out.write(prompts[0])
        decoder = StreamDecoder(tokenizer)
        text = ""
        for token in tokens:
            n_tokens += 1
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
        if args.draft:
            extra = (f" | speculative: {stats.acceptance_rate:.1%} of {stats.proposed} draft tokens accepted, "
                     f"{stats.tokens_per_round:.2f} tokens per target forward")
    if args.stats:
        seconds = time.perf_counter() - t0
        compile_s = getattr(model, "compile_seconds", 0.0)
        print(f"[{n_tokens} tokens in {seconds:.2f} s: {n_tokens / max(seconds, 1e-9):.1f} tokens/s"
              + (f" (of which compilation {compile_s:.1f} s)" if compile_s else "") + extra + "]", file=sys.stderr)
    return 0


def _read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of `generate`: every --prompt, else the --prompt-file (one prompt per line with --batch), else
    stdin (likewise), else the empty prompt."""
    if args.prompt:
        return list(args.prompt)
    if args.prompt_file:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise MiniGPTError(f"cannot read prompt file {args.prompt_file}: {e}") from None
    elif not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        return [""]
    if args.batch:
        prompts = [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise MiniGPTError("--batch: the prompt file has no non-empty line")
        return prompts
    return [text]


def cmd_quantize(args: argparse.Namespace) -> int:
    """Quantize a model to int8 weight-only (per-output-channel symmetric scales) and save it; every command that
    takes a checkpoint loads the result as is. Prints the weight bytes before and after."""
    from minigpt.checkpoint.native import load_model, load_tokenizer, resolve_checkpoint
    from minigpt.checkpoint.quantized import save_quantized
    from minigpt.model.quant import quantize_model

    src = resolve_checkpoint(args.ckpt)
    model = load_model(src)
    before = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    quantize_model(model)
    try:
        tokenizer = load_tokenizer(src)
    except MiniGPTError:
        tokenizer = None
    path = save_quantized(model, args.out, tokenizer)
    after = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"wrote {path} ({before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB of tensors)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Export a model to the Hugging Face or llama.cpp ecosystem.

    --format hf writes a LlamaForCausalLM directory (MixtralForCausalLM for a mixture of experts with experts on
    every layer and no shared expert; config.json, safetensors, sharded above --max-shard-size,
    generation_config.json, tokenizer files) that transformers loads offline. --format gguf writes a llama GGUF
    (OUT ending in .gguf is the file, else OUT/model.gguf) in float32, float16, bfloat16 or q8_0.
    """
    from minigpt.checkpoint.convert import export_gguf, export_hf
    from minigpt.checkpoint.native import resolve_checkpoint

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

    from minigpt.checkpoint.native import import_model, resolve_checkpoint

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    path = import_model(resolve_checkpoint(args.src), args.out, args.tokenizer, dtypes[args.dtype])
    print(f"wrote {path}")
    return 0


def cmd_checkpoint_consolidate(args: argparse.Namespace) -> int:
    """Turn a training checkpoint (also a sharded FSDP one) into a single-file model directory for export/generate."""
    from minigpt.checkpoint.native import resolve_checkpoint
    from minigpt.train.state import consolidate

    src = Path(args.ckpt)
    ckpt = src if (src / "dcp").is_dir() else resolve_checkpoint(src)
    out = consolidate(ckpt, Path(args.out))
    print(f"wrote {out}")
    return 0


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
    from minigpt.analysis.ablate.run import AblationSettings, run_ablations

    settings = AblationSettings(out_dir=Path(args.out_dir), docs_dir=Path(args.docs_dir), scale=args.scale,
                                threads=args.threads, steps=args.steps, seed=args.seed, force=args.force,
                                data=args.data, command="minigpt ablate " + " ".join(sys.argv[2:]))
    if args.report_only:
        from minigpt.analysis.ablate.run import rewrite_report

        print(f"wrote {rewrite_report(settings)}")
        return 0
    records = run_ablations(args.comparisons, settings)
    print(f"wrote {settings.docs_dir / 'ablations.md'} ({records['wall_s'] / 60:.1f} min)")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a model over an OpenAI-compatible HTTP API with continuous batching (FastAPI + uvicorn).

    CKPT: run dir, checkpoint dir, HF model dir, .gguf or llama2.c .bin. Endpoints: POST /v1/completions,
    POST /v1/chat/completions (streaming with "stream": true), GET /v1/models, /health, /metrics (Prometheus) and
    a chat page at /. With --api-key (or MINIGPT_API_KEY) every /v1/* request needs "Authorization: Bearer KEY".
    Up to --max-batch-size requests decode together (one KV-cache slot each) while their prompt + max_tokens stay
    within --max-batch-tokens; up to --max-queue more wait (429 beyond). SIGTERM finishes running requests (for up
    to --shutdown-timeout seconds), cancels the rest and exits 0.
    """
    import torch

    from minigpt.serve.app import serve

    if args.threads:
        torch.set_num_threads(args.threads)
    api_key = args.api_key if args.api_key is not None else os.environ.get("MINIGPT_API_KEY")
    for name in ("max_batch_size", "max_queue"):
        if getattr(args, name) < (1 if name == "max_batch_size" else 0):
            raise MiniGPTError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return serve(args.ckpt, host=args.host, port=args.port, api_key=api_key, model_name=args.model_name,
                 max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                 max_queue=args.max_queue, max_prefill_tokens=args.max_prefill_tokens,
                 request_timeout=args.request_timeout or None, shutdown_timeout=args.shutdown_timeout,
                 device=args.device, dtype=args.dtype, log_level=args.log_level)


def cmd_chat(args: argparse.Namespace) -> int:
    """Chat with a model in the terminal, answers streamed as they are generated (no server needed).

    The conversation is rendered with the model's chat template, or a plain "User: ... / Assistant:" one. Type
    /reset to start over and /quit (or Ctrl-D) to leave; Ctrl-C stops the current answer.
    """
    import torch

    from minigpt.serve.chat import run_chat

    if args.threads:
        torch.set_num_threads(args.threads)
    return run_chat(args.ckpt, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed, system=args.system, device=args.device, dtype=args.dtype)


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
                         threads=args.threads, max_batch_size=args.max_batch_size, repeats=args.repeats)
    if args.json:
        print(json.dumps([dataclasses.asdict(level) for level in levels], indent=2))
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
    p.add_argument("--parallel", choices=["none", "ddp", "fsdp"],
                   help="data parallelism under torchrun: DDP, or FSDP2 sharding per transformer block")
    p.add_argument("--activation-checkpointing", dest="activation_checkpointing", action="store_true",
                   help="recompute block activations in the backward pass to save memory")
    p.add_argument("--keep-checkpoints", dest="keep_checkpoints", type=int, help="how many checkpoints to keep")
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
    p.add_argument("--workers", type=int,
                   help="tokenizer processes (default: the usable CPU cores up to 8, or 1 with 2 cores or fewer)")
    p.add_argument("--tokenizer-sample-bytes", dest="tokenizer_sample_bytes", metavar="SIZE",
                   help="train the tokenizer on the first SIZE bytes of the training split, e.g. 500MB or 2GB; "
                        "0 = all of it (default 200MB)")

    tok = sub.add_parser("tokenizer", help="tokenizer tools").add_subparsers(dest="tokenizer_command", required=True)
    p = _add(tok, "train", cmd_tokenizer_train)
    p.add_argument("files", nargs="+", help="text files or bundled corpus names")
    p.add_argument("--vocab-size", dest="vocab_size", type=int, default=4096)
    p.add_argument("--out", default="tokenizer.json")

    p = _add(sub, "train", cmd_train)
    _common_train_flags(p)

    ck = sub.add_parser("checkpoint", help="checkpoint tools").add_subparsers(dest="checkpoint_command", required=True)
    p = _add(ck, "consolidate", cmd_checkpoint_consolidate)
    p.add_argument("ckpt", help="a run directory or a checkpoints/step_N directory")
    p.add_argument("out", help="output model directory")

    p = _add(sub, "generate", cmd_generate)
    p.add_argument("ckpt", help="run dir, checkpoint dir, or Hugging Face Llama dir")
    p.add_argument("--prompt", action="append", help="a prompt; repeat it to generate several prompts as a batch")
    p.add_argument("--prompt-file", dest="prompt_file")
    p.add_argument("--batch", action="store_true",
                   help="each non-empty line of --prompt-file (or stdin) is its own prompt; all run in one batch")
    p.add_argument("--jsonl", action="store_true", help="batch output as JSON lines (prompt, completion, ...)")
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
    p.add_argument("--no-fast", dest="no_fast", action="store_true",
                   help="run the model's own forward instead of the fused fast path")
    p.add_argument("--compile", action="store_true", help="torch.compile the single-token decode step")
    p.add_argument("--compile-mode", dest="compile_mode", default=None,
                   help="torch.compile mode, e.g. max-autotune-no-cudagraphs (default: inductor's default)")
    p.add_argument("--quantize", choices=["int8"], help="int8 weight-only quantization at load time")
    p.add_argument("--draft", metavar="CKPT", help="speculative decoding with this draft model (same tokenizer)")
    p.add_argument("--draft-k", dest="draft_k", type=int, default=4, help="draft tokens per round (default 4)")
    p.add_argument("--stats", action="store_true", help="print tokens/s (and compile time, acceptance) to stderr")

    p = _add(sub, "quantize", cmd_quantize)
    p.add_argument("ckpt", help="run dir, checkpoint dir, HF model dir, .gguf or llama2.c .bin")
    p.add_argument("out", help="output model directory (int8 weights + per-channel scales)")

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

    from minigpt.analysis.bench.infer import add_bench_parser

    bench = add_bench_parser(sub)

    p = _add(sub, "serve", cmd_serve)
    p.add_argument("ckpt", help="run dir, checkpoint dir, HF model dir, .gguf or llama2.c .bin")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", dest="api_key", help="require 'Authorization: Bearer KEY' on /v1/* "
                   "(default: $MINIGPT_API_KEY, else no auth)")
    p.add_argument("--model-name", dest="model_name", help="the model id clients send (default: the checkpoint's "
                   "directory or file name)")
    p.add_argument("--max-batch-size", dest="max_batch_size", type=int, default=16,
                   help="KV-cache slots = requests decoded together (default 16)")
    p.add_argument("--max-batch-tokens", dest="max_batch_tokens", type=int, default=None,
                   help="most prompt + max_tokens tokens the running requests may reserve together "
                   "(default: max-batch-size x context)")
    p.add_argument("--max-queue", dest="max_queue", type=int, default=256,
                   help="requests that may wait for a slot; more get 429 (default 256)")
    p.add_argument("--max-prefill-tokens", dest="max_prefill_tokens", type=int, default=None,
                   help="most padded prompt tokens prefilled between two decode steps (default max(context, 1024))")
    p.add_argument("--request-timeout", dest="request_timeout", type=float, default=600.0,
                   help="seconds a request may take, queue included (0: no limit; default 600)")
    p.add_argument("--shutdown-timeout", dest="shutdown_timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for running requests before cancelling them (default 30)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, help="torch intra-op threads of the model worker")
    p.add_argument("--log-level", dest="log_level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])

    p = _add(sub, "chat", cmd_chat)
    p.add_argument("ckpt", help="run dir, checkpoint dir, HF model dir, .gguf or llama2.c .bin")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=256, help="longest answer in tokens")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", dest="top_k", type=int, default=None)
    p.add_argument("--top-p", dest="top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="turn i samples with seed + i")
    p.add_argument("--system", help="a system message opening the conversation")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, help="torch intra-op threads")

    p = _add(bench, "serve", cmd_bench_serve)  # the `bench` group comes from minigpt.analysis.bench.infer
    p.add_argument("ckpt", nargs="?", help="model to serve (default: a random-init --preset model)")
    p.add_argument("--preset", default="small", help="preset of the random-init model (default small)")
    p.add_argument("--url", help="benchmark a running server instead of starting one")
    p.add_argument("--api-key", dest="api_key", help="API key of the server at --url")
    p.add_argument("--clients", default="1,4,16,32", help="concurrency levels (default 1,4,16,32)")
    p.add_argument("--rounds", type=int, default=2, help="requests per client at each level (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="measure each level this many times; report medians")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--prompt-words", dest="prompt_words", type=int, default=24, help="words per prompt")
    p.add_argument("--max-batch-size", dest="max_batch_size", type=int, default=None,
                   help="server slots (default: the largest --clients)")
    p.add_argument("--threads", type=int, help="torch threads of the server it starts")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
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
