"""A plain-text prompt as token ids, as the model's own tokenizer would encode it (``minigpt generate``, the server,
the native launcher: a torch-free module)."""
from __future__ import annotations

from minigpt.tokenizer.tokenizer import Tokenizer


def encode_prompt(tokenizer: Tokenizer, text: str, bos: bool = False, special: bool = True) -> list[int]:
    """Token ids of a plain-text prompt.

    ``special``: special-token text written in the prompt (``<|im_start|>``, ``<|endoftext|>``) becomes its id,
    as ``transformers`` tokenizes by default (``split_special_tokens=False``); False encodes it as ordinary text.
    ``bos``: start with the tokenizer's BOS (never twice: not when the text already begins with it). An empty prompt
    gets BOS regardless, so that there is something to condition on. No BOS exists: nothing is prepended.
    """
    ids = tokenizer.encode(text, special=special)
    bos_id = tokenizer.bos_id
    if bos_id is not None and (bos or not ids) and ids[:1] != [bos_id]:
        ids.insert(0, bos_id)
    return ids
