"""``minigpt bench``: MiniGPT and ``transformers`` side by side, in one process, on identical weights.

For each preset (``tiny``, ``small``, ``medium``; random weights, vocabulary 4096) and dtype (``float32``,
``bfloat16``) the model is saved, exported to a Hugging Face directory with :func:`minigpt.checkpoint.convert.export_hf` and
loaded back by ``transformers.LlamaForCausalLM`` (when ``transformers`` is installed), so both sides hold the same
numbers. Rows:

* ``decode-b1`` / ``decode-b8``: greedy generation of ``--new-tokens`` (128) tokens after a ``--prompt-len`` (32)
  token prompt, batch 1 and 8; tokens/s = ``batch * new_tokens / wall time of the whole call`` (prefill included,
  as a user sees it). Also reported: achieved weight bandwidth, GB/s = ``weight bytes * decode steps/s`` (each step
  reads every weight once, whatever the batch), and for the compiled variant its compile time.
* ``prefill``: one forward over ``--prefill-len`` (512) tokens into a fresh KV cache, next-token logits only
  (``logits_to_keep=1`` for ``transformers``, which is what its ``generate`` does); tokens/s.
* ``train``: one optimizer step on ``--train-batch x --train-seq`` (8 x 256) tokens: forward, float32
  cross-entropy, backward, AdamW, ``zero_grad``; ``bfloat16`` means bf16 autocast over float32 weights on both
  sides. tokens/s and MFU = ``tokens/s * FLOPs/token / measured peak of the dtype`` (:mod:`minigpt.model.accounting`).

Implementations (columns): ``transformers`` (eager, its default SDPA attention and dynamic cache, in the row's
dtype; in ``bfloat16`` decode and prefill rows also ``transformers-fp32``, the float32 baseline the performance
targets are stated against, with a second set of ratio columns ``/ tf fp32``), ``minigpt``
(:class:`~minigpt.infer.fastpath.FastPath`, eager), ``minigpt+compile`` (the compiled decode step / compiled training
forward) and ``minigpt+int8`` (weight-only int8, compiled if ``--compile``). Each row times every implementation
round-robin (A B C A B C ...), after ``--warmup`` untimed runs each, ``--repeats`` times, and reports the median
with min-max and the ratio to ``transformers``. Shared machines drift; the interleaving keeps the ratios fair.

Output: a markdown table on stdout (``--out FILE`` also writes it) and, with ``--json FILE``, every measurement.
The ``bench`` command leaves room for sub-commands (``minigpt bench serve``): :func:`add_bench_parser` returns the
sub-parser group.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from minigpt.runtime import DTYPES as RUNTIME_DTYPES
from minigpt.runtime import loadavg, machine_info

ROWS = ("decode-b1", "decode-b8", "prefill", "train")
PRESET_NAMES = ("tiny", "small", "medium")
DTYPES = {name: RUNTIME_DTYPES[name] for name in ("float32", "bfloat16")}
REFERENCE = "transformers"
REFERENCE_FP32 = "transformers-fp32"  # bf16 inference rows: transformers in float32 as well (the targets' baseline)


@dataclass
class BenchSettings:
    """What to measure; see the module docstring. ``impls`` None = every available implementation."""

    presets: list[str] = field(default_factory=lambda: ["tiny", "small", "medium"])
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    rows: list[str] = field(default_factory=lambda: list(ROWS))
    repeats: int = 5
    warmup: int = 1
    compile: bool = False
    compile_mode: Optional[str] = None
    quantize: Optional[str] = None
    transformers: bool = True
    threads: Optional[int] = None
    vocab_size: int = 4096
    prompt_len: int = 32
    new_tokens: int = 128
    prefill_len: int = 512
    train_batch: int = 8
    train_seq: int = 256
    seed: int = 0
    cold_compile: bool = True  # compile into an empty Inductor cache, so compile times are first-use times

    def __post_init__(self) -> None:
        for name, allowed in (("presets", PRESET_NAMES), ("dtypes", tuple(DTYPES)), ("rows", ROWS)):
            bad = [v for v in getattr(self, name) if v not in allowed]
            if bad:
                raise ValueError(f"unknown {name} {bad}; choose from {list(allowed)}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("repeats must be >= 1 and warmup >= 0")
        if self.quantize not in (None, "int8"):
            raise ValueError(f"--quantize must be int8, got {self.quantize!r}")


@dataclass
class Measurement:
    """One (preset, dtype, row, implementation) cell: ``value`` is the median of ``samples`` (tokens/s)."""

    preset: str
    dtype: str
    row: str
    impl: str
    samples: list[float]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def value(self) -> float:
        return statistics.median(self.samples)


# ------------------------------------------------------------------------------------------------ models
def _random_checkpoint(name: str, settings: BenchSettings, root: Path) -> tuple[Path, Optional[Path]]:
    """Save a random ``name`` preset model to ``root/name`` and, if transformers is wanted, export it to
    ``root/name-hf``. Returns both paths (the second None without transformers)."""
    from minigpt.checkpoint.convert import export_hf
    from minigpt.checkpoint.native import save_pretrained
    from minigpt.model.config import preset
    from minigpt.model.transformer import Transformer

    torch.manual_seed(settings.seed)
    # The context must hold the longest workload (`tiny`'s preset context, 256, is shorter than a 512-token
    # prefill); the weights do not depend on it.
    context = max(preset(name).max_seq_len, settings.prefill_len, settings.prompt_len + settings.new_tokens,
                  settings.train_seq)
    model = Transformer(preset(name, vocab_size=settings.vocab_size, max_seq_len=context))
    ckpt = save_pretrained(model, root / name)
    hf_dir = export_hf(ckpt, root / f"{name}-hf") if settings.transformers else None
    return ckpt, hf_dir


def _load_hf(hf_dir: Path, dtype: torch.dtype):
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None  # always generate exactly new_tokens
    return model.eval()


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------------------------- workloads
def _decode_workload(impl: str, model, batch: int, s: BenchSettings, prompt: torch.Tensor) -> Callable[[], Any]:
    from minigpt.infer.generate import generate_batch

    if impl == REFERENCE:
        mask = torch.ones_like(prompt)

        def run():
            with torch.inference_mode():
                return model.generate(prompt, attention_mask=mask, max_new_tokens=s.new_tokens,
                                      min_new_tokens=s.new_tokens, do_sample=False, pad_token_id=0)[:, prompt.shape[1]:]
        return run
    rows = prompt.tolist()

    def run():
        return torch.tensor([c.tokens for c in generate_batch(model, rows, s.new_tokens)])
    return run


def _prefill_workload(impl: str, model, s: BenchSettings, tokens: torch.Tensor) -> Callable[[], Any]:
    if impl == REFERENCE:
        def run():
            with torch.inference_mode():
                return model(tokens, use_cache=True, logits_to_keep=1).logits[:, -1]
        return run

    def run():
        with torch.inference_mode():
            cache = model.new_kv_cache(tokens.shape[0], tokens.shape[1])
            return model(tokens, 0, cache, last_only=True)[:, -1]
    return run


def _train_workload(impl: str, model, dtype: torch.dtype, s: BenchSettings, x: torch.Tensor, y: torch.Tensor,
                    compile: bool = False, torch_autocast: bool = False) -> Callable[[], Any]:
    """One AdamW step of ``model``. Mixed precision: ``torch.autocast`` for transformers (and with
    ``torch_autocast``), else MiniGPT's policy (:func:`minigpt.train.mixed.autocast`, which emulates bf16 with fp32
    kernels on CPUs without native bf16)."""
    import torch.nn.functional as F

    from minigpt.train.mixed import autocast

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    forward = torch.compile(model) if compile else model
    if dtype == torch.float32:
        ctx = None
    elif impl == REFERENCE or torch_autocast:
        ctx = lambda: torch.autocast("cpu", dtype=dtype)  # noqa: E731
    else:
        ctx = lambda: autocast("cpu", dtype)  # noqa: E731

    def step():
        with (ctx() if ctx else _null()):
            logits = forward(x).logits if impl == REFERENCE else forward(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------------------------------------ timing
def _time_round_robin(workloads: dict[str, Callable[[], Any]], repeats: int, warmup: int,
                      log: Callable[[str], None]):
    """Run every workload ``warmup`` times (the first call's time is kept: it holds compilation), then
    ``repeats`` rounds A B C ...; returns (wall seconds per run, process CPU seconds per run, first-call seconds,
    last outputs), each keyed by workload."""
    first, outputs = {}, {}
    for name, fn in workloads.items():
        for i in range(max(warmup, 1)):
            t0 = time.perf_counter()
            outputs[name] = fn()
            if i == 0:
                first[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in workloads}
    cpu: dict[str, list[float]] = {name: [] for name in workloads}
    for r in range(repeats):
        for name, fn in workloads.items():
            t0, c0 = time.perf_counter(), time.process_time()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
        log(f"    round {r + 1}/{repeats}: " + ", ".join(f"{n} {times[n][-1]:.3f}s" for n in workloads))
    return times, cpu, first, outputs


def run_bench(settings: BenchSettings, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)
              ) -> dict[str, Any]:
    """Measure everything ``settings`` selects; returns ``{"settings", "machine", "measurements": [...]}``
    (measurements as dicts with ``value``/``min``/``max`` in tokens/s). Raises ``ValueError`` for bad settings."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.cold_compile and settings.compile:
        # A private, empty cache: the compile times reported are what a first run pays (later runs reuse the
        # default cache and start in seconds).
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="minigpt-bench-inductor-")
    use_hf = settings.transformers and transformers_available()
    if settings.transformers and not use_hf:
        log("transformers is not installed: MiniGPT columns only (pip install transformers)")
    settings.transformers = use_hf
    machine = machine_info(transformers=_version("transformers"))
    log(f"machine: {machine['cpu']} | {machine['threads']} threads | load average {machine['load_before']}")
    measurements: list[Measurement] = []
    gen = torch.Generator().manual_seed(settings.seed)
    with tempfile.TemporaryDirectory(prefix="minigpt-bench-") as tmp:
        for name in settings.presets:
            ckpt, hf_dir = _random_checkpoint(name, settings, Path(tmp))
            for dtype_name in settings.dtypes:
                dtype = DTYPES[dtype_name]
                log(f"== {name} {dtype_name}")
                for row in settings.rows:
                    log(f"  -- {row}")
                    ms = _bench_row(name, dtype_name, dtype, row, ckpt, hf_dir, settings, gen, log)
                    measurements.extend(ms)
                    for m in ms:
                        log(f"    {m.impl}: {m.value:,.1f} tokens/s")
    machine["load_after"] = loadavg()
    out = {"settings": asdict(settings), "machine": machine, "measurements": []}
    for m in measurements:
        out["measurements"].append({**asdict(m), "value": m.value, "min": min(m.samples), "max": max(m.samples)})
    return out


