"""Training checkpoints: everything needed to continue a run bit for bit, written atomically by one or many ranks.

``checkpoints/step_N/`` holds

* ``config.json``, ``tokenizer.json`` and, unless the run is sharded (FSDP), ``model.safetensors``: a normal model
  directory that ``generate`` / ``export`` read directly;
* ``dcp/``: model and AdamW state through ``torch.distributed.checkpoint`` (each rank writes its own shards;
  loading reshards, so a checkpoint saved by 2 ranks resumes on 1 and vice versa);
* ``trainer_state.pt``: step, tokens, training time, and per rank the data sampler and Python / NumPy / torch RNG
  states (plain tensors and numbers, so it loads with ``weights_only=True``);
* ``manifest.json``: size and SHA-256 of every file, checked before resuming.

Checkpoints are only taken at optimizer-step boundaries, so the gradient-accumulation position is always 0.

Crash safety: a new checkpoint is complete and fsynced under its final name, then ``latest`` is pointed at it
(fsynced), and only then are older checkpoints pruned, each renamed aside before it is deleted. A process killed at
any point leaves at least one complete checkpoint; :func:`remove_stale_temporaries` (run before every start)
finishes or undoes what it was doing.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from minigpt.checkpoint import dcp as safe_dcp
from minigpt.checkpoint.atomic import begin_atomic_dir, commit_atomic_dir, verify_manifest
from minigpt.checkpoint.native import FORMAT, load_config, save_pretrained, write_model_files
from minigpt.errors import MiniGPTError, json_loads
from minigpt.model.transformer import Transformer
from minigpt.paths import write_text_atomic
from minigpt.tokenizer.tokenizer import Tokenizer
from minigpt.train import distributed as dist_mod


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states as plain containers of tensors/ints (loadable with weights_only)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# DCP warns that it runs "in a single process" every time it is used without a process group: that is intended.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _dcp_state(model, optimizer) -> dict[str, Any]:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def checkpoint_bytes(n_params: int) -> int:
    """Rough size of one checkpoint in bytes: fp32 weights twice (safetensors + DCP) and AdamW's two moments."""
    return 16 * n_params + (1 << 20)


def check_writable(out_dir: Path, n_params: int) -> None:
    """Fail before training if ``out_dir`` cannot be written or lacks room for two checkpoints.

    Raises :class:`MiniGPTError` naming the directory and the space needed.
    """
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise MiniGPTError(f"run directory {out_dir} is not writable ({e.strerror or e})") from None
    need = 2 * checkpoint_bytes(n_params)
    free = shutil.disk_usage(out_dir).free
    if free < need:
        raise MiniGPTError(f"not enough free disk space in {out_dir}: checkpoints need about {need / 2**20:.0f} MiB, "
                           f"{free / 2**20:.0f} MiB free; free some space or choose another --out-dir")


def save(out_dir: Path, model, optimizer, tokenizer, state: dict[str, Any], rank_state: dict[str, Any],
         info: dist_mod.DistInfo, keep: int, sharded: bool) -> Path:
    """Write ``checkpoints/step_N`` atomically (all ranks take part), point ``latest`` at it, prune to ``keep``.

    ``model`` is the unwrapped model (DDP) or the FSDP2 module; ``state`` the run-wide counters; ``rank_state``
    this rank's sampler and RNG states. On failure the previous checkpoint and ``latest`` stay as they were and
    :class:`MiniGPTError` says so.
    """
    final = out_dir / "checkpoints" / f"step_{state['step']:07d}"
    tmp = None
    try:
        tmp = Path(dist_mod.broadcast_object(str(begin_atomic_dir(final)) if info.is_main else None, info))
        ranks = dist_mod.all_gather_objects(rank_state, info)
        dcp.save(_dcp_state(model, optimizer), checkpoint_id=str(tmp / "dcp"))
        dist_mod.barrier(info)
        if info.is_main:
            if sharded:
                (tmp / "config.json").write_text(_config_json(model))
                tokenizer.save(tmp / "tokenizer.json")
            else:
                write_model_files(model, tmp, tokenizer)
            torch.save({**state, "world_size": info.world_size, "ranks": ranks}, tmp / "trainer_state.pt")
            commit_atomic_dir(tmp, final)
            point_latest(out_dir, final)
            prune(out_dir, final, keep)
        dist_mod.barrier(info)
    except (OSError, CheckpointException) as e:
        if tmp is not None and info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        latest = (out_dir / "latest").read_text().strip() if (out_dir / "latest").is_file() else "none"
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise MiniGPTError(f"could not write checkpoint {final.name} ({reason}); the previous checkpoint "
                           f"({latest}) is intact") from None
    return final


