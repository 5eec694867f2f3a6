"""``minigpt bench``: MiniGPT and ``transformers`` side by side, in one process, on identical weights.

For each preset (``tiny``, ``small``, ``medium``; random weights, vocabulary 4096) -- or the one model given with
``--model PATH`` (a MiniGPT or Hugging Face directory, quantized or not, a GGUF or a llama2.c file) -- and dtype
(``float32``, ``bfloat16``) the model is saved, exported to a Hugging Face directory with :func:`minigpt.checkpoint.convert.export_hf` and
loaded back by ``transformers.LlamaForCausalLM`` (when ``transformers`` is installed), so both sides hold the same
numbers. Rows:

* ``decode-b1`` / ``decode-b8``: greedy generation of ``--new-tokens`` (128) tokens after a ``--prompt-len`` (32)
  token prompt, batch 1 and 8; tokens/s = ``batch * new_tokens / wall time of the whole call`` (prefill included,
  as a user sees it). Also reported: achieved weight bandwidth, GB/s = ``weight bytes * decode steps/s`` (each step
  reads every weight once, whatever the batch), and for the compiled variant its compile time.
* ``prefill``: one forward over ``--prefill-len`` (512) tokens into a fresh KV cache, next-token logits only
  (``logits_to_keep=1`` for ``transformers``, which is what its ``generate`` does); tokens/s.
* ``train``: one optimizer step on ``--train-batch x --train-seq`` (8 x 256) tokens: forward, float32
  cross-entropy, backward, AdamW (torch's fused kernel, both trainers' default), ``zero_grad``; ``bfloat16`` means bf16 autocast over float32 weights on both
  sides. tokens/s and MFU = ``tokens/s * FLOPs/token / measured peak of the dtype`` (:mod:`minigpt.model.accounting`).

Implementations (columns): ``transformers`` (eager, its default SDPA attention and dynamic cache, in the row's
dtype; in ``bfloat16`` decode and prefill rows also ``transformers-fp32``, the float32 baseline the performance
targets are stated against, with a second set of ratio columns ``/ tf fp32``), ``minigpt``
(:class:`~minigpt.infer.fastpath.FastPath`, eager), ``minigpt+compile`` (the compiled decode step / compiled training
forward) and ``minigpt+int8`` / ``minigpt+int4`` (weight-only int8 / int4, ``--quantize int8,int4``, compiled if
``--compile``). A ``--model`` that is not a Hugging Face directory is exported to one for ``transformers`` (a
quantized one runs without it). Each row times every implementation
round-robin (A B C A B C ...), after ``--warmup`` untimed runs each, ``--repeats`` times, and reports the median
with min-max and the ratio to ``transformers``. Shared machines drift; the interleaving keeps the ratios fair.

Output: a markdown table on stdout (``--out FILE`` also writes it) and, with ``--json FILE``, every measurement.
The command line (``minigpt bench`` and its ``model``, ``quant``, ``speculative`` and ``serve`` sub-commands) is
:mod:`minigpt.cli.bench`; ``quant`` and ``speculative`` measure with :mod:`minigpt.analysis.bench.reports`.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from minigpt.analysis.bench.table import REFERENCE, REFERENCE_FP32, ROWS
from minigpt.analysis.bench.timing import time_round_robin
from minigpt.checkpoint.convert import export_hf
from minigpt.checkpoint.native import (
    load_config,
    load_model,
    quantization_of,
    read_source,
    resolve_checkpoint,
    save_pretrained,
)
from minigpt.errors import MiniGPTError
from minigpt.infer.fastpath import FastPath, prepare
from minigpt.infer.generate import generate_batch
from minigpt.infer.sampling import SamplingParams
from minigpt.interop import hf
from minigpt.model.accounting import flops_per_token
from minigpt.model.config import preset
from minigpt.model.quant import SCHEMES
from minigpt.model.transformer import Transformer
from minigpt.runtime import DTYPES as RUNTIME_DTYPES
from minigpt.runtime import loadavg, machine_info, measure_peak_flops
from minigpt.train.mixed import autocast, compute_dtype

PRESET_NAMES = ("tiny", "small", "medium")
DTYPES = {name: RUNTIME_DTYPES[name] for name in ("float32", "bfloat16")}


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
    quantize: Optional[str] = None  # comma-separated: int8, int4
    model: Optional[str] = None  # a model source instead of the random presets
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
        bad = [q for q in self.quantizations if q not in SCHEMES]
        if bad:
            raise ValueError(f"--quantize takes {', '.join(SCHEMES)} (comma-separated), got {self.quantize!r}")

    @property
    def quantizations(self) -> list[str]:
        return [q.strip() for q in (self.quantize or "").split(",") if q.strip()]


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
    torch.manual_seed(settings.seed)
    # The context must hold the longest workload (`tiny`'s preset context, 256, is shorter than a 512-token
    # prefill); the weights do not depend on it.
    context = max(preset(name).max_seq_len, settings.prefill_len, settings.prompt_len + settings.new_tokens,
                  settings.train_seq)
    model = Transformer(preset(name, vocab_size=settings.vocab_size, max_seq_len=context))
    ckpt = save_pretrained(model, root / name)
    hf_dir = export_hf(ckpt, root / f"{name}-hf") if settings.transformers else None
    return ckpt, hf_dir


def _given_checkpoint(settings: BenchSettings, root: Path, log) -> tuple[str, Path, Optional[Path]]:
    """``(name, model source, Hugging Face directory or None)`` for ``--model``: the source itself when it is a
    Hugging Face directory, else (with transformers wanted) its export to ``root/model-hf``; a quantized model
    has none. Raises :class:`MiniGPTError` for a missing source or one too short for the workloads."""
    src = _check_given_model(settings)
    hf_dir = None
    if settings.transformers:
        if src.is_dir() and hf.is_hf_dir(src) and quantization_of(src) is None:
            hf_dir = src
        elif quantization_of(src) is None:
            hf_dir = export_hf(src, root / "model-hf")
        else:
            log(f"{src} is quantized: no transformers column")
    if quantization_of(src) is not None and "train" in settings.rows:
        log(f"{src} is quantized: no train row (train the float model)")
        settings.rows = [r for r in settings.rows if r != "train"]
    return f"{src.parent.name}/{src.name}", src, hf_dir


def _check_given_model(settings: BenchSettings) -> Path:
    """The resolved ``--model`` source; raises :class:`MiniGPTError` for a missing one or one whose context is too
    short for the workloads."""
    src = resolve_checkpoint(settings.model)
    config = load_config_of(src)
    need = max(settings.prefill_len, settings.prompt_len + settings.new_tokens)
    if "train" in settings.rows:
        need = max(need, settings.train_seq)
    if need > config.max_seq_len:
        raise MiniGPTError(f"{src} has a context of {config.max_seq_len} tokens; the workloads need {need} "
                           "(lower --prefill-len, --prompt-len + --new-tokens or --train-seq)")
    return src


def load_config_of(source: Path):
    """The :class:`ModelConfig` of any model source (directory or file)."""
    source = Path(source)
    if source.is_dir():
        return load_config(source)
    return read_source(source)[0]


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
    if impl == REFERENCE:
        mask = torch.ones_like(prompt)

        def run():
            with torch.inference_mode():
                return model.generate(prompt, attention_mask=mask, max_new_tokens=s.new_tokens,
                                      min_new_tokens=s.new_tokens, do_sample=False, pad_token_id=0)[:, prompt.shape[1]:]
        return run
    rows = prompt.tolist()
    greedy = SamplingParams(max_tokens=s.new_tokens, temperature=0)

    def run():
        return torch.tensor([c.tokens for c in generate_batch(model, rows, greedy)])
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
    model.train()
    # fused: the AdamW both trainers run by default (transformers' adamw_torch_fused, minigpt.train.optim)
    fused = next(model.parameters()).device.type in ("cpu", "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=fused)
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
    if settings.model:  # refused before anything is measured (or printed)
        _check_given_model(settings)
    machine = machine_info(transformers=_version("transformers"))
    log(f"machine: {machine['cpu']} | {machine['threads']} threads | load average {machine['load_before']}")
    measurements: list[Measurement] = []
    gen = torch.Generator().manual_seed(settings.seed)
    with tempfile.TemporaryDirectory(prefix="minigpt-bench-") as tmp:
        sources = ([_given_checkpoint(settings, Path(tmp), log)] if settings.model
                   else [(name, *_random_checkpoint(name, settings, Path(tmp))) for name in settings.presets])
        for name, ckpt, hf_dir in sources:
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
    workloads: dict[str, Callable[[], Any]] = {}
    fps: dict[str, FastPath] = {}
    vocab = load_config_of(ckpt).vocab_size if s.model else s.vocab_size
    if row.startswith("decode") or row == "prefill":
        variants = [("minigpt", False, None)]
        if s.compile:
            variants.append(("minigpt+compile", True, None))
        for quant in s.quantizations:
            variants.append((f"minigpt+{quant}", s.compile, quant))
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
    times, cpu, first, outputs = time_round_robin(workloads, s.repeats, s.warmup, log)

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
        return version(pkg)
    except Exception:
        return None
