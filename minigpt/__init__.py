"""MiniGPT: a from-scratch, readable Llama-style language model system in PyTorch."""
from .config import ModelConfig, PRESETS, preset
from .transformer import Transformer

__version__ = "0.1.0"
__all__ = ["ModelConfig", "PRESETS", "preset", "Transformer", "__version__"]
