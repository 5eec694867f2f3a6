"""``minigpt ablate``: train architecture variants side by side on a bundled real corpus and report what differs.

Each comparison (:data:`COMPARISONS`) trains its variants with :func:`minigpt.train.loop.train` on Tiny Shakespeare
(``minigpt/corpora``, prepared with :func:`minigpt.data.prepare.prepare`) under one budget:

* **equal tokens** -- every variant sees the same ``steps x batch_size x seq_len`` training tokens (``--tokens``
  sets the count), drawn in the same order for the same seed; tokens/s are measured, not budgeted;
* **equal non-embedding parameters** where the comparison is about architecture (norms, positions, FFNs, attention
  heads): the variant's FFN width is adjusted until its non-embedding parameter count is as close to the baseline's
  as the width granularity allows (the table shows both counts). Tied vs untied differs by design (tying *is* the
  parameter saving), and dense vs MoE is compared at equal *active* parameters per token (equal FLOPs), the MoE
  holding more parameters in total -- which is the point of experts.

**Seeds**: every variant is trained with ``--seeds`` seeds (default 3: ``seed``, ``seed + 1``, ...); the seed sets
the initialisation and the data order, so the baseline and a variant trained with the same seed see the same
batches and their difference is taken per seed. The report gives each variant's mean validation bits per byte with a
95 % Student-t interval and each difference to the baseline with its interval, resolved or not
(:mod:`minigpt.analysis.ablate.stats`). ``--jobs N`` trains N runs at once, each in its own process with
``--threads`` threads, and is refused when ``N x threads`` exceeds the machine's cores (they would only slow each
other down and blur the timings).

Every run executes in a fresh spawned process, so its peak resident memory is its own. The baseline (the preset as
is) is trained once per seed and shared by all comparisons; finished runs are reused unless ``--force``. Speed is
measured after the runs, round-robin in one process per comparison, so that load from other jobs on a shared machine
falls on every variant alike. Position encodings are also evaluated on the same validation tokens cut into windows
of 1x, 2x and 4x the training context. The report (markdown and PNG plots, :mod:`minigpt.analysis.ablate.report`;
verdicts in :mod:`minigpt.analysis.ablate.verdicts`; benchmarks in :mod:`minigpt.analysis.ablate.bench`) goes to
``--docs-dir`` (default ``docs/``).
"""
from __future__ import annotations

import json
import math
import os
import re
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from minigpt.analysis.ablate.bench import attention_benchmark, norm_benchmark, throughput_benchmark
from minigpt.analysis.ablate.report import write_report
from minigpt.analysis.estimate import activation_bytes, count_parameters, kv_cache_bytes_per_token
from minigpt.checkpoint.native import load_model
from minigpt.data import loader
from minigpt.data import prepare as data_mod
from minigpt.errors import MiniGPTError
from minigpt.model.config import ModelConfig, preset
from minigpt.paths import write_text_atomic
from minigpt.runtime import machine_info, rss_bytes, run_in_child
from minigpt.tokenizer.tokenizer import Tokenizer
from minigpt.train.loop import TrainConfig, evaluate, train


