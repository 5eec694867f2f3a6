"""The report of ``minigpt ablate``: PNG plots and ``docs/ablations.md`` with each claim of the design notes next to
our number and a verdict (the measurements come from :mod:`minigpt.analysis.ablate.run` and
:mod:`minigpt.analysis.ablate.bench`; the verdicts from :mod:`minigpt.analysis.ablate.verdicts`).

Every quality number is a mean over seeds with its 95 % Student-t interval, and every difference to the baseline is
paired by seed with its own interval, called resolved (the interval excludes 0), equal within the stated bound, or
not resolved (:mod:`minigpt.analysis.ablate.stats`).
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from minigpt.analysis.ablate.bench import SPEED_TWIN
from minigpt.analysis.ablate.stats import describe
from minigpt.analysis.ablate.verdicts import (
    CLAIMS,
    VERDICTS,
    Noise,
    bpb_interval,
    speed_noise,
    succeeded,
    verdict_positions,
)
from minigpt.paths import write_text_atomic

# ------------------------------------------------------------------------------------------------ plots

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curves(name: str, entry: dict[str, Any], path: Path) -> None:
    """Validation loss against tokens: one colour per variant, one line per seed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, variant in enumerate(entry["runs"]):
        for j, run in enumerate(variant.get("runs", [variant])):
            pts = [(m["tokens"], m["val_loss"]) for m in run.get("metrics", []) if m.get("val_loss") is not None]
            if pts:
                ax.plot(*zip(*pts), "o-", ms=2, color=f"C{i}", alpha=0.8 if j == 0 else 0.4,
                        label=variant["name"] if j == 0 else None)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(f"{entry['title']}: validation loss vs tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    lows = [m["val_loss"] for r in entry["runs"] for m in r["metrics"] if m.get("val_loss") is not None]
    ax.set_ylim(min(lows) - 0.1, min(lows) + 1.5)  # the first evaluations are far above; show the differences
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_attention(bench: dict[str, Any], path: Path) -> None:
    plt = _plt()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (impl, rows) in enumerate(bench["results"].items()):
        n, color = [r["seq_len"] for r in rows], f"C{i}"
        ax_t.plot(n, [r["seconds"] * 1e3 for r in rows], "o-", color=color, label=impl)
        ax_m.plot(n, [r["saved_mb"] for r in rows], "o-", color=color, label=f"{impl}: kept for backward")
        ax_m.plot(n, [max(r["peak_above_idle_mb"], 0.1) for r in rows], "x:", color=color,
                  label=f"{impl}: peak RSS growth")
    for ax, label in ((ax_t, "forward + backward (ms)"), (ax_m, "memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"causal attention, batch 1, {bench['heads']} heads x {bench['head_dim']}, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_context(entry: dict[str, Any], seq_len: int, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in entry["runs"]:
        ev = run["context_eval"]
        factors = sorted(ev, key=int)
        ax.plot([int(f) * seq_len for f in factors], [ev[f]["val_loss"] for f in factors], "o-", label=run["name"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"evaluation context (trained at {seq_len})")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("loss at 1x, 2x, 4x the training context")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ report

def _row(comparison: str, run: dict[str, Any], throughput: dict[str, float], base: dict[str, Any],
         noise: Noise) -> str:
    if not succeeded(run):
        return f"| {comparison} | {run['name']} | failed: {run['failed']} | | | | | | | | | |"
    p, r = run["parameters"], run["result"]
    second = p["active"] if run["model"]["n_experts"] else p["non_embedding"]
    rr = f"{throughput[run['name']]:,.0f}" if run["name"] in throughput else "-"
    diff = "-" if run is base or not succeeded(base) else describe(noise.diff(run, base), noise.bound)
    return (f"| {comparison} | {run['name']} | {bpb_interval(run).text()} | {diff} | {r['val_ppl']:.2f} | {rr} | "
            f"{r['tokens_per_s']:,.0f} | "
            f"{run['peak_above_idle_mb']:.0f} | {run['activation_mb_estimate']:.0f} | "
            f"{run['kv_bytes_per_token_fp32']:,} | {p['total']:,} | {second:,}"
            + (" (active)" if run["model"]["n_experts"] else "") + " |")


TABLE_HEAD = ("| comparison | variant | val bpb (mean ± 95 %) | vs baseline (95 %) | val ppl | tokens/s (round-robin) "
              "| tokens/s (run) | peak memory (MiB) | activations (MiB, est.) | KV bytes/token (fp32) | parameters "
              "| non-embedding parameters |\n"
              "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def write_report(records: dict[str, Any], docs_dir: Path) -> Path:
    """Write ``ablations.md`` and the PNG plots into ``docs_dir``; returns the markdown path."""
    docs_dir = Path(docs_dir)
    b, m, s = records["budget"], records["machine"], records["settings"]
    base = next(r for e in records["comparisons"].values() for r in e["runs"] if r["name"] == "baseline")
    twins = [speed_noise(e["throughput"]) for e in records["comparisons"].values()
             if SPEED_TWIN in e.get("throughput", {})]
    noise = Noise(s.get("equal_within", 0.02), statistics.median(twins) if twins else 0.0)
    tokens = b["steps"] * b["batch_size"] * b["seq_len"]
    variants = [r for e in records["comparisons"].values() for r in e["runs"]]
    all_runs = [run for v in variants for run in v.get("runs", [v])]
    unique = {r["spec"]["train"]["out_dir"]: r for r in all_runs if "spec" in r}
    loads = [r[k] for r in all_runs for k in ("load_before", "load_after") if k in r]
    start = m.get("load_before") or m.get("load_start")  # measurements saved before runtime.machine_info
    load = f"{start[0]:.2f} at the start and {m['load_end'][0]:.2f} at the end" + (
        f", {min(loads):.1f}-{max(loads):.1f} around the training runs" if loads else "")
    seeds = sorted(int(k) for k in base.get("bpb", {s["seed"]: 0}))
    jobs = s.get("jobs", 1)
    spread = bpb_interval(base)
    sd = spread.se * len(seeds) ** 0.5 if len(seeds) > 1 else float("nan")
    out = [
        "# Ablations: the design notes' comparisons, measured",
        "",
        f"Generated by `{s.get('command') or 'minigpt ablate'}` on {m['date']} "
        f"({records['wall_s'] / 60:.1f} min of wall time for this invocation, {jobs} run(s) at a time; the "
        f"{len(unique)} training runs took {sum(r.get('wall_s', 0) for r in unique.values()) / 60:.1f} min in all, "
        f"each in its own process, and are reused by later invocations). Machine: {m['cpu']}, {m['cores']} cores, "
        f"{m['threads']} torch threads per run (OpenMP threads sleep when idle: "
        f"OMP_WAIT_POLICY={m.get('omp_wait_policy', 'PASSIVE')}), torch {m['torch']}. One-minute load average {load}"
        + (" -- the machine was shared with other jobs, so tokens/s and timings are lower and noisier than on an "
           "idle machine" if max([start[0], m["load_end"][0], *loads]) > m["threads"] * 0.75 else "")
        + ".",
        "",
        f"**Budget** (scale `{s['scale']}`): preset `{b['preset']}` (built with `max_seq_len` = 4 x the context so "
        f"every position encoding can be evaluated beyond it), Tiny Shakespeare with a {b['vocab_size']}-token "
        f"byte-level BPE, context {b['seq_len']}, batch {b['batch_size']}, {b['steps']} steps (AdamW unless a "
        f"variant says otherwise; lr {b['lr']}, warmup {b['warmup_steps']}, cosine), i.e. **{tokens:,} training "
        f"tokens per run**, fp32. Every variant is trained with the seeds {', '.join(map(str, seeds))}: a seed fixes "
        f"the initialisation stream and the data order, the same for every variant. Validation: {b['eval_windows']} "
        "fixed windows. Each comparison states what else it holds equal.",
        "",
        "**Columns**: val bpb = bits per UTF-8 byte of the validation split (tokenizer-independent), the mean over "
        "the seeds ± the half-width of its 95 % Student-t interval; vs baseline = the variant's bpb minus the "
        "baseline's, paired by seed, ± its 95 % interval, and what it resolves; val ppl = perplexity per BPE token "
        "(mean); tokens/s (round-robin) = training throughput (forward, backward, AdamW) measured after the runs with "
        "every variant of a comparison timed in turn in one process (best of 4 rounds), so load from other jobs falls "
        "on all of them alike -- the speed to compare; tokens/s (run) = the training runs' own average, which also "
        "reflects the machine's load while they ran; peak memory = growth of the training process's peak resident "
        "set over its idle size (includes the data and allocator effects, so small differences are noise); "
        "activations = `minigpt.analysis.estimate`'s count of what autograd keeps for one step; KV bytes/token = the "
        "inference cache in fp32; parameters = exact counts.",
        "",
        f"**Noise and verdicts**: over its {len(seeds)} seeds the baseline reached {spread.text()} bpb (per-seed "
        f"standard deviation {sd:.4f}). A difference is **resolved** when its 95 % interval excludes 0, **equal "
        f"within ±{noise.bound:.3f} bpb** when the whole interval lies inside that bound, and **not resolved** "
        "otherwise (then the report estimates how many seeds would resolve a gap of the measured size; more tokens "
        "per run, `--tokens`, usually shrink the spread too). Speed: the baseline is timed twice in every "
        f"round-robin; the two timings differ by {noise.speed:.1%} (median over comparisons), and speed differences "
        "below twice that are not claimed.",
        "",
        "## Summary",
        "",
        TABLE_HEAD,
    ]
    for name, entry in records["comparisons"].items():
        ref = next((r for r in entry["runs"] if r["name"] == "baseline"), base)
        out += [_row(name, run, entry.get("throughput", {}), ref, noise) for run in entry["runs"]]
    for name, entry in records["comparisons"].items():
        ref = next((r for r in entry["runs"] if r["name"] == "baseline"), base)
        loss_png = f"ablation-{name}-loss.png"
        plot_loss_curves(name, entry, docs_dir / loss_png)
        out += ["", f"## {entry['title']}", "", f"Budget: {entry['budget']}.", "", TABLE_HEAD]
        out += [_row(name, run, entry.get("throughput", {}), ref, noise) for run in entry["runs"]]
        if SPEED_TWIN in entry.get("throughput", {}):
            out += ["", f"Round-robin timing noise: the baseline timed twice in the same rounds differed by "
                        f"{speed_noise(entry['throughput']):.1%}."]
        out += ["", f"![validation loss vs tokens, one line per seed]({loss_png})", ""]
        if entry.get("attention_bench"):
            plot_attention(entry["attention_bench"], docs_dir / "ablation-attention-scaling.png")
            out += [_attention_table(entry["attention_bench"]), "",
                    "![attention time and memory vs sequence length](ablation-attention-scaling.png)", ""]
        if name == "positions":
            plot_context(entry, b["seq_len"], docs_dir / "ablation-context-length.png")
            out += [_context_table(entry, b["seq_len"]), "",
                    "![loss at 1x, 2x, 4x the training context](ablation-context-length.png)", ""]
        if entry.get("norm_bench"):
            out += ["| norm alone, forward + backward | ms |", "| --- | ---: |"]
            out += [f"| {k} | {v * 1e3:.3f} |" for k, v in entry["norm_bench"].items()]
            out.append("")
        claim = CLAIMS.get(name)
        if claim:
            verdict = verdict_positions(entry, noise, b["seq_len"]) if name == "positions" else \
                VERDICTS[name](entry, noise)
            out += [f"**Claim**: {claim}", "", f"**Our measurement**: {verdict}"]
    path = docs_dir / "ablations.md"
    write_text_atomic(path, "\n".join(out) + "\n")
    return path


def _attention_table(bench: dict[str, Any]) -> str:
    res = bench["results"]
    lines = [f"Attention alone (batch {bench['batch']}, {bench['heads']} heads x {bench['head_dim']}, causal, "
             f"flash_reference block {bench['block_size']}): forward + backward time (best of 3), memory kept "
             "for backward, and peak resident-set growth.", "",
             "| seq_len | " + " | ".join(f"{k} ms | {k} kept MiB | {k} peak MiB" for k in res) + " |",
             "| ---: |" + " ---: | ---: | ---: |" * len(res)]
    for i, row in enumerate(res["naive"]):
        cells = []
        for k in res:
            r = res[k][i]
            cells.append(f"{r['seconds'] * 1e3:.1f} | {r['saved_mb']:.2f} | {r['peak_above_idle_mb']:.0f}")
        lines.append(f"| {row['seq_len']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _context_table(entry: dict[str, Any], seq_len: int) -> str:
    n_tokens = next((r.get("context_eval_tokens") for r in entry["runs"] if r.get("context_eval_tokens")), None)
    lines = [f"The same {n_tokens:,} validation tokens, cut into windows of each length (mean loss over every "
             "position, nats/token):" if n_tokens else "", "",
             f"| position encoding | loss at {seq_len} | at {2 * seq_len} | at {4 * seq_len} |",
             "| --- | ---: | ---: | ---: |"]
    for run in entry["runs"]:
        if succeeded(run):
            ev = run["context_eval"]
            lines.append(f"| {'rope' if run['name'] == 'baseline' else run['name']} | {ev['1']['val_loss']:.3f} | "
                         f"{ev['2']['val_loss']:.3f} | {ev['4']['val_loss']:.3f} |")
    return "\n".join(lines)
