"""`minigpt generate --compile` without importing torch: the native launcher's command-line side.

:func:`run` takes the arguments of a ``minigpt generate`` call and, when the call is one the native runner
computes (:func:`~minigpt.cli.generate.native_eligible`) and a bundle for it exists (written by an earlier
``--compile`` call of the same model, options and machine: :mod:`minigpt.infer.launcher`), generates there and
returns the exit status; otherwise it returns None and the ordinary command runs. Output, stop handling and
``--stats`` are the ordinary command's.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

# Without a prefill package in the bundle (its compile failed), prompts longer than this go through the ordinary
# command's batched prefill: the runner then feeds the prompt a token at a time through the one-token step (~8-20 ms
# a token at 135M on 2 cores), which a long prompt would feel.
PROMPT_TOKENS_MAX = 64


def run(argv: list[str]) -> Optional[int]:
    """Run ``minigpt ARGV`` natively when it can be (see the module docstring); None when the ordinary command
    should run instead (nothing has been printed then)."""
    from minigpt.cli import generate
    from minigpt.cli.generate import native_eligible
    from minigpt.infer.launcher import NativeError, NativeRunner, cache_length, launch_key, read_manifest

    if not argv or argv[0] != "generate":
        return None
    # Only `generate`'s parser: building them all would import torch (the `bench` commands' module does).
    parser = argparse.ArgumentParser(prog="minigpt", add_help=False)
    generate.register(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args(argv)
    except SystemExit:  # a usage error: the ordinary command reports it
        return None
    if not native_eligible(args) or (args.threads is not None and args.threads < 1) or (
            args.max_new_tokens is not None and args.max_new_tokens < 1):
        return None
    t_load = time.perf_counter()
    source = Path(args.ckpt)
    key = launch_key(source, args.dtype, args.quantize, args.threads)
    manifest = read_manifest(key) if key is not None else None
    if manifest is None:
        return None
    from minigpt.infer.stops import StopChecker
    from minigpt.tokenizer.prompt import encode_prompt
    from minigpt.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(source, prefer_sentencepiece=True)  # as checkpoint.native.load_tokenizer
    ids = encode_prompt(tokenizer, args.prompt[0], bos=args.bos or manifest["bos"])
    # The default number of new tokens as the ordinary command takes it (manifest["positions"]: the model's context).
    max_new_tokens = args.max_new_tokens or min(generate.DEFAULT_NEW_TOKENS, manifest["positions"] - len(ids))
    prefill = manifest["prefill"]
    if ((prefill is None and len(ids) > PROMPT_TOKENS_MAX) or max_new_tokens < 1
            or len(ids) + max_new_tokens > manifest["positions"]):
        return None
    try:
        runner = NativeRunner(Path(manifest["runner"]), Path(manifest["package"]), Path(manifest["bundle"]),
                              args.threads or 0, None if prefill is None else Path(prefill), manifest["prefill_rows"])
    except NativeError as e:  # a damaged bundle: removed, so that this call (the ordinary command) writes it again
        shutil.rmtree(manifest["bundle"], ignore_errors=True)
        print(f"warning: {e}; running without the native runner (the bundle is written again)", file=sys.stderr)
        return None
    load_s = time.perf_counter() - t_load
    stop_ids = set(manifest["stop_ids"])
    stops = StopChecker(tokenizer, stop=tuple(args.stop or ()), context=ids)
    out = sys.stdout
    t0 = time.perf_counter()
    first_s: list[float] = []
    n_tokens = 0

    def on_token(token: int) -> bool:
        nonlocal n_tokens
        if token in stop_ids:  # the ordinary command neither prints nor counts it
            return True
        if not first_s:
            first_s.append(time.perf_counter() - t0)
        n_tokens += 1
        out.write(stops.push(token))
        out.flush()
        return stops.stopped

    if args.echo:
        out.write(args.prompt[0])
    with runner:
        runner.generate(ids, max_new_tokens, sorted(stop_ids), on_token,
                        cache_length(len(ids) + max_new_tokens, manifest["positions"]))
    if not stops.stopped:
        out.write(stops.finish())
    out.write("\n")
    out.flush()
    if args.stats:
        from minigpt.cli.generate import format_stats

        line = format_stats(load_s, 0.0, len(ids), first_s[0] if first_s else None, n_tokens,
                            time.perf_counter() - t0)
        print(line[:-1] + " | compiled steps: 1 native]", file=sys.stderr)
    return 0