@dataclass
class Variant:
    """One trained model: ``overrides`` of :class:`ModelConfig` fields on top of the scale's preset, and ``train``
    overrides of the training options (e.g. the optimizer)."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    match: str = "non_embedding"  # "non_embedding" | "active" | "none": which parameter count to equalise
    train: dict[str, Any] = field(default_factory=dict)


@dataclass
class Comparison:
    name: str
    title: str
    variants: list[Variant]
    budget: str  # the equal-budget rule, stated in the report
    context_eval: bool = False  # also evaluate at 1x, 2x, 4x the training context
    attention_bench: bool = False  # also time naive / flash_reference / sdpa against sequence length
    norm_bench: bool = False  # also time the norm layers alone


BASE = Variant("baseline", {})
EQUAL_PARAMS = "equal training tokens; equal non-embedding parameters (FFN width adjusted)"
COMPARISONS: dict[str, Comparison] = {c.name: c for c in [
    Comparison("norm", "RMSNorm vs LayerNorm", [BASE, Variant("layernorm", {"norm": "layernorm"})],
               EQUAL_PARAMS, norm_bench=True),
    Comparison("norm_position", "pre-norm vs post-norm", [BASE, Variant("post-norm", {"norm_position": "post"})],
               EQUAL_PARAMS),
    Comparison("positions", "RoPE vs sinusoidal vs learned vs ALiBi vs none",
               [BASE, Variant("sinusoidal", {"pos_encoding": "sinusoidal"}),
                Variant("learned", {"pos_encoding": "learned"}), Variant("alibi", {"pos_encoding": "alibi"}),
                Variant("nope", {"pos_encoding": "none"})],
               EQUAL_PARAMS + " (learned position embeddings are embedding parameters)", context_eval=True),
    Comparison("ffn", "SwiGLU vs GeGLU vs GELU vs ReLU vs ReLU\u00b2",
               [BASE, Variant("geglu", {"ffn": "geglu"}), Variant("gelu", {"ffn": "gelu"}),
                Variant("relu", {"ffn": "relu"}), Variant("relu2", {"ffn": "relu2"})], EQUAL_PARAMS),
    Comparison("heads", "MQA vs GQA vs MHA (key/value heads)",
               [BASE, Variant("gqa", {"n_kv_heads": "half"}), Variant("mha", {"n_kv_heads": "all"})], EQUAL_PARAMS),
    Comparison("attention", "sdpa vs flash_reference vs naive attention",
               [BASE, Variant("flash_reference", {"attention_impl": "flash_reference"}),
                Variant("naive", {"attention_impl": "naive"})],
               "equal training tokens; identical models (the three compute the same function)",
               attention_bench=True),
    Comparison("tying", "tied vs untied embeddings", [BASE, Variant("untied", {"tie_embeddings": False}, "none")],
               "equal training tokens; same shape (untying adds vocab_size x dim parameters, by design)"),
    Comparison("moe", "dense vs mixture of experts",
               [BASE, Variant("moe-4x-top2", {"n_experts": 4, "n_experts_per_token": 2, "moe_hidden_dim": "half"},
                              "active")],
               "equal training tokens; equal active parameters per token (4 experts of half the FFN width, top-2: "
               "the same FLOPs per token as the dense FFN, 2x its FFN parameters)"),
    Comparison("qk_norm", "QK-norm", [BASE, Variant("qk-norm", {"qk_norm": True}, "none")],
               "equal training tokens; same shape (QK-norm adds two head_dim gains per layer)"),
    Comparison("softcap", "logit soft-capping", [BASE, Variant("softcap-15", {"logit_softcap": 15.0}, "none")],
               "equal training tokens; identical models but for 15 tanh(logits / 15) on the output"),
    Comparison("optimizer", "AdamW vs Muon", [BASE, Variant("muon", {}, "none", {"optimizer": "muon"})],
               "equal training tokens; the same model; AdamW for every parameter vs Muon (muon_lr 0.02, the same "
               "schedule) for the hidden matrices and AdamW for embeddings, norms and biases"),
]}

# Budgets per scale. The model is built with 4x the training context so every position encoding can be evaluated
# beyond it (RoPE, ALiBi, sinusoidal tables are computed; learned rows past the context stay untrained).
SCALES: dict[str, dict[str, Any]] = {
    "tiny": dict(preset="tiny", seq_len=128, batch_size=8, steps=120, lr=2e-3, warmup_steps=15, eval_interval=20,
                 eval_windows=48, vocab_size=2048),
    "small": dict(preset="small", seq_len=256, batch_size=16, steps=1500, lr=1e-3, warmup_steps=100,
                  eval_interval=100, eval_windows=200, vocab_size=4096),
    "medium": dict(preset="medium", seq_len=512, batch_size=16, steps=4000, lr=6e-4, warmup_steps=200,
                   eval_interval=200, eval_windows=200, vocab_size=8192),
}


# ------------------------------------------------------------------------------------------------ configs

def _resolve(value: Any, base: ModelConfig, key: str) -> Any:
    """Symbolic overrides: ``"half"``/``"all"`` KV heads, ``"half"`` the FFN width."""
    if key == "n_kv_heads" and value == "half":
        return max(1, base.n_heads // 2)
    if key == "n_kv_heads" and value == "all":
        return base.n_heads
    if key == "moe_hidden_dim" and value == "half":
        return base.hidden_dim // 2
    return value


def variant_config(variant: Variant, scale: dict[str, Any], vocab_size: int) -> ModelConfig:
    """The :class:`ModelConfig` of ``variant`` at ``scale``, its FFN width matched to the baseline as
    ``variant.match`` says (see the module docstring)."""

    common = {"vocab_size": vocab_size, "max_seq_len": 4 * scale["seq_len"], "dropout": 0.0}
    base = preset(scale["preset"], **common)
    overrides = {k: _resolve(v, base, k) for k, v in variant.overrides.items()}
    cfg = preset(scale["preset"], **common, **overrides)
    if variant.match == "none" or cfg == base:
        return cfg
    key = "non_embedding" if variant.match == "non_embedding" else "active"
    target = count_parameters(base)[key]
    width = "moe_hidden_dim" if (variant.match == "active" and cfg.n_experts) else "hidden_dim"

    def gap(w: int) -> int:
        return abs(count_parameters(preset(scale["preset"], **common, **{**overrides, width: w}))[key] - target)

    # Parameters grow linearly with the width: step to the best integer from the default width.
    w = getattr(cfg, width)
    slope = gap(w + 1) - gap(w)  # +-(parameters per unit of width) while on one side of the target
    if slope:
        w = max(1, w - round(gap(w) / slope))
    w = min((w - 1, w, w + 1), key=gap)
    return preset(scale["preset"], **common, **{**overrides, width: w})


# ------------------------------------------------------------------------------------------------ runs

def _child(spec: dict[str, Any], result_path: str) -> None:
    """Body of a spawned run: train, evaluate at longer contexts if asked, record peak memory; writes JSON."""


    torch.set_num_threads(spec["threads"])
    log = open(Path(spec["train"]["out_dir"]) / "train.log", "w")
    sys.stdout = log
    idle_rss = rss_bytes()
    load_before = os.getloadavg()[0]
    cfg = ModelConfig.from_dict(spec["model"])
    try:
        result = train(TrainConfig(**spec["train"]))
    except (MiniGPTError, ValueError, RuntimeError) as e:  # a diverging variant is a finding, not a crash
        write_text_atomic(result_path, json.dumps({"name": spec["name"], "failed": f"{type(e).__name__}: {e}",
                                                 "parameters": count_parameters(cfg), "model": spec["model"],
                                                 "kv_bytes_per_token_fp32": kv_cache_bytes_per_token(cfg, 4)}))
        return
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"name": spec["name"], "result": result, "peak_rss_mb": peak_rss / 2**20,
           "peak_above_idle_mb": (peak_rss - idle_rss) / 2**20, "load_before": load_before,
           "load_after": os.getloadavg()[0], "parameters": count_parameters(cfg), "model": spec["model"],
           "kv_bytes_per_token_fp32": kv_cache_bytes_per_token(cfg, 4),
           "activation_mb_estimate": activation_bytes(cfg, spec["train"]["batch_size"], spec["train"]["seq_len"])
           / 2**20}
    write_text_atomic(result_path, json.dumps(out, indent=1))
    log.close()


def _context_child(checkpoint: str, data_dir: str, seq_len: int, n_tokens: int, threads: int, path: str) -> None:
    """Validation loss of a trained model on the same ``n_tokens`` tokens (the start of the validation split) cut
    into windows of 1x, 2x and 4x the training context: only the context available to each prediction changes."""


    torch.set_num_threads(threads)
    model = load_model(checkpoint)
    val = torch.from_numpy(loader.load_split(data_dir, "val")[:n_tokens + 1].astype("int64"))
    meta = loader.load_meta(data_dir)
    out = {}
    for factor in (1, 2, 4):
        length = seq_len * factor
        n = n_tokens // length
        x = val[:n * length].view(n, length)
        y = val[1:n * length + 1].view(n, length)
        loss = evaluate(model, x, y, max(1, 2048 // length), nullcontext())
        out[str(factor)] = {"val_loss": loss,
                            "val_bpb": loader.bits_per_byte(loss, meta["val"]["tokens"], meta["val"]["bytes"])}
    write_text_atomic(path, json.dumps(out))


def parse_tokens(text: str | int) -> int:
    """A token count such as ``"2M"``, ``"500k"``, ``"1.5e6"`` or ``250000`` (k/M/G = powers of 1000).

    Raises :class:`MiniGPTError` for anything else or a count below 1."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmg]?)\s*", str(text), re.IGNORECASE)
    try:
        n = int(float(m.group(1)) * 1000 ** "_kmg".index(m.group(2).lower() or "_")) if m else 0
    except ValueError:
        n = 0
    if n < 1:
        raise MiniGPTError(f"--tokens: cannot read {text!r} as a token count; write e.g. 500k, 2M or 1.5e6")
    return n


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass
class AblationSettings:
    out_dir: Path = Path("runs/ablate")
    docs_dir: Path = Path("docs")
    scale: str = "tiny"
    threads: int = 2
    steps: Optional[int] = None  # override the scale's step budget
    tokens: Optional[int] = None  # or set the training tokens per run (steps = tokens / (batch x context))
    seed: int = 1337
    seeds: int = 3  # runs per variant: seed, seed + 1, ...
    jobs: int = 1  # runs trained at once (jobs x threads <= cores)
    equal_within: float = 0.02  # bpb: a difference whose whole interval lies within +-this is called equal
    force: bool = False
    data: str = "shakespeare"
    command: str = ""  # the command line, quoted in the report

    def seed_list(self) -> list[int]:
        return [self.seed + i for i in range(self.seeds)]

    def check(self) -> None:
        """Raise :class:`MiniGPTError` for settings that cannot run: counts below 1, ``--steps`` with ``--tokens``,
        or ``jobs x threads`` above the usable cores."""
        for name in ("threads", "seeds", "jobs"):
            if getattr(self, name) < 1:
                raise MiniGPTError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.steps is not None and self.tokens is not None:
            raise MiniGPTError("--steps and --tokens both set the budget; give one")
        if self.equal_within <= 0:
            raise MiniGPTError(f"--equal-within must be positive, got {self.equal_within}")
        cores = usable_cores()
        if self.jobs * self.threads > cores:
            raise MiniGPTError(f"--jobs {self.jobs} x --threads {self.threads} = {self.jobs * self.threads} threads "
                               f"exceeds the {cores} usable cores; lower --jobs to {max(1, cores // self.threads)} "
                               "or --threads")

    def budget(self) -> dict[str, Any]:
        if self.scale not in SCALES:
            raise MiniGPTError(f"unknown --scale {self.scale!r}; choose one of {sorted(SCALES)}")
        b = dict(SCALES[self.scale])
        if self.steps is not None:
            if self.steps <= 0:
                raise MiniGPTError(f"--steps must be positive, got {self.steps}")
            b["steps"] = self.steps
            b["eval_interval"] = max(1, min(b["eval_interval"], self.steps // 4 or 1))
        if self.tokens is not None:
            steps = max(1, math.ceil(self.tokens / (b["batch_size"] * b["seq_len"])))
            # about six evaluations per run, and the warmup never longer than a quarter of it
            b.update(steps=steps, eval_interval=max(1, steps // 6), warmup_steps=min(b["warmup_steps"],
                                                                                      max(1, steps // 4)))
        return b


def prepare_data(settings: AblationSettings, vocab_size: int) -> Path:
    """The corpus tokenized once into ``out_dir/data-<vocab>`` (a BPE trained on its training split)."""
    data_dir = settings.out_dir / f"data-{settings.data}-{vocab_size}"
    if not (data_dir / "meta.json").is_file():
        print(f"preparing {settings.data} (BPE {vocab_size}) into {data_dir}", flush=True)
        data_mod.prepare(settings.data, data_dir, vocab_size=vocab_size)
    return data_dir


def run_variant(variant: Variant, comparison: Comparison, settings: AblationSettings, data_dir: Path,
                vocab_size: int, seed: Optional[int] = None) -> dict[str, Any]:
    """Train (or reuse) one variant with one seed; returns its result record."""
    b = settings.budget()
    cfg = variant_config(variant, b, vocab_size)
    seed = settings.seed if seed is None else seed
    key = f"{variant.name}" if variant.name.startswith("baseline") else f"{comparison.name}-{variant.name}"
    if seed != settings.seed:
        key += f"-seed{seed}"
    run_dir = settings.out_dir / settings.scale / key
    result_path = run_dir / "ablation.json"
    spec = {
        "name": variant.name, "threads": settings.threads, "model": cfg.to_dict(),
        "context_eval": comparison.context_eval or variant.name.startswith("baseline"),
        "train": dict(data=str(data_dir), out_dir=str(run_dir), preset=b["preset"],
                      model={k: v for k, v in cfg.to_dict().items() if k != "vocab_size"},
                      seq_len=b["seq_len"], batch_size=b["batch_size"], lr=b["lr"], warmup_steps=b["warmup_steps"],
                      max_steps=b["steps"], eval_interval=b["eval_interval"], eval_windows=b["eval_windows"],
                      log_interval=b["eval_interval"], ckpt_interval=10**9, keep_checkpoints=1, device="cpu",
                      dtype="float32", seed=seed, threads=settings.threads, **variant.train),
    }
    if result_path.is_file() and not settings.force:
        previous = json.loads(result_path.read_text())
        if previous.get("spec") == spec:
            print(f"  {key}: reusing {result_path}", flush=True)
            return _with_context_eval(previous, settings, data_dir, result_path)
    run_dir.mkdir(parents=True, exist_ok=True)

    print(f"  {key}: training {b['steps']} steps, {count_parameters(cfg)['total']:,} parameters", flush=True)
    start = time.perf_counter()
    run_in_child(_child, spec, str(result_path))
    record = json.loads(result_path.read_text())
    record["spec"] = spec
    record["wall_s"] = time.perf_counter() - start
    metrics = run_dir / "metrics.jsonl"
    record["metrics"] = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.is_file() else []
    write_text_atomic(result_path, json.dumps(record, indent=1))
    record = _with_context_eval(record, settings, data_dir, result_path)
    if "failed" in record:
        print(f"    failed: {record['failed']}", flush=True)
    else:
        r = record["result"]
        print(f"    val_bpb {r['val_bpb']:.4f} | {r['tokens_per_s']:,.0f} tok/s | {record['wall_s']:.0f}s wall",
              flush=True)
    return record


def _with_context_eval(record: dict[str, Any], settings: AblationSettings, data_dir: Path,
                       result_path: Path) -> dict[str, Any]:
    """Add (or reuse) the 1x / 2x / 4x context evaluation of a finished run that asks for one."""
    spec = record["spec"]
    if not spec.get("context_eval") or "failed" in record:
        return record
    seq_len = spec["train"]["seq_len"]
    val_tokens = json.loads((data_dir / "meta.json").read_text())["val"]["tokens"]
    n_tokens = min(val_tokens - 1, 32 * 4 * seq_len)
    if record.get("context_eval_tokens") == n_tokens:
        return record
    tmp = result_path.with_name("context_eval.json")
    run_in_child(_context_child, record["result"]["checkpoint"], str(data_dir), seq_len, n_tokens, settings.threads,
                 str(tmp))
    record["context_eval"] = json.loads(tmp.read_text())
    record["context_eval_tokens"] = n_tokens
    write_text_atomic(result_path, json.dumps(record, indent=1))
    return record


def aggregate(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's record over its seeds: the first seed's record (model, parameters, curves) with ``result``,
    memory and context evaluation averaged over the seeds, ``bpb`` = ``{seed: val_bpb}``, and the per-seed records
    under ``runs``. A failed seed makes the variant failed."""
    failed = [r for r in runs if "failed" in r]
    if failed:
        return {**failed[0], "runs": runs}
    first = runs[0]
    mean = {k: statistics.fmean(r["result"][k] for r in runs) for k, v in first["result"].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out = {**first, "name": name, "runs": runs, "result": {**first["result"], **mean},
           "bpb": {str(r["spec"]["train"]["seed"]): r["result"]["val_bpb"] for r in runs},
           "peak_above_idle_mb": statistics.fmean(r["peak_above_idle_mb"] for r in runs),
           "wall_s": sum(r.get("wall_s", 0.0) for r in runs)}
    if all("context_eval" in r for r in runs):
        out["context_eval"] = {f: {k: statistics.fmean(r["context_eval"][f][k] for r in runs)
                                   for k in first["context_eval"][f]} for f in first["context_eval"]}
    return out


def run_comparison(comp: Comparison, settings: AblationSettings, data_dir: Path, vocab_size: int
                   ) -> list[dict[str, Any]]:
    """Train every variant of ``comp`` with every seed (``settings.jobs`` at a time, each run its own process);
    returns one :func:`aggregate` record per variant, in order."""
    tasks = [(v, seed) for v in comp.variants for seed in settings.seed_list()]

    def one(task):
        return run_variant(task[0], comp, settings, data_dir, vocab_size, task[1])

    if settings.jobs == 1:
        results = [one(t) for t in tasks]
    else:
        # Threads only wait: each run is a spawned process (run_in_child). The OpenMP policy is set once here
        # because run_in_child's own set-and-restore of the variable is not safe across threads.
        previous = os.environ.get("OMP_WAIT_POLICY")
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        try:
            with ThreadPoolExecutor(settings.jobs) as pool:
                results = list(pool.map(one, tasks))
        finally:
            if previous is None:
                os.environ.pop("OMP_WAIT_POLICY", None)
    n = len(settings.seed_list())
    return [aggregate(v.name, results[i * n:(i + 1) * n]) for i, v in enumerate(comp.variants)]


def run_ablations(names: list[str], settings: AblationSettings) -> dict[str, Any]:
    """Run the named comparisons (``["all"]`` = every one), then write the report. Returns all records."""
    if not names or names == ["all"]:
        names = list(COMPARISONS)
    unknown = [n for n in names if n not in COMPARISONS]
    if unknown:
        raise MiniGPTError(f"unknown comparison(s) {unknown}; choose from {list(COMPARISONS)} or 'all'")
    settings.check()
    b = settings.budget()
    started = time.time()
    data_dir = prepare_data(settings, b["vocab_size"])

    vocab_size = Tokenizer.from_dir(data_dir).vocab_size
    records: dict[str, Any] = {"settings": {**settings.__dict__, "out_dir": str(settings.out_dir),
                                            "docs_dir": str(settings.docs_dir)},
                               "budget": b, "comparisons": {},
                               "machine": machine_info(settings.threads, omp_wait_policy=os.environ.get(
                                   "OMP_WAIT_POLICY", "PASSIVE"))}
    for name in names:
        comp = COMPARISONS[name]
        print(f"{name}: {comp.title}", flush=True)
        entry = {"title": comp.title, "budget": comp.budget,
                 "runs": run_comparison(comp, settings, data_dir, vocab_size)}
        print("  throughput, round-robin", flush=True)
        entry["throughput"] = throughput_benchmark(
            settings, {r["name"]: r["model"] for r in entry["runs"]}, comp.name,
            optimizers={v.name: v.train.get("optimizer", "adamw") for v in comp.variants})
        if comp.attention_bench:
            print("  attention micro-benchmark", flush=True)
            entry["attention_bench"] = attention_benchmark(settings)
        if comp.norm_bench:
            print("  norm micro-benchmark", flush=True)
            entry["norm_bench"] = norm_benchmark(settings, variant_config(BASE, b, vocab_size))
        records["comparisons"][name] = entry
    records["wall_s"] = time.time() - started
    records["machine"]["load_end"] = os.getloadavg()
    settings.docs_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(settings.out_dir / f"ablations-{settings.scale}.json", json.dumps(records, indent=1))
    write_report(records, settings.docs_dir)
    return records


def rewrite_report(settings: AblationSettings) -> Path:
    """Regenerate the report and plots from the measurements a previous :func:`run_ablations` saved."""
    path = settings.out_dir / f"ablations-{settings.scale}.json"
    if not path.is_file():
        raise MiniGPTError(f"no measurements at {path}: run `minigpt ablate` first")
    settings.docs_dir.mkdir(parents=True, exist_ok=True)
    return write_report(json.loads(path.read_text()), settings.docs_dir)


