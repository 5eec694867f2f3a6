"""Round-robin timing shared by the benchmarks (:mod:`minigpt.analysis.bench.infer`,
:mod:`minigpt.analysis.bench.reports`): implementations are timed in turns, A B C A B C ..., so the drift of a
shared machine spreads over all of them instead of biasing whichever ran last."""
from __future__ import annotations

import time
from typing import Any, Callable


def time_round_robin(workloads: dict[str, Callable[[], Any]], repeats: int, warmup: int,
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
