"""Multi-process training on PyTorch's own engine: ``torchrun`` + DDP or FSDP2, gloo on CPU and nccl on CUDA.

``torchrun --nproc_per_node N -m minigpt train ... --parallel ddp|fsdp`` sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and the rendezvous variables; :func:`setup` reads them. Without them the
process is a world of one and every helper here is a no-op, so the single-process path stays the plain loop.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from minigpt.errors import MiniGPTError


@dataclass
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size``, ``local_rank`` on its node, its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device: torch.device, threads: int | None = None) -> DistInfo:
    """Join the process group if launched by ``torchrun``; pin CUDA ranks to their local GPU; size CPU threads.

    Each rank gets ``cores // local_world_size`` intra-op threads (at least 1) unless ``threads`` is given: ranks
    that together ask for more threads than there are cores spin-wait against each other (a 2-core machine ran a
    2-rank job about 20x slower oversubscribed).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if threads:
        torch.set_num_threads(threads)
    elif world_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    if world_size == 1:
        return DistInfo(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    elif device.type == "cpu":
        backend = "gloo"
    else:
        raise MiniGPTError(f"distributed training supports cuda (nccl) and cpu (gloo), not {device.type}")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return DistInfo(rank, world_size, local_rank, local_world_size, device)


def teardown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: nn.Module, parallel: str, info: DistInfo, *, param_dtype: torch.dtype | None = None,
               activation_checkpointing: bool = False) -> nn.Module:
    """Wrap for data parallelism: ``ddp`` (DistributedDataParallel) or ``fsdp`` (FSDP2 ``fully_shard`` on each
    transformer block, then on the root so embeddings / final norm / LM head are sharded too).

    ``param_dtype`` sets FSDP2's mixed-precision policy (parameters all-gathered and computed in that dtype,
    gradients reduced in float32). ``activation_checkpointing`` recomputes each block's activations in the backward
    pass instead of storing them (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").
    """
    if activation_checkpointing:
        for block in model.layers:
            block.forward = _checkpointed(block.forward)
    if parallel == "none" or not info.enabled:
        return model
    if parallel == "ddp":

        ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if parallel == "fsdp":

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
        kwargs = {"mp_policy": mp} if mp else {}
        for block in model.layers:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model
    raise MiniGPTError(f"--parallel must be none, ddp or fsdp, got {parallel!r}")


def _checkpointed(forward):

    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on micro-steps that are not the last of an accumulation (``sync=False``), so
    gradients are reduced once per optimizer step: DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``."""
    if sync:
        yield
        return
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    """Sum a few floats over all ranks (float64 on the rank's device)."""
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order."""
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def all_reduce_max(values: list[float], info: DistInfo) -> list[float]:
    """Element-wise maximum of a few floats over all ranks."""
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
