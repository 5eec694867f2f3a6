"""Quantized checkpoints on disk: int8 weight-only models (:mod:`minigpt.model.quant`) saved and loaded as they are.

A quantized directory is a MiniGPT directory whose ``config.json`` carries ``"quantization": {"method":
"int8_weight_only", "granularity": "per_output_channel"}`` next to the model fields, and whose ``model.safetensors``
holds each quantized ``NAME.weight`` as int8 plus ``NAME.weight_scale`` (float32, ``[out]``); ``output.weight``
(int8) is present even for a tied model.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file
from torch import nn

from minigpt.checkpoint.atomic import FORMAT, atomic_dir
from minigpt.errors import MiniGPTError
from minigpt.model.quant import METHOD, QUANT_CONFIG, Int8Linear, _replace_linears, is_quantized, quantized_state_dict
from minigpt.model.transformer import Transformer


def build_quantized(config, device: torch.device | str = "cpu") -> nn.Module:
    """An empty quantized :class:`Transformer` of ``config`` (int8 layers in place, weights zero) for loading."""
    with torch.device("meta"):
        model = Transformer(config)
    if config.tie_embeddings:  # the int8 head is its own tensor: untie before materialising
        model.output = nn.Linear(config.dim, config.vocab_size, bias=False, device="meta")
    _replace_linears(model, lambda lin: Int8Linear(lin.in_features, lin.out_features, lin.bias is not None,
                                                    device="meta"))
    model = model.to_empty(device=device)
    model.init_rope(device)
    model.quantization = dict(QUANT_CONFIG)
    return model


def save_quantized(model: nn.Module, directory, tokenizer=None):
    """Atomically write a quantized model directory (see the module docstring). Returns its path."""
    if not is_quantized(model):
        raise ValueError("save_quantized needs a quantized model (quantize_model first)")
    with atomic_dir(directory) as tmp:
        config = {"format": FORMAT, "quantization": dict(QUANT_CONFIG), **model.config.to_dict()}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(quantized_state_dict(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save(tmp / "tokenizer.json")
    return Path(directory)


def load_quantized(config, tensors: dict[str, torch.Tensor], source: str, device: torch.device | str = "cpu",
                   dtype: Optional[torch.dtype] = None) -> nn.Module:
    """A quantized :class:`Transformer` from ``tensors`` (the safetensors of :func:`save_quantized`), in eval mode.

    Float tensors are cast to ``dtype`` (default float32); int8 weights and their float32 scales stay as stored.
    Raises :class:`~minigpt.errors.MiniGPTError` on missing/unexpected tensors, a shape mismatch, or a weight that
    is not int8 where the format says it must be."""
    model = build_quantized(config, device)
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise MiniGPTError(f"{source} does not match its quantized config: missing tensors {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    for k, v in tensors.items():
        if v.shape != expected[k].shape:
            raise MiniGPTError(f"{source}: tensor {k} has shape {tuple(v.shape)} but the config implies "
                               f"{tuple(expected[k].shape)}")
        if expected[k].dtype == torch.int8 and v.dtype != torch.int8:
            raise MiniGPTError(f"{source}: tensor {k} should be int8 in an {METHOD} checkpoint, found {v.dtype}")
    model.load_state_dict(tensors)
    if dtype is not None and dtype != torch.float32:
        for m in model.modules():  # cast float parameters/buffers; int8 weights and the scales keep their dtype
            for name, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
                if t is not None and t.is_floating_point() and name != "weight_scale":
                    t.data = t.data.to(dtype)
    return model.eval()
