"""The process and the machine: devices, dtypes by name, sizes in bytes, CPU and memory facts, child processes.

Shared by every layer above :mod:`minigpt.model`; imports only torch and :mod:`minigpt.errors`.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import platform
import re
import resource
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from minigpt.errors import MiniGPTError

# The dtypes a user may name (--dtype, export --dtype), by their torch names.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    """``auto`` picks cuda, then mps, then cpu. Raises :class:`MiniGPTError` for ``cuda`` without CUDA and for a
    name that is not ``cpu``, ``cuda``, ``cuda:N`` or ``mps``."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise MiniGPTError(f"--device {name!r} is not a device this can run on; use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MiniGPTError(f"--device {name} requested but CUDA is not available; use --device cpu")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise MiniGPTError(f"--device {name} requested but MPS is not available; use --device cpu")
    return device


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*(?:([kmgt])(i?))?b?\s*$", re.IGNORECASE)


def parse_size(text: str | int, what: str = "size", minimum: int = 0) -> int:
    """Parse a byte count such as ``"200MB"``, ``"1.5G"``, ``"64KiB"``, ``"1e9"`` or ``"0"`` into bytes (an int
    passes through). ``k/M/G/T`` are powers of 1000 (as in ``transformers``' ``max_shard_size``),
    ``KiB/MiB/GiB/TiB`` powers of 1024; the ``B`` is optional.

    Raises :class:`MiniGPTError` (naming ``what``) for anything else or a size below ``minimum`` bytes.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise MiniGPTError(f"{what}: cannot read {text!r} as a size in bytes; write e.g. 200MB, 1.5GB, 64KiB or 0")
        number, unit, binary = m.groups()
        power = "kmgt".find(unit.lower()) + 1 if unit else 0
        n = int(float(number) * (1024 if binary else 1000) ** power)
    if n < minimum:
        raise MiniGPTError(f"{what}: {text!r} is below the minimum of {minimum} bytes; write e.g. 500MB, 2GB or 1GiB")
    return n


def _cpuinfo(field: str) -> Optional[str]:
    """The value of the first ``field`` line of ``/proc/cpuinfo`` (Linux), None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else what :mod:`platform` reports."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def _above_capability(flag: str, capability: str) -> bool:
    """Whether ``flag`` names an instruction set beyond what ``$ATEN_CPU_CAPABILITY`` = ``capability`` allows."""
    wide = flag.startswith(("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert"))
    if capability == "avx2":
        return wide
    if capability == "default":
        return wide or flag.startswith(("avx", "fma", "f16c"))
    return False


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (Linux: ``avx2``, ``avx512_vnni``, ...), less those above
    ``$ATEN_CPU_CAPABILITY`` when it is ``avx2`` (AVX-512, AMX and AVX-VNNI go) or ``default`` (every AVX flag, FMA
    and F16C go too): PyTorch's own switch for running as on an older CPU, which ATen and Inductor's generated code
    follow, and MiniGPT's kernel choices with them. Empty elsewhere."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    return frozenset(f for f in (_cpuinfo("flags") or "").split() if not _above_capability(f, capability))


@lru_cache(maxsize=1)
def cpu_vendor() -> str:
    """The CPU's ``vendor_id`` from ``/proc/cpuinfo`` (``GenuineIntel``, ``AuthenticAMD``, ...); empty elsewhere."""
    return _cpuinfo("vendor_id") or ""


