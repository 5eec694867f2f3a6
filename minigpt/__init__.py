"""MiniGPT: a from-scratch, readable Llama-style language model system in PyTorch.

The public names below are imported on first use, so ``import minigpt`` (and the ``minigpt`` command's start-up)
stays light.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ModelConfig": "minigpt.model.config",
    "PRESETS": "minigpt.model.config",
    "preset": "minigpt.model.config",
    "Transformer": "minigpt.model.transformer",
    "Tokenizer": "minigpt.tokenizer.tokenizer",
    "load_model": "minigpt.checkpoint.native",
    "save_pretrained": "minigpt.checkpoint.native",
    "load_tokenizer": "minigpt.checkpoint.native",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'minigpt' has no attribute {name!r}")