def _fsync(path: Path) -> None:
    """fsync a file or directory (a directory's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def point_latest(out_dir: Path, ckpt: Path) -> None:
    """Atomically and durably make ``out_dir/latest`` name ``ckpt``: :func:`~minigpt.paths.write_text_atomic`
    (a temporary file, fsynced, renamed over ``latest``), then fsync the directory, so that a crash never leaves
    ``latest`` empty or pointing at a pruned checkpoint."""
    write_text_atomic(out_dir / "latest", str(ckpt.relative_to(out_dir)) + "\n")
    _fsync(out_dir)


def checkpoint_step(path: Path) -> Optional[int]:
    """The step of a ``step_N`` directory (None for any other name)."""
    number = path.name.removeprefix("step_")
    return int(number) if path.name.startswith("step_") and number.isdigit() else None


def prune(out_dir: Path, newest: Path, keep: int) -> None:
    """Delete older checkpoints so that ``keep`` remain, ``newest`` (just written and fsynced) among them
    (``keep <= 0``: keep all). Checkpoints of later steps than ``newest`` (left by a run resumed from an earlier
    one) are not counted and not touched.

    Each one is renamed to a hidden ``.step_N.trash-PID`` first, atomically, so a crash mid-deletion leaves no
    half-deleted ``step_N`` behind (:func:`remove_stale_temporaries` deletes the rest). A failure to delete is a
    one-line warning: the new checkpoint is already safe.
    """
    if keep <= 0:
        return
    step = checkpoint_step(newest)
    steps = {p: checkpoint_step(p) for p in (out_dir / "checkpoints").glob("step_*") if p.is_dir()}
    older = sorted((p for p, n in steps.items() if n is not None and n < step), key=steps.__getitem__)
    for old in older[:max(0, len(older) - (keep - 1))]:
        try:
            trash = old.with_name(f".{old.name}.trash-{os.getpid()}")
            old.rename(trash)
            shutil.rmtree(trash)
        except OSError as e:
            print(f"warning: could not delete old checkpoint {old} ({e.strerror or e})", file=sys.stderr)


def truncate_metrics(path: Path, step: int) -> None:
    """On resume, keep the rows of ``metrics.jsonl`` logged at or before ``step`` (the checkpoint's), so that no
    step appears twice; the file is replaced atomically.

    A torn last line (the process died while appending it) is dropped with a one-line warning. Any other line
    that is not a JSON object with a ``step`` raises :class:`MiniGPTError` naming it.
    """
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    kept = []
    for i, line in enumerate(lines):
        try:
            row = json_loads(line)
            row_step = row["step"] if isinstance(row, dict) else None
        except (ValueError, KeyError):
            row_step = None
        if not isinstance(row_step, int):
            if i == len(lines) - 1:
                print(f"warning: dropping the torn last line of {path} (the run stopped while writing it)",
                      file=sys.stderr)
                break
            raise MiniGPTError(f"{path} line {i + 1} is not a metrics row (a JSON object with a step); repair or "
                               "delete the file to resume")
        if row_step <= step:
            kept.append(line + "\n")
    write_text_atomic(path, "".join(kept))


def _config_json(model) -> str:
    return json.dumps({"format": FORMAT, **model.config.to_dict()}, indent=2) + "\n"


def remove_stale_temporaries(out_dir: Path) -> None:
    """Clean up after a process killed while writing or pruning checkpoints: delete half-written
    (``.step_N.tmp-PID``) and half-deleted (``.step_N.trash-PID``) directories, which are never read
    (:func:`find_latest` only considers ``step_*``), and put back a complete checkpoint that was being replaced by
    a new one of the same step (``.step_N.old-PID``, see :func:`~minigpt.checkpoint.atomic.commit_atomic_dir`)
    when the replacement never took its place."""
    for tmp in sorted((out_dir / "checkpoints").glob(".step_*")):
        final = tmp.with_name(tmp.name[1:].split(".")[0])  # ".step_0000010.old-123" -> "step_0000010"
        if ".old-" in tmp.name and not final.exists():
            tmp.rename(final)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def find_latest(out_dir: Path) -> Optional[Path]:
    """Newest checkpoint that passes its manifest check; each corrupt or incomplete one is reported in one line
    and skipped, so a crash during a write falls back to the previous good checkpoint."""
    candidates = sorted((p for p in (out_dir / "checkpoints").glob("step_*")
                         if p.is_dir() and checkpoint_step(p) is not None), key=checkpoint_step, reverse=True)
    for ckpt in candidates:
        try:
            verify_manifest(ckpt)
            for needed in ("trainer_state.pt", "dcp"):
                if not (ckpt / needed).exists():
                    raise MiniGPTError(f"checkpoint {ckpt} has no {needed}")
            return ckpt
        except MiniGPTError as e:
            print(f"warning: skipping checkpoint: {e}", file=sys.stderr)
    return None


def load(ckpt: Path, model, optimizer) -> dict[str, Any]:
    """Load model and optimizer (resharded to this world size) from ``ckpt``; returns the trainer state dict."""
    sd = _dcp_state(model, optimizer)
    safe_dcp.load(sd, ckpt / "dcp")  # never pickle.load a file from disk
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, optimizer, sd["optim"])
    return torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=True)


def consolidate(ckpt: Path, out: Path) -> Path:
    """Turn a (sharded) training checkpoint into a normal single-file model directory, in one process."""


    if not (ckpt / "dcp").is_dir():
        raise MiniGPTError(f"{ckpt} has no dcp/ directory: it is not a training checkpoint")
    verify_manifest(ckpt)
    model = Transformer(load_config(ckpt))
    sd = {"model": get_model_state_dict(model)}
    safe_dcp.load(sd, ckpt / "dcp")  # never pickle.load a file from disk
    set_model_state_dict(model, sd["model"])
    return save_pretrained(model, out, Tokenizer.from_dir(ckpt))
