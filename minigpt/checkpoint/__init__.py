"""The only way to disk for models: the native format, atomic writes, quantized checkpoints, loading any source
(MiniGPT, Hugging Face, GGUF, llama2.c) and converting between them (import / export)."""
from minigpt.checkpoint.native import (
                                       import_model,
                                       load_chat_template,
                                       load_config,
                                       load_model,
                                       load_tokenizer,
                                       resolve_checkpoint,
                                       save_pretrained,
)

__all__ = ["import_model", "load_chat_template", "load_config", "load_model", "load_tokenizer", "resolve_checkpoint",
           "save_pretrained"]
