"""`minigpt generate` and `minigpt chat`: text from a model, in one shot or as a conversation."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from minigpt.cli.common import add_command
from minigpt.errors import MiniGPTError

DEFAULT_NEW_TOKENS = 200  # --max-new-tokens when not given (fewer when the context has less room)


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate text from a checkpoint (a run directory, a checkpoint directory or a Hugging Face Llama directory).

    The prompt is prefilled in one pass, then tokens are decoded one at a time through the KV cache and streamed.
    Temperature 0 is greedy decoding. Several prompts (--prompt repeated, or --prompt-file with --batch: one prompt
    per line) are generated together in one left-padded batch, each row stopping on its own; their completions are
    printed in order, separated by blank lines (--jsonl: one JSON object per prompt).

    Prompts are tokenized as the model's own tokenizer does: special-token text in them (<|im_start|>, <s>) becomes
    its id (--no-special: plain text), and BOS comes first when the tokenizer adds it (--bos: always). --chat
    QUESTION (with an optional --system message) renders one user turn with the model's chat template and prints
    only the answer. Generation stops on every end-of-generation id the model's files name (and, with --chat, the
    template's end-of-turn token such as <|im_end|> or <|eot_id|>).

    Speed: the fast path (fused projections; --no-fast turns it off) runs by default; --compile compiles the
    single-token step once per machine and shape (on a CPU as an AOTInductor package: a minute or two at 135M
    parameters the first time) and saves it (in $MINIGPT_COMPILE_CACHE, default ~/.cache/minigpt/compiled; "off"
    disables it), so later runs load it in milliseconds; a greedy (--temperature 0) one-prompt --compile call also
    leaves a bundle of the step's tensors there, and from the second such call on (prompts up to 64 tokens) runs
    in a native runner that never imports torch, the prompt fed through the one-token step (--no-native: neither
    written nor used); --quantize int8 / int4 quantizes the weights at load time (a directory written by `minigpt
    quantize` is already quantized); --draft CKPT decodes speculatively with a small draft model sharing
    the tokenizer (--draft-k tokens per round; the output is distributed exactly as without it, and identical when
    greedy); --threads N sets torch's intra-op threads.

    --stats prints to stderr, in seconds and tokens/s to two decimals: load (model and tokenizer), compile (the
    compiled step's first calls), prefill (prompt tokens / time to first token), time to first token, and decode
    (tokens after the first / their time, compilation excluded) -- the headline rate -- and how the compiled
    steps came (aoti-loaded / loaded: a saved package / step, aoti-saved / saved: compiled now and saved, jit:
    compiled in-process only).
    """
    import time

    import torch

    from minigpt.checkpoint.adapter import tokenizer_source
    from minigpt.checkpoint.native import load_chat_template, load_tokenizer, resolve_checkpoint
    from minigpt.infer.fastpath import load_for_inference
    from minigpt.infer.generate import generate_batch, generate_tokens
    from minigpt.infer.sampling import SamplingParams, check_length
    from minigpt.infer.stops import StopChecker, default_stop_ids
    from minigpt.runtime import DTYPES, pick_device
    from minigpt.serve.chat import encode_prompt, prompt_bos
    from minigpt.tokenizer.chat_template import ChatTemplate
    from minigpt.tokenizer.tokenizer import TokenizerMissing

    _check_prompt_flags(args)
    if args.seed is not None and not -2**63 <= args.seed < 2**64:  # what torch.manual_seed takes
        raise MiniGPTError(f"--seed must fit in 64 bits (-2**63 .. 2**64 - 1), got {args.seed}")
    if args.draft is not None and not 1 <= args.draft_k <= 64:
        raise MiniGPTError(f"--draft-k must be between 1 and 64 draft tokens a round, got {args.draft_k}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:  # one message for 0 and below (sampling's own
        raise MiniGPTError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")  # names max_tokens)
    if args.threads is not None:
        if args.threads < 1:
            raise MiniGPTError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    t_load = time.perf_counter()
    ckpt = resolve_checkpoint(args.ckpt)
    device = pick_device(args.device)
    options = dict(device=device, dtype=DTYPES[args.dtype], quantize=args.quantize, compile=args.compile,
                   compile_mode=args.compile_mode, fast=not args.no_fast, aoti=args.compile)
    # Built before the weights load so that a bad sampling flag fails at once; max_tokens is settled (below) once
    # the prompts are encoded and the context's room is known.
    params = SamplingParams(max_tokens=args.max_new_tokens or DEFAULT_NEW_TOKENS, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, stop=tuple(args.stop or ()), seed=args.seed)
    model = load_for_inference(ckpt, adapter=args.adapter, **options)
    words = tokenizer_source(ckpt, args.adapter)  # an adapter's own tokenizer and template, with tokens it added
    tokenizer = load_tokenizer(words)
    load_s = time.perf_counter() - t_load
    chat = None
    if args.chat is not None:
        chat = ChatTemplate.for_model(tokenizer, load_chat_template(words))
        messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
            {"role": "user", "content": args.chat}]
        prompts = [chat.render(messages, add_generation_prompt=True)]  # what --echo shows
        encoded = [chat.prompt(messages)]
        if args.bos and tokenizer.bos_id is not None and encoded[0][:1] != [tokenizer.bos_id]:
            encoded[0].insert(0, tokenizer.bos_id)
        params = params.replace(stop=params.stop + chat.stop)
    else:
        prompts = _read_prompts(args)
        bos = args.bos or prompt_bos(words, tokenizer)
        encoded = [encode_prompt(tokenizer, p, bos=bos, special=not args.no_special) for p in prompts]
    if len(prompts) > 1 and args.draft:
        raise MiniGPTError("--draft decodes one prompt at a time; give a single prompt")
    context = model.config.max_seq_len
    if args.context is not None:  # caps prompt + new tokens, hence the KV cache (sized to them)
        if not 2 <= args.context <= context:
            raise MiniGPTError(f"--context must be between 2 and the model's context of {context}, got {args.context}")
        context = args.context
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None:  # the default: fewer where the context has less room (a small model's 64 tokens)
        room = context - max(map(len, encoded))
        if room >= 1:
            max_new_tokens = min(DEFAULT_NEW_TOKENS, room)
        elif args.truncate_prompt:  # a prompt that fills the context keeps half of it
            max_new_tokens = min(DEFAULT_NEW_TOKENS, context // 2)
        # else None: check_length reports the prompt as too long for the context
        params = params.replace(max_tokens=max_new_tokens or DEFAULT_NEW_TOKENS)
    for i, ids in enumerate(encoded):
        # Checked here too, to name the flags (and before --echo prints the prompt).
        drop, _ = check_length(len(ids), max_new_tokens, context, truncate=args.truncate_prompt,
                               name="max_new_tokens",
                               hint="shorten the prompt, lower --max-new-tokens, or pass --truncate-prompt")
        encoded[i] = ids[drop:]
    stop_ids = default_stop_ids(tokenizer, chat)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    out = sys.stdout
    draft = None

    def compiled_so_far() -> float:  # seconds the model (and the draft) have spent compiling steps until now
        return sum(getattr(m, "compile_seconds", 0.0) for m in (model, draft) if m is not None)

    t0 = time.perf_counter()
    n_tokens, extra, first_s, compile_first = 0, "", None, 0.0
    if len(prompts) > 1:
        results = generate_batch(model, encoded, params, stop_ids=stop_ids, tokenizer=tokenizer,
                                 truncate=args.truncate_prompt)
        for i, (prompt, r) in enumerate(zip(prompts, results)):
            n_tokens += len(r.tokens)
            text = completion_text(tokenizer, encoded[i], r.tokens, params.stop)
            if args.jsonl:
                out.write(json.dumps({"index": i, "prompt": prompt, "completion": text, "tokens": len(r.tokens),
                                      "finish_reason": r.finish_reason}, ensure_ascii=False) + "\n")
            else:
                out.write(("\n" if i else "") + (prompt if args.echo else "") + text + "\n")
        out.flush()
    else:
        ids = encoded[0]
        if args.draft:
            from minigpt.infer.speculative import SpeculativeStats, speculative_tokens

            draft_source = resolve_checkpoint(args.draft)
            try:  # a draft without tokenizer files is taken on trust (its vocabulary size is still checked)
                difference = tokenizer.vocabulary_difference(load_tokenizer(draft_source))
            except TokenizerMissing:
                difference = None
            if difference:
                raise MiniGPTError(f"--draft {args.draft}: its tokenizer is not the model's ({difference}); "
                                   "speculative decoding needs a draft with the same tokenizer")
            draft = load_for_inference(draft_source, **options)
            stats = SpeculativeStats()
            tokens = speculative_tokens(model, draft, ids, params, args.draft_k, stop_ids=stop_ids,
                                        truncate=args.truncate_prompt, stats=stats)
        else:
            tokens = generate_tokens(model, ids, params, stop_ids=stop_ids, truncate=args.truncate_prompt)
        if args.echo:
            out.write(prompts[0])
        # Stop ids end `tokens` already. A completion is decoded after its prompt (" upon" after "Once"); a chat
        # answer on its own, its separating space being the template's.
        stops = StopChecker(tokenizer, stop=params.stop, context=() if chat is not None else ids)
        for token in tokens:
            if first_s is None:
                first_s = time.perf_counter() - t0
                compile_first = compiled_so_far()  # a speculative first token comes after the draft's first steps
            n_tokens += 1
            out.write(stops.push(token))
            out.flush()
            if stops.stopped:
                break
        else:
            out.write(stops.finish())
        out.write("\n")
        out.flush()
        if args.draft:
            extra = (f" | speculative: {stats.acceptance_rate:.1%} of {stats.proposed} draft tokens accepted, "
                     f"{stats.tokens_per_round:.2f} tokens per target forward")
    if args.stats:
        seconds = time.perf_counter() - t0
        line = format_stats(load_s, compiled_so_far(), sum(len(ids) for ids in encoded), first_s, n_tokens, seconds,
                            compile_first)
        sources = dict(getattr(model, "compile_sources", {}))
        if sources:  # how the compiled steps came: loaded from the compile cache, compiled and saved, or in-process
            extra = f" | compiled steps: {', '.join(f'{n} {how}' for how, n in sorted(sources.items()))}" + extra
        print(line[:-1] + extra + "]", file=sys.stderr)
    if native_eligible(args) and len(prompts) == 1:  # after the output and its timing: a first call's extra cost
        _write_native_bundle(model, ckpt, args, prompt_bos(ckpt, tokenizer), stop_ids)
    return 0


def native_eligible(args: argparse.Namespace) -> bool:
    """Whether a parsed ``generate`` call is one the native runner (:mod:`minigpt.cli.quick`) computes as the
    ordinary command does: greedy (``--temperature 0``), compiled, one ``--prompt``, batch 1, the fast path on the
    CPU, no chat template, draft, adapter, context cap or prompt truncation, and ``--no-native`` not given."""
    return (getattr(args, "command", None) == "generate" and args.compile and not args.no_native
            and args.temperature == 0 and args.prompt is not None and len(args.prompt) == 1
            and args.chat is None and args.prompt_file is None and not args.batch and not args.jsonl
            and args.draft is None and args.adapter is None and args.context is None and not args.truncate_prompt
            and not args.no_fast and args.device in ("auto", "cpu") and args.compile_mode is None
            and args.quantize in (None, "int8", "int4") and not args.no_special)


def _write_native_bundle(model, ckpt: Path, args: argparse.Namespace, bos: bool, stop_ids) -> None:
    """After a compiled greedy call, the bundle that lets the next identical call skip ``import torch``
    (:mod:`minigpt.cli.quick`); a failure to write it costs one warning, not this call's output."""
    import warnings

    from minigpt.infer.native import write_bundle

    def announce():
        print("writing the native runner's bundle, which later identical calls run without importing torch (once; "
              "compiling its prefill step takes minutes on a small CPU)", file=sys.stderr, flush=True)

    if getattr(model, "packages", None) is None:
        return
    try:
        write_bundle(model, ckpt, args.dtype, args.quantize, args.threads, bos, stop_ids, announce)
    except (OSError, RuntimeError) as e:
        warnings.warn(f"could not write the native runner's bundle ({type(e).__name__}: {str(e)[:300]})",
                      RuntimeWarning, stacklevel=2)


def format_stats(load_s: float, compile_s: float, prompt_tokens: int, first_s, n_tokens: int, seconds: float,
                 compile_first: float = 0.0) -> str:
    """The --stats line: ``load``, ``compile`` and ``time to first token`` in seconds, ``prefill`` and ``decode``
    in tokens/s, all to two decimals. The decode rate -- the headline -- counts the tokens after the first over
    the time after the first; compilation is excluded everywhere: ``compile_first`` of the ``compile_s`` seconds
    came before the first token (a speculative first token follows the draft's first, compiling, steps) and are
    taken from the first-token time, the rest from the decode time. ``first_s`` None (a batch, printed all at once)
    makes the rate every token over the whole call, compilation excluded, with no prefill or first-token figure."""
    rate = lambda n, s: n / s if s > 0 else float("nan")  # noqa: E731
    if first_s is None:
        decode_n, decode_s, head = n_tokens, seconds - compile_s, "prefill n/a | time to first token n/a"
    else:
        decode_n, decode_s = n_tokens - 1, seconds - first_s - (compile_s - compile_first)
        ttft = first_s - compile_first
        head = (f"prefill {prompt_tokens} tokens: {rate(prompt_tokens, ttft):.2f} tokens/s | time to first token "
                f"{ttft:.2f} s")
    return (f"[decode {rate(decode_n, decode_s):.2f} tokens/s ({decode_n} tokens in {decode_s:.2f} s) | {head} | "
            f"load {load_s:.2f} s | compile {compile_s:.2f} s | total {n_tokens} tokens in {seconds:.2f} s]")


def completion_text(tokenizer, prompt: list[int], tokens: list[int], stop: tuple[str, ...]) -> str:
    """The text of a completion's ``tokens`` (stop ids left out), decoded after its ``prompt`` and cut at the
    first ``stop`` string: :class:`~minigpt.infer.stops.StopChecker` with the prompt as context. ``generate_batch``
    decodes each row on its own, which drops a sentencepiece completion's leading space."""
    from minigpt.infer.stops import StopChecker

    stops = StopChecker(tokenizer, stop=stop, context=prompt)
    for token in tokens:
        stops.push(token)
        if stops.stopped:
            break
    else:
        stops.finish()
    return stops.text


def _check_prompt_flags(args: argparse.Namespace) -> None:
    """One-line errors for prompt flags that do not go together."""
    if args.chat is None:
        if args.system is not None:
            raise MiniGPTError("--system is the system message of a --chat question; give --chat too")
        return
    if args.prompt or args.prompt_file or args.batch:
        raise MiniGPTError("--chat is the prompt: leave out --prompt, --prompt-file and --batch")
    if args.no_special:
        raise MiniGPTError("--no-special applies to --prompt text; a chat template's special tokens are always ids")


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


def register(sub) -> None:
    """Add this module's commands to the ``minigpt`` sub-parsers ``sub``."""
    p = add_command(sub, "generate", cmd_generate)
    p.add_argument("ckpt", help="run dir, checkpoint dir, or Hugging Face Llama dir")
    p.add_argument("--prompt", action="append", help="a prompt; repeat it to generate several prompts as a batch")
    p.add_argument("--prompt-file", dest="prompt_file")
    p.add_argument("--chat", metavar="QUESTION",
                   help="ask QUESTION as a user message, rendered with the model's chat template (a plain "
                   "'User: ... / Assistant:' one without); prints only the answer")
    p.add_argument("--system", help="a system message before the --chat question")
    p.add_argument("--no-special", dest="no_special", action="store_true",
                   help="encode special-token text in the prompt (e.g. <|im_start|>) as ordinary text, not as ids")
    p.add_argument("--batch", action="store_true",
                   help="each non-empty line of --prompt-file (or stdin) is its own prompt; all run in one batch")
    p.add_argument("--jsonl", action="store_true", help="batch output as JSON lines (prompt, completion, ...)")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=None,
                   help=f"most tokens to generate (default {DEFAULT_NEW_TOKENS}, or what the context has room for "
                   "after the prompt when that is fewer; a value given must fit)"),
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", dest="top_k", type=int, default=None)
    p.add_argument("--top-p", dest="top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--bos", action="store_true",
                   help="prepend the BOS token to the prompt (default: when the model's tokenizer adds it)")
    p.add_argument("--echo", action="store_true", help="print the prompt before the generated text")
    p.add_argument("--truncate-prompt", dest="truncate_prompt", action="store_true",
                   help="drop the oldest prompt tokens instead of failing when the context is too short")
    p.add_argument("--context", type=int, default=None,
                   help="tokens of context (prompt + new tokens, and so the KV cache), at most the model's")
    p.add_argument("--no-fast", dest="no_fast", action="store_true",
                   help="run the model's own forward instead of the fused fast path")
    p.add_argument("--compile", action="store_true", help="torch.compile the single-token decode step")
    p.add_argument("--no-native", dest="no_native", action="store_true",
                   help="with --compile: neither use nor write the native runner's bundle (greedy one-prompt calls "
                   "otherwise run there, without importing torch, from the second call on)")
    p.add_argument("--compile-mode", dest="compile_mode", default=None,
                   help="torch.compile mode, e.g. max-autotune-no-cudagraphs (default: inductor's default)")
    p.add_argument("--quantize", choices=["int8", "int4"],
                   help="weight-only quantization at load time: int8 per channel, int4 in groups of 32 (Q4_0)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--draft", metavar="CKPT", help="speculative decoding with this draft model (same tokenizer)")
    p.add_argument("--draft-k", dest="draft_k", type=int, default=4, help="draft tokens per round (1 to 64, default 4)")
    p.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter folder, merged into the weights at load")
    p.add_argument("--stats", action="store_true",
                   help="print decode and prefill tokens/s, time to first token, load and compile time to stderr")
