"""The markdown table of ``minigpt bench`` (:mod:`minigpt.analysis.bench.infer`): one line per (model, dtype, row),
a column per implementation with the median tokens/s [min-max], ratios to ``transformers``, and notes (GB/s, MFU,
compile time)."""
from __future__ import annotations

from typing import Any

ROWS = ("decode-b1", "decode-b8", "prefill", "train")  # the model benchmark's rows, in table order
REFERENCE = "transformers"
REFERENCE_FP32 = "transformers-fp32"  # bf16 inference rows: transformers in float32 as well (the targets' baseline)


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
