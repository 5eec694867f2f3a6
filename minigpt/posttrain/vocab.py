"""Growing a model's vocabulary for new special tokens (e.g. ChatML's ``<|im_start|>`` / ``<|im_end|>``).

New embedding rows (and LM-head rows, when untied) start at the mean of the existing rows. Hewitt 2021 ("Initializing
new word embeddings for pretrained language models") shows why: with the mean, the new tokens' initial logits are
close to the average logit, so the model's distribution barely moves, whereas random rows can dominate the softmax.
``transformers``' ``resize_token_embeddings(mean_resizing=True)`` samples around the same mean. The resizing itself
is :func:`minigpt.model.transformer.resize_token_embeddings`, which loading an adapter that added tokens uses too.
"""
from __future__ import annotations

from minigpt.errors import MiniGPTError
from minigpt.model.transformer import resize_token_embeddings
from minigpt.tokenizer.chat_template import CHAT_TOKENS, add_special_tokens
from minigpt.tokenizer.tokenizer import Tokenizer


def add_chat_tokens(model, tokenizer: Tokenizer, tokens=CHAT_TOKENS) -> tuple[Tokenizer, list[int]]:
    """Make sure ``tokenizer`` has ``tokens`` (added as special tokens if missing) and ``model`` has rows for them
    (mean-initialised). Returns ``(tokenizer, new_ids)``; the model is changed in place."""
    tokenizer, new_ids = add_special_tokens(tokenizer, tokens)
    if new_ids:
        resize_token_embeddings(model, max(model.config.vocab_size, tokenizer.vocab_size), new_ids)
    elif tokenizer.vocab_size > model.config.vocab_size:
        raise MiniGPTError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                           f"{model.config.vocab_size} embeddings")
    return tokenizer, new_ids
