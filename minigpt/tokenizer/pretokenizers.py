"""llama.cpp's pre-tokenizers: how a byte-level BPE vocabulary splits text into words before merging.

A GGUF names its pre-tokenizer with ``tokenizer.ggml.pre`` (``"llama-bpe"``, ``"qwen2"``, ``"tekken"``, ...).
What each name means is defined by llama.cpp's ``src/llama-vocab.cpp``: ``llama_vocab::impl::load`` maps the
name to a ``LLAMA_VOCAB_PRE_TYPE_*`` (and sets flags such as ``ignore_merges``), and the constructor of
``llm_tokenizer_bpe`` gives each type a list of regexes, applied one after the other, each splitting every piece
the previous ones left into its matches and the text between them. That table is carried over as data, in
``llama_cpp_pretokenizers.json`` beside this file (regenerate it with ``scripts/llama_cpp_pretokenizers.py``; every
entry keeps its source line; docs/models.md lists them).

Where llama.cpp records "the original regex from tokenizer.json" beside its own adaptation (rewritten only because
C++ ``std::regex`` lacks ``(?i:...)`` and ``\\p{Lu}``), we split with the original: it is what the model's own
tokenizer and transformers use, and the Oniguruma engine of ``tokenizers`` runs it as is.

A name that is not in the table, a missing name, and Kimi-K2's (a hand-written splitter, not a regex) fall back to
GPT-2's pattern with a one-line warning on stderr: it is llama.cpp's ``gpt-2`` type and what transformers uses for
every name it does not know.
"""
from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

TABLE_FILE = Path(__file__).with_name("llama_cpp_pretokenizers.json")
FALLBACK = "gpt-2"

# The name written to a GGUF for a tokenizer.json whose split patterns are those of a type: the one llama.cpp's
# convert_hf_to_gguf.py writes for the best-known model of that type; other types use their first name.
_PREFERRED_NAME = {"LLAMA3": "llama-bpe", "QWEN2": "qwen2", "GPT2": "gpt-2", "DEFAULT": "default"}


@dataclass(frozen=True)
class PreTokenizer:
    """One ``tokenizer.ggml.pre`` value, resolved.

    ``name``: the name as the file gives it; ``kind``: the llama.cpp type (``LLAMA3`` for
    ``LLAMA_VOCAB_PRE_TYPE_LLAMA3``); ``splits``: the regexes, applied in order (``tokenizers``' ``Split`` with
    ``behavior="isolated"``); ``ignore_merges``: a whole pre-token found in the vocabulary is taken as one token
    before any merge (Llama 3's rule); ``fallback``: True when the name was not understood and GPT-2's pattern
    stands in for it.
    """

    name: Optional[str]
    kind: str
    splits: tuple[str, ...]
    ignore_merges: bool = False
    fallback: bool = False


@functools.lru_cache(maxsize=1)
def table() -> dict:
    """The parsed ``llama_cpp_pretokenizers.json``: ``source``, ``names`` (name -> type, line, flags), ``types``
    (type -> regexes with their lines), ``custom_splitters``."""
    return json.loads(TABLE_FILE.read_text(encoding="utf-8"))


def source() -> str:
    """``"ggml-org/llama.cpp src/llama-vocab.cpp @ <commit>"``, for messages and documentation."""
    s = table()["source"]
    return f"{s['repository']} {s['path']} @ {s['commit'][:10]}"


def known_names() -> list[str]:
    """Every name that resolves without falling back, sorted."""
    return sorted(n for n in table()["names"] if _splits(table()["names"][n]["type"]) is not None)


def _splits(kind: str) -> Optional[tuple[str, ...]]:
    regexes = [r["split"] for r in table()["types"][kind]["regexes"]]
    return None if any(r is None for r in regexes) else tuple(regexes)


def resolve(name: Optional[str], where: str = "GGUF") -> PreTokenizer:
    """The :class:`PreTokenizer` of a ``tokenizer.ggml.pre`` value (None: the key is absent).

    Never raises: an unknown, absent or non-regex name gives GPT-2's pattern and prints one ``warning:`` line to
    stderr that names ``where`` (the file) and the consequence.
    """
    entry = table()["names"].get(name) if name is not None else None
    splits = _splits(entry["type"]) if entry else None
    if entry and splits is not None:
        return PreTokenizer(name, entry["type"], splits, bool(entry["ignore_merges"]))
    if name is None:
        why = "has no tokenizer.ggml.pre"
    elif entry is None:
        why = f"names pre-tokenizer {name!r}, which is not in llama.cpp's table ({source()})"
    else:
        why = f"names pre-tokenizer {name!r}, which llama.cpp implements as hand-written code, not a regex"
    print(f"warning: {where} {why}; splitting text with GPT-2's pattern instead, so token ids may differ from "
          "the model's own tokenizer", file=sys.stderr)
    gpt2 = table()["names"][FALLBACK]
    return PreTokenizer(name, gpt2["type"], _splits(gpt2["type"]), False, fallback=True)


def name_for_splits(splits: tuple[str, ...]) -> Optional[str]:
    """The ``tokenizer.ggml.pre`` name whose regexes are exactly ``splits`` (matched against both llama.cpp's
    spelling and the tokenizer.json original), or None."""
    names, types = table()["names"], table()["types"]
    for kind in sorted(types, key=lambda k: (k not in _PREFERRED_NAME, k)):  # several types share regexes
        entry = types[kind]
        ours = tuple(r["split"] for r in entry["regexes"])
        theirs = tuple(r["regex"] for r in entry["regexes"])
        if splits in (ours, theirs):
            candidates = sorted(n for n, e in names.items() if e["type"] == kind)
            if candidates:
                preferred = _PREFERRED_NAME.get(kind)
                return preferred if preferred in candidates else candidates[0]
    return None


def build(pre: PreTokenizer):
    """``tokenizers`` pre-tokenizer for ``pre``: its splits in order, then the byte-to-printable-character mapping
    of byte-level BPE (GPT-2's ``bytes_to_unicode``)."""
    from tokenizers import Regex, pre_tokenizers

    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
    return pre_tokenizers.Sequence(steps + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
