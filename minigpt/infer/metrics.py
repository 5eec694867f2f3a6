"""A small, thread-safe Prometheus registry: counters, gauges and histograms rendered in the text exposition format.

Format: Prometheus "text-based exposition format" version 0.0.4 (``# HELP``, ``# TYPE``, one sample per line,
histograms as cumulative ``_bucket{le="..."}`` series plus ``_sum`` and ``_count``). Written here rather than taken
from ``prometheus_client`` because the server needs a dozen series and nothing else from it.
"""
from __future__ import annotations

import math
import threading
from typing import Iterable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if float(x).is_integer() and abs(x) < 2**53:
        return str(int(x))
    return repr(float(x))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A monotonically increasing count, per label set."""

    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        self._values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_number(v)}" for k, v in items]


class Gauge(_Metric):
    """A value that goes up and down (no labels)."""

    kind = "gauge"

    def __init__(self, name: str, help: str) -> None:
        super().__init__(name, help)
        self._value = 0.0

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    def value(self) -> float:
        with self._lock:
            return self._value

    def render(self) -> list[str]:
        return self.header() + [f"{self.name} {_number(self.value())}"]


class Histogram(_Metric):
    """Observations counted into cumulative buckets with upper bounds ``buckets`` (+Inf is added), no labels."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Iterable[float]) -> None:
        super().__init__(name, help)
        self.buckets = tuple(sorted(float(b) for b in buckets)) + (math.inf,)
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self._counts[i] += 1
                    break
            self._sum += value
            self._count += 1

    def snapshot(self) -> tuple[list[tuple[float, int]], float, int]:
        """``([(upper_bound, cumulative_count)], sum, count)``."""
        with self._lock:
            cum, out = 0, []
            for bound, c in zip(self.buckets, self._counts):
                cum += c
                out.append((bound, cum))
            return out, self._sum, self._count

    def render(self) -> list[str]:
        buckets, total, count = self.snapshot()
        lines = self.header()
        lines += [f'{self.name}_bucket{{le="{_number(b)}"}} {c}' for b, c in buckets]
        lines += [f"{self.name}_sum {_number(total)}", f"{self.name}_count {count}"]
        return lines


class Registry:
    """The metrics of one server; :meth:`render` is the body of ``GET /metrics``."""

    def __init__(self) -> None:
        self._metrics: list[_Metric] = []

    def add(self, metric: _Metric) -> _Metric:
        self._metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for m in self._metrics:
            lines += m.render()
        return "\n".join(lines) + "\n"


# Latency buckets in seconds: from one fast decode step (ms) to a long queue wait.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServingMetrics:
    """Every series the engine and the HTTP server export; names are prefixed ``minigpt_``."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.requests = r.add(Counter("minigpt_http_requests_total", "HTTP requests by endpoint and status code.",
                                      ("endpoint", "status")))
        self.finished = r.add(Counter("minigpt_requests_finished_total",
                                      "Generations finished, by reason (stop, length, cancelled, timeout, error).",
                                      ("reason",)))
        self.prompt_tokens = r.add(Counter("minigpt_prompt_tokens_total",
                                           "Prompt tokens of admitted requests, prefilled or from the prefix cache."))
        # vLLM exports the same pair as prefix_cache_queries / prefix_cache_hits (in tokens).
        self.prefix_cache_hit_tokens = r.add(Counter(
            "minigpt_prefix_cache_hit_tokens_total",
            "Prompt tokens whose keys/values were copied (prefix cache or a request sharing the prompt), not prefilled."))
        self.prefix_cache_hit_rate = r.add(Gauge(
            "minigpt_prefix_cache_hit_rate", "minigpt_prefix_cache_hit_tokens_total / minigpt_prompt_tokens_total."))
        self.prefix_cache_bytes = r.add(Gauge("minigpt_prefix_cache_bytes", "Bytes of KV blocks in the prefix cache."))
        self.prefix_cache_blocks = r.add(Gauge("minigpt_prefix_cache_blocks", "KV blocks in the prefix cache."))
        self.generation_tokens = r.add(Counter("minigpt_generation_tokens_total", "Tokens generated."))
        self.queue_depth = r.add(Gauge("minigpt_queue_depth", "Requests waiting for a KV-cache slot."))
        self.running = r.add(Gauge("minigpt_running_batch_size", "Requests holding a KV-cache slot right now."))
        self.slots_used = r.add(Gauge("minigpt_kv_slots_used", "KV-cache slots in use."))
        self.slots_total = r.add(Gauge("minigpt_kv_slots_total", "KV-cache slots in the pool (--max-batch-size)."))
        self.tokens_reserved = r.add(Gauge("minigpt_kv_tokens_reserved",
                                           "Prompt + max_tokens reserved by running requests (--max-batch-tokens)."))
        self.batch_size = r.add(Histogram("minigpt_decode_batch_size", "Rows in each batched decode step.",
                                          BATCH_BUCKETS))
        self.ttft = r.add(Histogram("minigpt_time_to_first_token_seconds",
                                    "Seconds from a request's arrival to its first generated token.", LATENCY_BUCKETS))
        self.tpot = r.add(Histogram("minigpt_time_per_output_token_seconds",
                                    "Seconds between consecutive generated tokens of a request.", LATENCY_BUCKETS))
        self.e2e = r.add(Histogram("minigpt_request_duration_seconds",
                                   "Seconds from a request's arrival to its last token.", LATENCY_BUCKETS))

    def update_prefix_cache(self, cache) -> None:
        """Refresh the prefix-cache gauges from ``cache`` (a :class:`~minigpt.infer.prefix_cache.PrefixCache` or
        None) and the hit counters."""
        prompt = self.prompt_tokens.value()
        self.prefix_cache_hit_rate.set(self.prefix_cache_hit_tokens.value() / prompt if prompt else 0.0)
        self.prefix_cache_bytes.set(cache.nbytes if cache is not None else 0)
        self.prefix_cache_blocks.set(cache.n_blocks if cache is not None else 0)

    def render(self) -> str:
        return self.registry.render()


def parse_text(text: str) -> dict[str, float]:
    """Samples of a text exposition as ``{'name{labels}': value}`` (comments skipped); for tests and the benchmark."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
