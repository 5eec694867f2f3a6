"""The C heap of the process: glibc's malloc told to keep the freed blocks of a forward pass for the next one.

Why: a prefill allocates and frees tens of MB of activations a layer ([512, 3072] float32 is 6 MB). glibc serves a
block above its mmap threshold (128 KiB at start, raised on the fly up to 32 MiB when such a block is freed) with a
fresh mapping and returns it to the kernel when freed, and trims freed memory at the top of the heap above its trim
threshold; each new page is then a page fault, which costs microseconds under a hypervisor. Measured on a 2-core
Zen 5 EPYC (family 26 model 2, KVM), SmolLM-135M's shape, bf16, a 512-token prefill in process: 88,160 minor faults
and 1,112 tokens/s with glibc's defaults; 0 faults and 1,665 tokens/s with the thresholds below (one process each,
medians of 7; docs/benchmarks.md, session 61). llama.cpp allocates its compute buffers once and does not pay this.

Torch-free: the ``minigpt`` executable sets it before anything is imported. Elsewhere (musl, macOS, Windows) nothing
is done; a user's own settings (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``) win.
"""
from __future__ import annotations

import ctypes
import os

# glibc's <malloc.h>: mallopt parameters.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX, 32 MiB: half of its
# HEAP_MAX_SIZE; mallopt refuses more), and twice that for the trim threshold, the ratio glibc's own dynamic rule
# keeps (malloc.c: when free() raises the mmap threshold, the trim threshold follows at twice it).
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_DONE: list[bool] = []


def keep_freed_blocks() -> bool:
    """Set glibc's mmap threshold to 32 MiB and its trim threshold to 64 MiB for this process (once), so that the
    blocks a forward pass frees are reused by the next without page faults; a block above 32 MiB is still mapped
    afresh. The cost: up to 64 MiB of freed heap stays with the process instead of going back to the kernel.
    Returns whether the thresholds are set (False: not glibc, the user set their own, or ``mallopt`` refused)."""
    if _DONE:
        return _DONE[0]
    ok = False
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if _glibc() and not any(os.environ.get(name) for name in USER_SETTINGS) and "glibc.malloc." not in tunables:
        try:
            libc = ctypes.CDLL("libc.so.6")  # glibc's soname (find_library would spawn ldconfig)
            ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
                libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        except (OSError, AttributeError):  # no such library or symbol: leave the heap as it is
            pass
    _DONE.append(ok)
    return ok


def _glibc() -> bool:
    """Whether this process runs on GNU libc (``confstr``: no file read, unlike ``platform.libc_ver``)."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False
