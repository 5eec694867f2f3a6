"""Throughput accounting: FLOPs per token, measured peak FLOP/s, model FLOPs utilisation, memory in use."""
from __future__ import annotations

import os
import resource
import time
from functools import lru_cache

import torch
import torch.nn.functional as F

from .config import ModelConfig


def idle_expert_parameters(config: ModelConfig) -> int:
    """Parameters of the experts a token does *not* use: ``(n_experts - n_experts_per_token)`` experts on each MoE
    layer (0 for a dense model). Total minus this is the active parameter count ``N_active`` (Fedus et al. 2022)."""
    if not config.n_experts:
        return 0
    gated = config.ffn in ("swiglu", "geglu")
    per_expert = (3 if gated else 2) * config.dim * config.moe_hidden_dim
    if config.bias:
        per_expert += (2 if gated else 1) * config.moe_hidden_dim + config.dim
    return config.n_moe_layers * (config.n_experts - config.n_experts_per_token) * per_expert


def flops_per_token(config: ModelConfig, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * N_active + 12 * n_layers * n_heads * head_dim * seq_len``.

    ``6N`` is forward (2N) plus backward (4N) over every weight matrix (Kaplan et al. 2020); the second term is
    the attention score and value products, which have no parameters (Chowdhery et al. 2022, PaLM, appendix B;
    nanoGPT's ``estimate_mfu``). ``n_params`` is the total parameter count; ``N`` counts the tied LM head once, which
    is the matmul it performs. For a mixture of experts only the experts a token is routed to compute, so
    ``N_active = n_params - idle_expert_parameters(config)``. Inference costs a third of this.
    """
    n_active = n_params - idle_expert_parameters(config)
    return 6.0 * n_active + 12.0 * config.n_layers * config.n_heads * config.head_dim * seq_len


@lru_cache(maxsize=None)
def measure_peak_flops(device_type: str, dtype: torch.dtype, size: int = 1024, seconds: float = 0.3) -> float:
    """Measured dense matmul throughput on this device, in FLOP/s: the better of ``a @ b`` (``size x size``) and
    ``F.linear`` on ``2 size x size`` by ``size x size`` -- the op a model's projections (and autocast) dispatch,
    which for bf16 on a CPU without bf16 hardware is ~10x faster than ``a @ b``. Memoised (lru_cache) per arguments.

    MFU is quoted against this measured peak rather than a datasheet figure, because a shared 2-core VM's real
    ceiling is what bounds us (and bf16 without hardware support can be 100x slower than fp32).
    """
    # A private generator: drawing from the global one would shift a resumed run's dropout masks.
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(device_type, dtype)
    b = torch.randn(size, size, generator=g).to(device_type, dtype)
    x = torch.randn(2 * size, size, generator=g).to(device_type, dtype)
    matmul = 2.0 * size**3 * _calls_per_second(lambda: a @ b, device_type, seconds)
    linear = 2.0 * 2 * size**3 * _calls_per_second(lambda: F.linear(x, b), device_type, seconds)
    return max(matmul, linear)


def _calls_per_second(fn, device_type: str, seconds: float) -> float:
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        if device_type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed > seconds:
            return n / elapsed


def rss_bytes() -> int:
    """Resident set size of this process in bytes (current on Linux, peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_stats(device: torch.device) -> dict[str, float]:
    """Memory in MiB: CUDA allocated/reserved, or process RSS on CPU."""
    if device.type == "cuda":
        return {"allocated_mb": torch.cuda.memory_allocated(device) / 2**20,
                "reserved_mb": torch.cuda.memory_reserved(device) / 2**20}
    return {"rss_mb": rss_bytes() / 2**20}


def cpu_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else what :mod:`platform` reports."""
    import platform
    from pathlib import Path

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
