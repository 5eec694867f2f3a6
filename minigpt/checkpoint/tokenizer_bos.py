"""Whether a model source's tokenizer prepends BOS by default, the way ``transformers`` would load it.

Evaluation harnesses encode text with the tokenizer's defaults (lm-evaluation-harness's ``hf`` model calls
``tokenizer.encode(text)``), so a model is scored with BOS first exactly when its tokenizer adds one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from minigpt.errors import json_loads
from minigpt.interop.gguf import read_vocab


def adds_bos(source: str | Path, tokenizer) -> bool:
    """True when ``source``'s tokenizer prepends BOS to every encoding by default.

    In order (what ``transformers`` 5 does on load): a ``tokenizer.json`` post-processor template decides (BOS
    when the template starts with the BOS token); else ``tokenizer_config.json``'s ``add_bos_token`` (our HF
    exports write what this function says of their source, with a matching template); a GGUF's ``tokenizer.ggml.add_bos_token`` (llama models default to true, as
    llama.cpp); a llama2.c ``.bin``, or a SentencePiece ``tokenizer.model`` with neither: true (Llama's convention,
    ``LlamaTokenizer``'s default); otherwise (MiniGPT's own byte-level BPE) false. ``tokenizer``: the loaded
    :class:`~minigpt.tokenizer.tokenizer.Tokenizer`.
    """
    source = Path(source)
    if tokenizer.bos_id is None:
        return False
    if source.is_file():
        if source.suffix == ".gguf":
            vocab = read_vocab(source)
            return bool(vocab is not None and vocab.add_bos)
        return True  # llama2.c's run.c encodes every prompt with BOS
    template = template_prefix(_json(source / "tokenizer.json").get("post_processor"))
    if template is not None:
        return template[:1] == [tokenizer.bos_id]
    flag = _json(source / "tokenizer_config.json").get("add_bos_token")
    if isinstance(flag, bool):
        return flag
    return tokenizer.backend == "sentencepiece"


def _json(path: Path) -> dict:
    try:
        value = json_loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def template_prefix(post: Any) -> Optional[list[int]]:
    """The ids a ``tokenizers`` post-processor puts before a single sequence (``[]`` for none) when it is, or holds
    in a Sequence, a TemplateProcessing; None for no template."""
    if not isinstance(post, dict):
        return None
    if post.get("type") == "Sequence":
        for inner in post.get("processors") or []:
            ids = template_prefix(inner)
            if ids is not None:
                return ids
        return None
    if post.get("type") != "TemplateProcessing":
        return None
    single = post.get("single") or []
    first = single[0] if single else None
    if not isinstance(first, dict) or "SpecialToken" not in first:
        return []
    name = first["SpecialToken"].get("id")
    return list((post.get("special_tokens") or {}).get(name, {}).get("ids") or [])
