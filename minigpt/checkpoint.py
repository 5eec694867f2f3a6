"""Saving and loading models and training checkpoints, atomically and with clear errors.

A model directory holds ``config.json`` (our :class:`ModelConfig` fields), ``model.safetensors`` and, when known,
``tokenizer.json``. :func:`load_model` also accepts a Hugging Face ``LlamaForCausalLM`` directory (single-file or
sharded safetensors). Every directory is written under a temporary name, fsynced, then renamed, so a crash leaves
either the old checkpoint or the new one, never half of one.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from . import hf
from .config import ModelConfig
from .errors import MiniGPTError
from .transformer import Transformer

FORMAT = "minigpt"
MANIFEST = "manifest.json"


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success write a SHA-256 manifest, fsync and rename it to ``final``.

    If ``final`` exists it is replaced only after the new directory is complete. On an exception the temporary
    directory is removed and ``final`` is untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        files = sorted(p for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST)
        manifest = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        for p in tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(final.parent)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def verify_manifest(path: str | Path) -> None:
    """Check every file listed in ``path/manifest.json`` against its size and SHA-256.

    Raises :class:`MiniGPTError` naming the first missing, truncated or corrupt file. A directory without a
    manifest (e.g. a Hugging Face download) passes.
    """
    path = Path(path)
    mf = path / MANIFEST
    if not mf.is_file():
        return
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise MiniGPTError(f"{mf} is corrupt ({e})") from None
    for name, info in manifest.items():
        p = path / name
        if not p.is_file():
            raise MiniGPTError(f"checkpoint {path} is missing {name}")
        if p.stat().st_size != info["bytes"] or sha256_file(p) != info["sha256"]:
            raise MiniGPTError(f"checkpoint {path} is corrupt: {name} does not match its SHA-256 in {MANIFEST}")


def model_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """State dict without the tied LM head (safetensors refuses shared storage; the head is re-tied on load)."""
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        sd.pop("output.weight", None)
    return sd


def write_model_files(model: Transformer, directory: Path, tokenizer=None) -> None:
    """Write ``config.json``, ``model.safetensors`` (and ``tokenizer.json``) into an existing ``directory``."""
    config = {"format": FORMAT, **model.config.to_dict()}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(model_state_dict(model), str(directory / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(directory / "tokenizer.json")


def save_pretrained(model: Transformer, directory: str | Path, tokenizer=None) -> Path:
    """Atomically write a model directory (see module docstring). Returns its path."""
    with atomic_dir(directory) as tmp:
        write_model_files(model, tmp, tokenizer)
    return Path(directory)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise MiniGPTError(f"{path.parent} is not a model directory: {path.name} is missing")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MiniGPTError(f"{path} is not valid JSON ({e})") from None


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards its index lists, by their stored names.

    Raises :class:`MiniGPTError` for a missing, truncated or corrupt file.
    """
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    try:
        if single.is_file():
            return load_file(str(single))
        if index.is_file():
            tensors: dict[str, torch.Tensor] = {}
            for shard in sorted(set(_read_json(index)["weight_map"].values())):
                if not (directory / shard).is_file():
                    raise MiniGPTError(f"{directory} is missing shard {shard} listed in {index.name}")
                tensors.update(load_file(str(directory / shard)))
            return tensors
    except SafetensorError as e:
        raise MiniGPTError(f"{directory}: the weights file is corrupt or truncated ({e})") from None
    raise MiniGPTError(f"{directory} has no weights: expected model.safetensors (or a sharded index)")


def load_state_into(model: Transformer, sd: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``sd`` into ``model``, raising :class:`MiniGPTError` on missing/unexpected tensors or shape mismatch."""
    expected = model_state_dict(model)
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise MiniGPTError(
            f"{source} does not match its config: missing tensors {missing[:4]}, unexpected {unexpected[:4]}"
        )
    for k, v in sd.items():
        if v.shape != expected[k].shape:
            raise MiniGPTError(
                f"{source}: tensor {k} has shape {tuple(v.shape)} but the config implies {tuple(expected[k].shape)}"
            )
    model.load_state_dict(sd, strict=False)  # strict=False only because the tied head is absent from sd


def load_config(directory: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of a MiniGPT or Hugging Face model directory."""
    directory = Path(directory)
    d = _read_json(directory / "config.json")
    try:
        if d.get("format") == FORMAT:
            return ModelConfig.from_dict({k: v for k, v in d.items() if k != "format"})
        if hf.is_hf_dir(directory):
            return hf.config_from_hf(d)
    except (ValueError, KeyError, TypeError) as e:
        raise MiniGPTError(f"{directory}/config.json is invalid: {e}") from None
    raise MiniGPTError(f"{directory}/config.json is neither a MiniGPT nor a Hugging Face config")


def load_model(
    directory: str | Path,
    device: str | torch.device = "cpu",
    dtype: Optional[torch.dtype] = None,
) -> Transformer:
    """Load a MiniGPT or Hugging Face ``LlamaForCausalLM`` directory into a :class:`Transformer` in eval mode.

    Raises :class:`MiniGPTError` for a missing directory/file, corrupt weights, or weights that do not fit the
    config.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise MiniGPTError(f"checkpoint directory {directory} does not exist")
    verify_manifest(directory)
    config = load_config(directory)
    tensors = read_weights(directory)
    if hf.is_hf_dir(directory) and _read_json(directory / "config.json").get("format") != FORMAT:
        tensors = hf.state_dict_from_hf(tensors, config)
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to_empty(device=device)
    model.rope_cos, model.rope_sin = _rope_buffers(config, device)
    if config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    ref_dtype = next(iter(tensors.values())).dtype if tensors else torch.float32
    load_state_into(model, {k: v.to(ref_dtype) for k, v in tensors.items()}, str(directory))
    model = model.to(dtype=dtype or torch.float32)
    return model.eval()


def _rope_buffers(config: ModelConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    from .rope import rope_tables

    cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
    return cos.to(device), sin.to(device)


def load_tokenizer(directory: str | Path):
    """The tokenizer stored beside the weights (``tokenizer.json`` or SentencePiece ``tokenizer.model``)."""
    from .tokenizer import Tokenizer

    return Tokenizer.from_dir(directory)


def resolve_checkpoint(path: str | Path) -> Path:
    """A model directory from a run directory (follows its ``latest`` pointer) or a model directory itself.

    Raises :class:`MiniGPTError` if ``path`` is neither.
    """
    path = Path(path)
    if not path.is_dir():
        raise MiniGPTError(f"checkpoint {path} does not exist (give a run dir, checkpoint dir or HF model dir)")
    if (path / "config.json").is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        target = path / latest.read_text().strip()
        if target.is_dir():
            return target
        raise MiniGPTError(f"{latest} points at {target}, which does not exist")
    raise MiniGPTError(f"{path} is not a model directory: config.json is missing")
