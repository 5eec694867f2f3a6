"""`minigpt serve` and `minigpt chat`: a model behind the OpenAI-compatible HTTP server, or in the terminal."""
from __future__ import annotations

import argparse
import ipaddress
import math
import os
import sys
from typing import Optional

from minigpt.cli.common import add_command, positive_int
from minigpt.errors import MiniGPTError


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a model over an OpenAI-compatible HTTP API with continuous batching (FastAPI + uvicorn).

    CKPT: run dir, checkpoint dir, HF model dir, .gguf or llama2.c .bin. Endpoints: POST /v1/completions,
    POST /v1/chat/completions (streaming with "stream": true), GET /v1/models, /health, /metrics (Prometheus) and
    a chat page at /. With --api-key (or MINIGPT_API_KEY) every /v1/* request needs "Authorization: Bearer KEY".
    Up to --max-batch-size requests decode together (one KV-cache slot each) while their prompt + max_tokens stay
    within --max-batch-tokens; up to --max-queue more wait (429 beyond). Each slot holds --context tokens (default:
    the model's context, capped so that the KV cache takes at most half the free memory; printed at start-up).
    Request bodies above --max-body-bytes get 413, bodies not sent as application/json 415 (docs/security.md lists
    every limit). SIGTERM finishes running requests (for up to --shutdown-timeout seconds), cancels the rest (their
    streams end with an error event) and exits 0.

    Prompts' keys and values are kept in a prefix cache (--prefix-cache-bytes, default half the slots' KV cache;
    --no-prefix-cache turns it off), so a prompt sharing a start with an earlier one prefills only the rest.
    --adapter DIR merges one PEFT LoRA adapter into the weights; --adapter NAME=DIR (repeatable) serves each adapter
    under its NAME next to the base model: a request picks one with "model": NAME, and requests for different
    adapters decode in the same batch.

    --compile: a request running alone (one user) decodes through the compiled step of `minigpt generate
    --compile` over its own copy of its KV cache; two or more decode together in the batched eager forward.
    --compile-batch N (implies --compile): up to N running requests decode together through compiled steps of batch
    1, 2, 4, ... N (a request joining or leaving costs one copy of their caches); more in the eager batch. The steps
    are compiled before the server listens, once per machine, model and batch size (a minute or more each; then
    saved and loaded in well under a second).
    """
    import torch

    from minigpt.runtime import parse_size
    from minigpt.serve.app import serve

    if args.threads:
        torch.set_num_threads(args.threads)
    api_key = args.api_key if args.api_key is not None else os.environ.get("MINIGPT_API_KEY")
    if api_key is not None and not api_key.strip():
        # An empty key used to switch authentication off without a word: a typo must not open the server.
        source = "--api-key" if args.api_key is not None else "MINIGPT_API_KEY"
        raise MiniGPTError(f"{source} is empty; give a non-empty key, or leave it unset to serve without one")
    if api_key is None and not _is_loopback(args.host):
        print(f"warning: serving on {args.host} without an API key: anyone who can reach this address can use the "
              "model; set --api-key or MINIGPT_API_KEY", file=sys.stderr)
    for name in ("max_batch_size", "max_queue"):
        if getattr(args, name) < (1 if name == "max_batch_size" else 0):
            raise MiniGPTError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.compile_batch is not None and not 1 <= args.compile_batch <= args.max_batch_size:
        raise MiniGPTError(f"--compile-batch must be between 1 and --max-batch-size ({args.max_batch_size}), "
                           f"got {args.compile_batch}")
    _check_context(args.context)
    if not 0 <= args.port <= 65535:
        raise MiniGPTError(f"--port must be between 0 and 65535 (0: any free port), got {args.port}")
    for name in ("request_timeout", "shutdown_timeout"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise MiniGPTError(f"--{name.replace('_', '-')} must be a number of seconds >= 0, got {value}")
    max_body_bytes = parse_size(args.max_body_bytes, "--max-body-bytes", minimum=1024)
    if args.no_prefix_cache and args.prefix_cache_bytes is not None:
        raise MiniGPTError("--no-prefix-cache and --prefix-cache-bytes contradict each other; give one")
    prefix_cache_bytes = 0 if args.no_prefix_cache else (
        None if args.prefix_cache_bytes is None else parse_size(args.prefix_cache_bytes, "--prefix-cache-bytes"))
    adapter, adapters = _adapters(args.adapter)
    return serve(args.ckpt, host=args.host, port=args.port, api_key=api_key, model_name=args.model_name,
                 max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                 max_queue=args.max_queue, max_prefill_tokens=args.max_prefill_tokens,
                 request_timeout=args.request_timeout or None, shutdown_timeout=args.shutdown_timeout,
                 device=args.device, dtype=args.dtype, log_level=args.log_level, context=args.context,
                 max_body_bytes=max_body_bytes, adapter=adapter, adapters=adapters,
                 prefix_cache_bytes=prefix_cache_bytes, compile=args.compile_batch or int(args.compile))


def _adapters(values: Optional[list[str]]) -> tuple[Optional[str], dict[str, str]]:
    """``--adapter`` values -> (the one folder to merge, {name: folder} to serve by name). ``NAME=DIR`` names an
    adapter unless the whole value is an existing path (a folder may contain '='); a name may hold '/', as Hugging
    Face names do (``org/lora=DIR``)."""
    merged, named = None, {}
    for value in values or []:
        name, sep, folder = value.partition("=")
        if sep and name and not os.path.exists(value):
            if not folder:
                raise MiniGPTError(f"--adapter {value}: no folder after '='")
            if name in named:
                raise MiniGPTError(f"--adapter {name} is given twice")
            named[name] = folder
        elif merged is not None:
            raise MiniGPTError("only one --adapter DIR can be merged; to serve several, name each: --adapter NAME=DIR")
        else:
            merged = value
    if merged is not None and named:
        raise MiniGPTError("--adapter DIR (merged) and --adapter NAME=DIR (served by name) do not mix; name them all")
    return merged, named


def _check_context(context) -> None:
    """--context is checked before the model loads (the engine checks it against the model before allocating)."""
    if context is not None and context < 2:
        raise MiniGPTError(f"--context must be at least 2 tokens, got {context}")


def _is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def cmd_chat(args: argparse.Namespace) -> int:
    """Chat with a model in the terminal, answers streamed as they are generated (no server needed).

    The conversation is rendered with the model's chat template, or a plain "User: ... / Assistant:" one. Type
    /reset to start over and /quit (or Ctrl-D) to leave; Ctrl-C stops the current answer. --compile decodes
    through the compiled step of `minigpt generate --compile` over the conversation's own KV cache instead of the
    serving engine: the first answer waits for its compilation (once per machine and model: it is saved, and
    later runs load it).
    """
    import torch

    from minigpt.serve.chat import run_chat

    if args.threads:
        torch.set_num_threads(args.threads)
    _check_context(args.context)
    return run_chat(args.ckpt, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed, system=args.system, device=args.device, dtype=args.dtype,
                    adapter=args.adapter, context=args.context, prefix_cache=not args.no_prefix_cache,
                    compile=args.compile, stats=args.stats)


def register(sub) -> None:
    """Add this module's commands to the ``minigpt`` sub-parsers ``sub``."""
    p = add_command(sub, "serve", cmd_serve)
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
    p.add_argument("--context", type=int, default=None,
                   help="tokens per KV-cache slot, at most the model's context (default: the model's, capped so "
                   "the cache takes at most half the free memory)")
    p.add_argument("--max-body-bytes", dest="max_body_bytes", default="4MiB",
                   help="largest request body; larger ones get 413 (default 4MiB)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=positive_int, help="torch intra-op threads of the model worker")
    p.add_argument("--log-level", dest="log_level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--adapter", metavar="[NAME=]DIR", action="append",
                   help="a PEFT LoRA adapter folder: DIR is merged into the weights at load; NAME=DIR (repeatable) is "
                   "served as model NAME next to the base, several batched together")
    p.add_argument("--prefix-cache-bytes", dest="prefix_cache_bytes", default=None,
                   help="memory for cached prompt prefixes' KV blocks, e.g. 512MiB (default: half the KV cache)")
    p.add_argument("--no-prefix-cache", dest="no_prefix_cache", action="store_true",
                   help="prefill every prompt whole (no prefix cache)")
    p.add_argument("--compile", action="store_true",
                   help="decode a request running alone through the compiled step (as generate --compile), compiled "
                   "at start-up once per machine and model, then loaded from the compile cache")
    p.add_argument("--compile-batch", dest="compile_batch", type=int, default=None, metavar="N",
                   help="with --compile (implied): decode up to N running requests together through compiled steps "
                   "(batch sizes 1, 2, 4, ... N, each compiled at start-up)")

    p = add_command(sub, "chat", cmd_chat)
    p.add_argument("ckpt", help="run dir, checkpoint dir, HF model dir, .gguf or llama2.c .bin")
    p.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=256,
                   help="longest answer in tokens (--max-new-tokens: generate's name for it)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", dest="top_k", type=int, default=None)
    p.add_argument("--top-p", dest="top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="turn i samples with seed + i")
    p.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter folder, merged into the weights at load")
    p.add_argument("--context", type=int, default=None,
                   help="tokens of KV cache, at most the model's context (default: the model's, within half the "
                   "free memory); older turns are dropped to fit")
    p.add_argument("--system", help="a system message opening the conversation")
    p.add_argument("--no-prefix-cache", dest="no_prefix_cache", action="store_true",
                   help="recompute the whole conversation every turn instead of keeping its KV cache between turns")
    p.add_argument("--compile", action="store_true",
                   help="decode through the compiled step (as generate --compile): compiled at the first answer and "
                   "saved, so later runs start at once")
    p.add_argument("--stats", action="store_true",
                   help="after each answer print to stderr its time to first token, decode tokens/s and compile time")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=positive_int, help="torch intra-op threads")