def _bench_row(name, dtype_name, dtype, row, ckpt, hf_dir, s: BenchSettings, gen, log) -> list[Measurement]:
    from minigpt.checkpoint.native import load_model
    from minigpt.infer.fastpath import FastPath, prepare
    from minigpt.model.accounting import flops_per_token
    from minigpt.runtime import measure_peak_flops
    from minigpt.train.mixed import compute_dtype

    workloads: dict[str, Callable[[], Any]] = {}
    fps: dict[str, FastPath] = {}
    vocab = s.vocab_size
    if row.startswith("decode") or row == "prefill":
        variants = [("minigpt", False, None)]
        if s.compile:
            variants.append(("minigpt+compile", True, None))
        if s.quantize:
            variants.append((f"minigpt+{s.quantize}", s.compile, s.quantize))
        for impl, compiled, quant in variants:
            # Each variant gets its own copy: fusion and quantization rewrite the model in place.
            fps[impl] = prepare(load_model(ckpt, dtype=dtype), quantize=quant, compile=compiled and row != "prefill",
                                compile_mode=s.compile_mode)
        hf_models = {}
        if s.transformers:
            hf_models[REFERENCE] = _load_hf(hf_dir, dtype)
            if dtype != torch.float32:
                # The performance targets are ratios to transformers' float32 eager speed, whatever dtype MiniGPT
                # runs in (as gpt-fast's bf16 numbers are quoted), so the float32 reference runs here too.
                hf_models[REFERENCE_FP32] = _load_hf(hf_dir, torch.float32)
        if row.startswith("decode"):
            batch = 1 if row == "decode-b1" else 8
            prompt = torch.randint(0, vocab, (batch, s.prompt_len), generator=gen)
            for impl, hf_model in hf_models.items():
                workloads[impl] = _decode_workload(REFERENCE, hf_model, batch, s, prompt)
            for impl, fp in fps.items():
                workloads[impl] = _decode_workload(impl, fp, batch, s, prompt)
            n_tokens = batch * s.new_tokens
        else:
            tokens = torch.randint(0, vocab, (1, s.prefill_len), generator=gen)
            for impl, hf_model in hf_models.items():
                workloads[impl] = _prefill_workload(REFERENCE, hf_model, s, tokens)
            for impl, fp in fps.items():
                workloads[impl] = _prefill_workload(impl, fp, s, tokens)
            n_tokens = s.prefill_len
    else:  # train
        x = torch.randint(0, vocab, (s.train_batch, s.train_seq + 1), generator=gen)
        x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        ours = load_model(ckpt)  # float32 master weights; bf16 = autocast
        if s.transformers:
            workloads[REFERENCE] = _train_workload(REFERENCE, _load_hf(hf_dir, torch.float32), dtype, s, x, y)
        workloads["minigpt"] = _train_workload("minigpt", ours, dtype, s, x, y)
        if s.compile:
            workloads["minigpt+compile"] = _train_workload("minigpt", load_model(ckpt), dtype, s, x, y, compile=True)
        if dtype != torch.float32 and compute_dtype("cpu", dtype) != dtype:
            # Like for like: MiniGPT under torch.autocast too (the same slow bf16 kernels as transformers here).
            workloads["minigpt+torch-autocast"] = _train_workload("minigpt", load_model(ckpt), dtype, s, x, y,
                                                                  torch_autocast=True)
        n_tokens = s.train_batch * s.train_seq
    times, cpu, first, outputs = _time_round_robin(workloads, s.repeats, s.warmup, log)

    result = []
    if row == "train":
        fpt = flops_per_token(ours.config, sum(p.numel() for p in ours.parameters()), s.train_seq)
    for impl, ts in times.items():
        # CPU seconds of this process: on a shared machine, a second view that time spent descheduled does not blur.
        extra: dict[str, Any] = {"seconds": statistics.median(ts), "cpu_seconds": statistics.median(cpu[impl]),
                                 "first_call_s": first[impl]}
        samples = [n_tokens / t for t in ts]
        if row.startswith("decode") and impl in fps:
            fp = fps[impl]
            steps_per_s = statistics.median(samples) / (1 if row == "decode-b1" else 8)
            extra["weight_bytes"] = fp.weight_bytes()
            extra["gb_per_s"] = fp.weight_bytes() * steps_per_s / 1e9
            if fp.compiled:
                extra["compile_s"] = fp.compile_seconds
        if row.startswith("decode") and impl == REFERENCE and "minigpt" in outputs:
            extra["same_tokens_as_minigpt"] = bool(torch.equal(outputs[impl].cpu(), outputs["minigpt"].cpu()))
        if row == "train":
            # MFU against the measured peak of the arithmetic each implementation runs: fp32 for fp32 and for
            # MiniGPT's emulated bf16; for torch.autocast bf16, the bf16 GEMM that F.linear reaches.
            emulated = impl not in (REFERENCE, "minigpt+torch-autocast")
            gemm_dtype = compute_dtype("cpu", dtype) if emulated else dtype
            peak = measure_peak_flops("cpu", gemm_dtype)
            extra["mfu"] = statistics.median(samples) * fpt / peak
            extra["peak_gflops"] = peak / 1e9
            extra["gemm_dtype"] = str(gemm_dtype).replace("torch.", "")
            if impl == "minigpt+compile":
                extra["compile_s"] = first[impl] - statistics.median(ts)
        result.append(Measurement(name, dtype_name, row, impl, samples, extra))
    return result