def loadavg() -> Optional[list[float]]:
    """The 1/5/15-minute load averages, or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info(threads: Optional[int] = None, **extra: Any) -> dict[str, Any]:
    """What a benchmark row must name: CPU model and vector capability, cores, torch threads, versions, load
    average and date; ``extra`` entries are added as they are."""
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": threads or torch.get_num_threads(),
            "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "python": platform.python_version(), "load_before": loadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), **extra}


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


@lru_cache(maxsize=None)
def measure_peak_flops(device_type: str, dtype: torch.dtype, size: int = 1024, seconds: float = 0.3) -> float:
    """Measured dense matmul throughput on this device, in FLOP/s: the better of ``a @ b`` (``size x size``) and
    ``F.linear`` on ``2 size x size`` by ``size x size`` -- the op a model's projections (and autocast) dispatch,
    which for bf16 on a CPU without bf16 hardware is ~10x faster than ``a @ b``. Memoised (lru_cache) per arguments.

    MFU is quoted against this measured peak rather than a datasheet figure, because a shared 2-core VM's real
    ceiling is what bounds us (and bf16 without hardware support can be 100x slower than fp32). On CUDA the
    matrices are at least 8192 wide and timed in batches of calls between synchronisations: a 1024-wide bf16
    product takes microseconds there, so launch and synchronisation bounded it: an H200 (torch 2.11, bf16) measured
    138 TFLOP/s so, 650-694 this way, and 783 for 8192-wide products timed with CUDA events.
    """
    if device_type == "cuda":
        size = max(size, CUDA_PEAK_SIZE)
    # A private generator: drawing from the global one would shift a resumed run's dropout masks.
    g = torch.Generator(device_type if device_type == "cuda" else "cpu").manual_seed(0)
    where = g.device
    a = torch.randn(size, size, generator=g, device=where).to(device_type, dtype)
    b = torch.randn(size, size, generator=g, device=where).to(device_type, dtype)
    x = torch.randn(2 * size, size, generator=g, device=where).to(device_type, dtype)
    matmul = 2.0 * size**3 * _calls_per_second(lambda: a @ b, device_type, seconds)
    linear = 2.0 * 2 * size**3 * _calls_per_second(lambda: F.linear(x, b), device_type, seconds)
    return max(matmul, linear)


CUDA_PEAK_SIZE = 8192


def _calls_per_second(fn, device_type: str, seconds: float) -> float:
    batch = 10 if device_type == "cuda" else 1  # calls queued between synchronisations
    fn()
    if device_type == "cuda":
        torch.cuda.synchronize()
    n, start = 0, time.perf_counter()
    while True:
        for _ in range(batch):
            fn()
        n += batch
        if device_type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed > seconds:
            return n / elapsed


def run_in_child(target, *args) -> None:
    """Run ``target(*args)`` in a spawned process; raises :class:`MiniGPTError` if it fails.

    The child's OpenMP threads sleep when idle (``OMP_WAIT_POLICY=PASSIVE``, unless set already): spinning threads
    on a machine shared with other jobs slow every process down several times, and the variants compared in one
    benchmark would pay that tax unevenly.
    """
    ctx = mp.get_context("spawn")
    previous = os.environ.get("OMP_WAIT_POLICY")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        proc = ctx.Process(target=target, args=args)
        proc.start()
    finally:
        if previous is None:
            os.environ.pop("OMP_WAIT_POLICY", None)
    proc.join()
    if proc.exitcode != 0:
        raise MiniGPTError(f"{target.__name__}{args[:1]} failed with exit code {proc.exitcode}")


def run_in_thread(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a new thread that ends when it returns; its result, or its exception re-raised here.

    For a process whose model runs in a worker thread (the serving engine's): load it here, not in the main thread.
    PyTorch's CPU ops run on an OpenMP team owned by the thread that calls them, and GNU libgomp keeps a thread's
    team alive until the thread ends. Once the teams' threads outnumber the cores, libgomp stops spinning between
    parallel regions and sleeps in the kernel, so every region pays a wake-up: on a 2-core VM with 2 torch threads,
    a model loaded in the main thread left it a team and the worker's small batched matmul took 81-91 us instead
    of 9-10 us; `minigpt chat` on SmolLM-135M's shape decoded 19.8 tokens/s instead of 32.6 (fp32) and `minigpt
    serve` 18.5 instead of 28.4 for one client (docs/benchmarks.md, session 46). The thread is a daemon: Ctrl-C
    during a load ends the process.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised in the caller's thread, traceback included
            box["error"] = e

    thread = threading.Thread(target=target, name=f"minigpt-{getattr(fn, '__name__', 'task')}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


@lru_cache(maxsize=None)
def native_bf16(device_type: str = "cpu") -> bool:
    """True when ``device_type`` has fast bf16 matrix kernels: CUDA (Ampere or newer: bf16 tensor cores), MPS, or a
    CPU whose oneDNN reports bf16 support (AVX-512-BF16 / AMX)."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return True
