"""Tokenizers: our byte-level BPE and foreign vocabularies (GGUF, SentencePiece, llama2.c) behind one interface.
Imports only :mod:`minigpt.errors` and itself."""
from minigpt.tokenizer.tokenizer import HF_FILE, SP_FILE, SPECIAL_TOKENS, StreamDecoder, Tokenizer, train_tokenizer

__all__ = ["HF_FILE", "SP_FILE", "SPECIAL_TOKENS", "StreamDecoder", "Tokenizer", "train_tokenizer"]