# ------------------------------------------------------------------------------------------------ report
def _version(pkg: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:
        return None


def format_table(result: dict[str, Any]) -> str:
    """The markdown table: one line per (preset, dtype, row), a column per implementation with the median
    tokens/s [min-max] and the ratio to transformers, then GB/s (decode) or MFU (train) of each MiniGPT variant."""
    ms = result["measurements"]
    impls = []
    for m in ms:
        if m["impl"] not in impls:
            impls.append(m["impl"])
    impls.sort(key=lambda i: (i != REFERENCE, i != REFERENCE_FP32, i))
    ours = [i for i in impls if i not in (REFERENCE, REFERENCE_FP32)]
    refs = [r for r in (REFERENCE, REFERENCE_FP32) if r in impls]
    header = (["model", "dtype", "row"] + [f"{i} tok/s" for i in impls]
              + [f"{i} / {_REF_LABEL[r]}" for r in refs for i in ours] + ["notes"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    keys = []
    for m in ms:
        k = (m["preset"], m["dtype"], m["row"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        cell = {m["impl"]: m for m in ms if (m["preset"], m["dtype"], m["row"]) == k}
        row = list(k)
        for i in impls:
            m = cell.get(i)
            row.append("" if m is None else f"{_fmt(m['value'])} [{_fmt(m['min'])}–{_fmt(m['max'])}]")
        for r in refs:
            # A float32 row's own transformers column is the float32 reference.
            ref = cell.get(r) or (cell.get(REFERENCE) if r == REFERENCE_FP32 and k[1] == "float32" else None)
            for i in ours:
                m = cell.get(i)
                row.append("" if m is None or ref is None else f"**{m['value'] / ref['value']:.2f}×**")
        notes = []
        for i in impls:
            m = cell.get(i)
            if m is None:
                continue
            e = m["extra"]
            bits = []
            if "gb_per_s" in e:
                bits.append(f"{e['gb_per_s']:.1f} GB/s")
            if "mfu" in e:
                bits.append(f"MFU {100 * e['mfu']:.1f}%")
            if "compile_s" in e:
                bits.append(f"compile {e['compile_s']:.0f}s")
            if e.get("same_tokens_as_minigpt") is False:
                bits.append("greedy tokens differ")
            if bits:
                notes.append(f"{i}: " + ", ".join(bits))
        row.append("; ".join(notes))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


_REF_LABEL = {REFERENCE: "tf", REFERENCE_FP32: "tf fp32"}


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}" if x >= 10 else f"{x:.2f}"


# ----------------------------------------------------------------------------------------------- command
def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--presets", default="tiny,small,medium", help="comma-separated: tiny,small,medium")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32,bfloat16")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated: {','.join(ROWS)}")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per implementation (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (compilation happens here)")
    p.add_argument("--compile", action="store_true", help="add the compiled MiniGPT variant (decode step, training)")
    p.add_argument("--compile-mode", dest="compile_mode", default=None,
                   help="torch.compile mode, e.g. max-autotune-no-cudagraphs (default: inductor's default)")
    p.add_argument("--quantize", choices=["int8"], help="add the int8 weight-only variant (decode, prefill)")
    p.add_argument("--no-transformers", dest="transformers", action="store_false",
                   help="MiniGPT only (also automatic when transformers is not installed)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--prompt-len", dest="prompt_len", type=int, default=32)
    p.add_argument("--new-tokens", dest="new_tokens", type=int, default=128)
    p.add_argument("--prefill-len", dest="prefill_len", type=int, default=512)
    p.add_argument("--train-batch", dest="train_batch", type=int, default=8)
    p.add_argument("--train-seq", dest="train_seq", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-compile-cache", dest="cold_compile", action="store_false",
                   help="reuse Inductor's on-disk cache (compile times then show cache hits, not first use)")
    p.add_argument("--json", dest="json_path", metavar="FILE", help="write every measurement as JSON ('-' = stdout)")
    p.add_argument("--out", metavar="FILE", help="also write the markdown table here")


def cmd_bench(args: argparse.Namespace) -> int:
    """Benchmark MiniGPT against transformers on identical weights: decode (batch 1 and 8), prefill, training.

    Everything runs in this process, implementations timed round-robin; medians with min-max and ratios. See the
    module docstring of minigpt.analysis.bench.infer for the definitions. A full run (3 presets x 2 dtypes x 4 rows) takes long on
    a small CPU: select with --presets/--dtypes/--rows/--repeats.
    """
    from minigpt.errors import MiniGPTError

    try:
        settings = BenchSettings(
            presets=_split(args.presets), dtypes=_split(args.dtypes), rows=_split(args.rows), repeats=args.repeats,
            warmup=args.warmup, compile=args.compile, compile_mode=args.compile_mode, quantize=args.quantize,
            transformers=args.transformers, threads=args.threads, prompt_len=args.prompt_len,
            new_tokens=args.new_tokens, prefill_len=args.prefill_len, train_batch=args.train_batch,
            train_seq=args.train_seq, seed=args.seed, cold_compile=args.cold_compile)
    except ValueError as e:
        raise MiniGPTError(str(e)) from None
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
        Path(args.out).write_text(table + "\n" + summary + "\n")
    if args.json_path:
        text = json.dumps(result, indent=1)
        if args.json_path == "-":
            print(text)
        else:
            Path(args.json_path).write_text(text + "\n")
    return 0


# ------------------------------------------------------------------------------ quantization and speculative
def _val_tokens(data_dir: str) -> torch.Tensor:
    from minigpt.data.prepare import load_split

    return torch.from_numpy(load_split(data_dir, "val").astype("int64"))


def _prompts_from(tokens: torch.Tensor, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens evenly spaced over ``tokens`` (deterministic)."""
    step = max(1, (len(tokens) - length) // n)
    return [tokens[i * step:i * step + length].tolist() for i in range(n)]


@torch.inference_mode()
def validation_loss(model, tokens: torch.Tensor, seq_len: int, max_windows: Optional[int] = None,
                    batch: int = 8) -> float:
    """Mean next-token loss (nats/token) of ``model`` over non-overlapping windows of ``seq_len`` tiling
    ``tokens`` (every token scored once; at most ``max_windows`` windows, evenly spaced)."""
    from minigpt.data.prepare import eval_windows
    from minigpt.model.transformer import lm_loss

    n = (len(tokens) - 1) // seq_len
    x, y = eval_windows(tokens.numpy(), seq_len, min(n, max_windows or n))
    total = 0.0
    for i in range(0, x.shape[0], batch):
        total += lm_loss(model(x[i:i + batch]), y[i:i + batch]).item() * y[i:i + batch].numel()
    return total / y.numel()


def quant_report(ckpt: str, data: str, seq_len: int = 256, max_windows: Optional[int] = None, repeats: int = 5,
                 compile: bool = False, new_tokens: int = 128, log=lambda m: None) -> dict[str, Any]:
    """int8 weight-only vs float32 on one checkpoint: validation perplexity of both on ``data``'s val split, and
    greedy decode tokens/s at batch 1 (eager fast path, and compiled with ``compile``), timed round-robin.
    Returns a dict (perplexities, relative change, tokens/s medians and ranges, weight bytes)."""
    from minigpt.checkpoint.native import load_model, resolve_checkpoint
    from minigpt.infer.fastpath import prepare
    from minigpt.infer.generate import generate_batch
    from minigpt.model.quant import quantize_model

    src = resolve_checkpoint(ckpt)
    tokens = _val_tokens(data)
    float_model = load_model(src)
    int8_model = quantize_model(load_model(src))
    log("evaluating validation loss (float32, int8)")
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
    workloads = {k: (lambda v=v: generate_batch(v, prompt, new_tokens)) for k, v in variants.items()}
    times, _, first, _ = _time_round_robin(workloads, repeats, 1, log)
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
    from minigpt.checkpoint.native import resolve_checkpoint
    from minigpt.infer.fastpath import load_for_inference
    from minigpt.infer.generate import generate_tokens
    from minigpt.infer.speculative import SpeculativeStats, speculative_tokens

    target = load_for_inference(resolve_checkpoint(target_ckpt), compile=compile)
    draft = load_for_inference(resolve_checkpoint(draft_ckpt), compile=compile)
    prompts = _prompts_from(_val_tokens(data), n_prompts, prompt_len)
    stats = SpeculativeStats()
    t_plain, t_spec, n_plain, n_spec, same = 0.0, 0.0, 0, 0, 0
    # Warm-up (and compilation) on the first prompt, untimed, at the timed length: a compiled step is specialised to
    # its cache length (bucketed), so a shorter warm-up would leave the compilation inside the first timed prompt.
    list(generate_tokens(target, prompts[0], new_tokens))
    list(speculative_tokens(target, draft, prompts[0], new_tokens, k))
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        plain = list(generate_tokens(target, prompt, new_tokens, temperature, seed=i))
        t1 = time.perf_counter()
        spec = list(speculative_tokens(target, draft, prompt, new_tokens, k, temperature, seed=i, stats=stats))
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


def cmd_bench_quant(args: argparse.Namespace) -> int:
    """int8 weight-only quantization of a trained checkpoint: validation perplexity change and decode speed change.

    Perplexity over the whole validation split of --data (non-overlapping windows of --seq-len), float32 vs int8;
    decode tokens/s at batch 1 (eager fast path, and compiled with --compile), timed round-robin.
    """
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
        Path(args.json_path).write_text(json.dumps(r, indent=1) + "\n")
    return 0


def cmd_bench_speculative(args: argparse.Namespace) -> int:
    """Speculative decoding: a draft model proposing for a target, against the target alone.

    Prompts are --prompts windows of --prompt-len tokens from the validation split of --data; each generates
    --new-tokens tokens with and without the draft (--k proposals per round), greedy unless --temperature.
    Prints tokens/s of both, the speed-up, the acceptance rate and whether greedy outputs are identical.
    """
    if args.threads:
        torch.set_num_threads(args.threads)
    r = speculative_report(args.target, args.draft, args.data, args.k, args.prompts, args.prompt_len, args.new_tokens,
                           args.temperature, args.compile, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"target alone {r['plain_tokens_per_s']:.1f} tok/s, speculative (k={r['k']}) "
          f"{r['speculative_tokens_per_s']:.1f} tok/s: {r['speedup']:.2f}x; acceptance {r['acceptance_rate']:.1%}, "
          f"{r['tokens_per_target_forward']:.2f} tokens per target forward; identical outputs "
          f"{r['identical_outputs']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(r, indent=1) + "\n")
    return 0


def add_bench_parser(subparsers) -> argparse._SubParsersAction:
    """Register ``minigpt bench`` (and its alias ``minigpt bench model``) on the CLI's ``subparsers``; returns the
    ``bench`` sub-command group so that other benchmarks (``minigpt bench serve``) can add themselves."""
    doc = cmd_bench.__doc__ or ""
    p = subparsers.add_parser("bench", help=doc.strip().splitlines()[0], description=doc,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_args(p)
    p.set_defaults(func=cmd_bench)
    group = p.add_subparsers(dest="bench_command", metavar="{model,quant,speculative,serve}")
    m = group.add_parser("model", help="the model benchmark (the default)", description=doc,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_args(m)
    m.set_defaults(func=cmd_bench)

    for name, func in (("quant", cmd_bench_quant), ("speculative", cmd_bench_speculative)):
        d = func.__doc__ or ""
        q = group.add_parser(name, help=d.strip().splitlines()[0], description=d,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        q.set_defaults(func=func)
        if name == "quant":
            q.add_argument("ckpt", help="a trained checkpoint (run dir or model dir)")
            q.add_argument("--seq-len", dest="seq_len", type=int, default=256, help="evaluation window (tokens)")
            q.add_argument("--max-windows", dest="max_windows", type=int, help="cap on windows (default: all)")
            q.add_argument("--repeats", type=int, default=5)
        else:
            q.add_argument("target", help="target checkpoint")
            q.add_argument("draft", help="draft checkpoint (same tokenizer)")
            q.add_argument("--k", type=int, default=4, help="draft tokens per round")
            q.add_argument("--prompts", type=int, default=8)
            q.add_argument("--prompt-len", dest="prompt_len", type=int, default=32)
            q.add_argument("--new-tokens", dest="new_tokens", type=int, default=128)
            q.add_argument("--temperature", type=float, default=0.0)
        q.add_argument("--data", required=True, help="prepared data directory (its val split is used)")
        q.add_argument("--compile", action="store_true", help="also / instead run the compiled decode step")
        q.add_argument("--threads", type=int)
        q.add_argument("--json", dest="json_path", metavar="FILE")
    return group
