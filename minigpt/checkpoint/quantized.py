"""Quantized checkpoints on disk: int8 and int4 weight-only models (:mod:`minigpt.model.quant`) saved and loaded as
they are.

A quantized directory is a MiniGPT directory whose ``config.json`` carries a ``"quantization"`` entry next to the
model fields (:func:`~minigpt.model.quant.quant_config`): ``{"method": "int8_weight_only", "granularity":
"per_output_channel"}`` or ``{"method": "int4_weight_only", "granularity": "per_group", "group_size": 32, ...}``.
Its ``model.safetensors`` holds each int8 ``NAME.weight`` as int8 plus ``NAME.weight_scale`` (float32, ``[out]``),
each int4 one as uint8 ``[out, in / 2]`` plus ``NAME.weight_scale`` (float16, ``[out, in / group_size]``); which
layers are int4 follows from the config (:func:`~minigpt.model.quant.int4_applies`). ``output.weight`` (int8) is
present even for a tied model. Beside them, as in every model directory: the tokenizer, its special-token roles
(``tokenizer_config.json``, ``generation_config.json``: BOS, EOS, the stop ids) and the chat template, so that the
quantized model chats and stops as the float one did.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from minigpt.checkpoint.atomic import FORMAT, atomic_dir, save_tensors
from minigpt.errors import MiniGPTError
from minigpt.model.quant import (
    GROUP_SIZE,
    METHOD_INT4,
    METHODS,
    Int4Linear,
    Int8Linear,
    _replace_linears,
    int4_applies,
    is_quantized,
    quant_config,
    quantized_state_dict,
)
from minigpt.model.transformer import Transformer
from minigpt.tokenizer.roles import config_files


def check_quantization(quantization: dict, source: str) -> dict:
    """The normalised ``quantization`` entry of ``source``'s config (:func:`~minigpt.model.quant.quant_config`).
    Raises :class:`MiniGPTError` (one line) for an unknown method or a bad group size."""
    method = quantization.get("method")
    if method not in METHODS:
        raise MiniGPTError(f"{source}: unknown quantization method {method!r}; this version reads {list(METHODS)}")
    try:
        return quant_config(method, quantization.get("group_size", GROUP_SIZE))
    except ValueError as e:
        raise MiniGPTError(f"{source}: {e}") from None


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``model.to_empty(device=device)`` for a model built on the meta device: uninitialised storage for every
    parameter and buffer, ties kept. Allocated with ``torch.empty`` because ``to_empty``'s ``empty_like`` of a meta
    tensor runs torch's Python reference kernels, whose first use imports sympy (~0.4 s of every CLI call)."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def build_quantized(config, device: torch.device | str = "cpu", quantization: Optional[dict] = None,
                    on_meta: Optional[nn.Module] = None) -> nn.Module:
    """An empty quantized :class:`Transformer` of ``config`` (quantized layers in place, weights zero) for loading;
    ``quantization`` is the config's entry (default int8). ``on_meta``: this same model already built on the meta
    device (a call with ``device="meta"``), given storage on ``device`` instead of being built again (building
    it costs ~0.2 s of a CLI call at 135M parameters, measured)."""
    if on_meta is not None:
        model = materialize(on_meta, device)
        model.init_rope(device)
        return model
    quantization = quant_config() if quantization is None else quantization
    int4 = quantization["method"] == METHOD_INT4
    group_size = quantization.get("group_size", GROUP_SIZE)
    with torch.device("meta"):
        model = Transformer(config)
    if config.tie_embeddings:  # the int8 head is its own tensor: untie before materialising
        model.output = nn.Linear(config.dim, config.vocab_size, bias=False, device="meta")

    def make(lin: nn.Linear, name: str) -> nn.Module:
        has_bias = lin.bias is not None
        if int4 and int4_applies(name, lin.in_features, group_size):
            return Int4Linear(lin.in_features, lin.out_features, has_bias, group_size, device="meta")
        return Int8Linear(lin.in_features, lin.out_features, has_bias, device="meta")

    _replace_linears(model, make)
    model = materialize(model, device)
    model.init_rope(device)
    model.quantization = dict(quantization)
    return model


def tokenizer_files(tokenizer, chat_template: Optional[str]) -> dict[str, dict]:
    """``{file name: JSON content}`` that keep a tokenizer's special-token roles (BOS, EOS, pad, unk, every stop id,
    whether BOS is added) and the chat template in a model directory (Hugging Face shapes, read back by
    :func:`minigpt.checkpoint.native.load_tokenizer` and ``load_chat_template``)."""
    if tokenizer is None:
        return {"tokenizer_config.json": {"chat_template": chat_template}} if chat_template else {}
    spell = lambda i: None if i is None else tokenizer.id_to_token(i)  # noqa: E731
    return config_files(spell(tokenizer.bos_id), spell(tokenizer.eos_id), spell(tokenizer.pad_id),
                        spell(tokenizer.unk_id), list(tokenizer.stop_ids), tokenizer.bos_id, tokenizer.add_bos,
                        chat_template)


def write_tokenizer_files(directory: Path, tokenizer, chat_template: Optional[str]) -> None:
    """Write the tokenizer (when given) and :func:`tokenizer_files` into ``directory``."""
    if tokenizer is not None:
        tokenizer.save(directory / "tokenizer.json")
    for name, content in tokenizer_files(tokenizer, chat_template).items():
        (directory / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")


def save_quantized(model: nn.Module, directory, tokenizer=None, chat_template: Optional[str] = None) -> Path:
    """Atomically write a quantized model directory (see the module docstring), with the tokenizer, its roles and
    the chat template when given. Returns its path. Raises ``ValueError`` for a model that is not quantized."""
    if not is_quantized(model):
        raise ValueError("save_quantized needs a quantized model (quantize_model first)")
    quantization = getattr(model, "quantization", None) or quant_config()
    with atomic_dir(directory) as tmp:
        config = {"format": FORMAT, "quantization": dict(quantization), **model.config.to_dict()}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_tensors(quantized_state_dict(model), tmp / "model.safetensors", metadata={"format": "pt"})
        write_tokenizer_files(tmp, tokenizer, chat_template)
    return Path(directory)


def load_quantized(config, tensors: dict[str, torch.Tensor], source: str, device: torch.device | str = "cpu",
                   dtype: Optional[torch.dtype] = None, quantization: Optional[dict] = None,
                   on_meta: Optional[nn.Module] = None) -> nn.Module:
    """A quantized :class:`Transformer` from ``tensors`` (the safetensors of :func:`save_quantized`), in eval mode;
    ``quantization`` the config's entry (default int8).

    Float tensors are cast to ``dtype`` (default float32); quantized weights and their scales stay as stored.
    ``on_meta``: the empty model already built on the meta device (see :func:`build_quantized`).
    Raises :class:`~minigpt.errors.MiniGPTError` on missing/unexpected tensors, a shape mismatch, or a weight or
    scale whose dtype is not the one the format says (int8 / uint8 weights, float32 / float16 scales)."""
    model = build_quantized(config, device, quantization, on_meta)
    method = model.quantization["method"]
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise MiniGPTError(f"{source} does not match its quantized config: missing tensors {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    for k, v in tensors.items():
        if v.shape != expected[k].shape:
            raise MiniGPTError(f"{source}: tensor {k} has shape {tuple(v.shape)} but the config implies "
                               f"{tuple(expected[k].shape)}")
        want = expected[k].dtype
        exact = want in (torch.int8, torch.uint8) or k.endswith(".weight_scale")
        if exact and v.dtype != want:
            raise MiniGPTError(f"{source}: tensor {k} should be {str(want).replace('torch.', '')} in an {method} "
                               f"checkpoint, found {str(v.dtype).replace('torch.', '')}")
    model.load_state_dict(tensors)
    if dtype is not None and dtype != torch.float32:
        for m in model.modules():  # cast float parameters/buffers; quantized weights and the scales keep their dtype
            for name, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
                if t is not None and t.is_floating_point() and name != "weight_scale":
                    t.data = t.data.to(dtype)
    return model.eval()

