"""The model: one Llama-style Transformer definition and its parts. Imports only torch, :mod:`minigpt.errors` and
itself."""
from minigpt.model.config import PRESETS, ModelConfig, preset
from minigpt.model.transformer import Transformer

__all__ = ["PRESETS", "ModelConfig", "Transformer", "preset"]
