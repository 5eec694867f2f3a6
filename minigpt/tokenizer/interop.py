"""Tokenizers across ecosystems: vocabulary tables <-> ``tokenizers`` tokenizers, and Hugging Face's side files.

GGUF files and llama2.c's ``tokenizer.bin`` carry no ``tokenizer.json``, only a table: the tokens in id order,
their llama.cpp types, and either BPE merges (``"gpt2"``: GPT-2 style byte-level BPE) or per-token scores
(``"llama"``: SentencePiece BPE, where a higher score means an earlier merge). :class:`Vocab` is that table;
:func:`vocab_from_file` reads it from a ``tokenizer.json`` / ``tokenizer.model`` (for GGUF export) and
:func:`build_tokenizer` turns it back into a ``tokenizers.Tokenizer`` (for GGUF and llama2.c import).

A SentencePiece vocabulary rebuilt this way encodes like ``sentencepiece`` for the models we have checked
(stories260K: 2,000 of 2,000 TinyStories paragraphs), including its ``remove_extra_whitespaces`` normalisation when it
is read from a ``tokenizer.model``; GGUF and llama2.c vocabularies do not record that flag, and other
SentencePiece normalisation rules (e.g. NFKC) are not reproduced. Where the original ``tokenizer.model`` is at hand,
MiniGPT itself uses it.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from minigpt.errors import MiniGPTError
from minigpt.tokenizer import pretokenizers

# llama.cpp token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

@dataclass
class Vocab:
    """A tokenizer as a table (the shape GGUF metadata stores it in).

    ``model``: ``"gpt2"`` (byte-level BPE; ``merges`` are ``"left right"`` strings, in rank order) or ``"llama"``
    (SentencePiece BPE; ``scores`` give the merge priority). ``types`` are llama.cpp token types, one per token.
    ``pre`` is llama.cpp's pre-tokenizer name (:mod:`minigpt.tokenizer.pretokenizers`; None: not given).
    ``eot_id`` / ``eom_id``: end of turn / end of message (GGUF ``tokenizer.ggml.eot_token_id`` /
    ``eom_token_id``). ``where`` names the file it came from, for messages.
    """

    model: str
    tokens: list[str]
    types: list[int]
    scores: Optional[list[float]] = None
    merges: Optional[list[str]] = None
    pre: Optional[str] = "gpt-2"
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    pad_id: Optional[int] = None
    unk_id: Optional[int] = None
    eot_id: Optional[int] = None
    eom_id: Optional[int] = None
    add_space_prefix: bool = True
    remove_extra_whitespaces: bool = False  # SentencePiece's normalizer option; not stored in GGUF
    add_bos: bool = False
    chat_template: Optional[str] = None
    where: str = "tokenizer"

    def token(self, i: Optional[int]) -> Optional[str]:
        return None if i is None else self.tokens[i]


# ----------------------------------------------------------------------------------------------------- building
def build_tokenizer(vocab: Vocab):
    """A ``tokenizers.Tokenizer`` equivalent to ``vocab``.

    An unknown pre-tokenizer name is not an error: it falls back to GPT-2's pattern with a warning
    (:func:`minigpt.tokenizer.pretokenizers.resolve`). Raises :class:`MiniGPTError` for a tokenizer model other than
    ``gpt2`` / ``llama`` or a vocabulary without its merges / scores.
    """
    if vocab.model == "gpt2":
        tok = _byte_level_bpe(vocab)
    elif vocab.model == "llama":
        tok = _sentencepiece_bpe(vocab)
    else:
        raise MiniGPTError(f"{vocab.where}: tokenizer model {vocab.model!r} (tokenizer.ggml.model) is not supported: "
                           "MiniGPT reads 'gpt2' (byte-level BPE) and 'llama' (SentencePiece) vocabularies; import "
                           "the model with --tokenizer FILE (a tokenizer.json or tokenizer.model) instead")
    from tokenizers import AddedToken

    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(vocab.tokens, vocab.types)
               if k == CONTROL or (k == UNKNOWN and vocab.model == "llama")]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(vocab.tokens, vocab.types)
            if k == USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok


def _byte_level_bpe(vocab: Vocab):
    from tokenizers import Tokenizer, decoders, models

    if vocab.merges is None:
        raise MiniGPTError(f"{vocab.where}: its byte-level BPE vocabulary has no merges (tokenizer.ggml.merges is "
                           "missing); import the model with --tokenizer FILE instead")
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    pre = pretokenizers.resolve(vocab.pre, vocab.where)
    # Llama 3's tokenizer looks a whole pre-token up in the vocabulary before merging (`ignore_merges`).
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges, ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = pretokenizers.build(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score order.

    SentencePiece BPE repeatedly joins the adjacent pair whose concatenation is the highest-scoring piece; a
    rank-ordered merge list gives the same result when every split ``(left, right)`` of a piece is ranked by the
    piece's score (ties by the ids of the parts). Control, unknown, unused and byte pieces never result from merges.
    """
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    candidates = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                candidates.append((-scores[i], ids[left], ids[right], left, right))
    candidates.sort()
    return [(left, right) for _, _, _, left, right in candidates]


def _sentencepiece_bpe(vocab: Vocab):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers

    if vocab.scores is None:
        raise MiniGPTError(f"{vocab.where}: its SentencePiece vocabulary has no scores (tokenizer.ggml.scores is "
                           "missing); import the model with --tokenizer FILE instead")
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    merges = sentencepiece_merges(vocab.tokens, vocab.scores, vocab.types)
    unk = vocab.token(vocab.unk_id)
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    norm = [normalizers.Replace(" ", SPIECE_SPACE)]
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:  # SentencePiece's add_dummy_prefix: a "▁" before the text, dropped on decode
        norm.insert(0, normalizers.Prepend(SPIECE_SPACE))
        steps.append(decoders.Strip(" ", 1, 0))
    if vocab.remove_extra_whitespaces:  # no leading/trailing spaces, runs of spaces collapsed to one
        norm[:0] = [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    tok.normalizer = normalizers.Sequence(norm)
    tok.decoder = decoders.Sequence(steps)
    return tok


# ----------------------------------------------------------------------------------------------------- reading
def vocab_from_file(path: str | Path) -> Vocab:
    """The :class:`Vocab` of a ``tokenizer.json`` (BPE) or a SentencePiece ``tokenizer.model``.

    Raises :class:`MiniGPTError` for a tokenizer that a GGUF vocabulary cannot describe (not BPE, or an
    unknown pre-tokenizer).
    """
    path = Path(path)
    if path.suffix == ".model":
        return _vocab_from_sentencepiece(path)
    return _vocab_from_tokenizer_json(json.loads(path.read_text(encoding="utf-8")), str(path))


def _vocab_from_sentencepiece(path: Path) -> Vocab:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(path))
    n = sp.get_piece_size()
    types = []
    for i in range(n):
        if sp.is_unknown(i):
            types.append(UNKNOWN)
        elif sp.is_control(i):
            types.append(CONTROL)
        elif sp.is_byte(i):
            types.append(BYTE)
        elif sp.is_unused(i):
            types.append(UNUSED)
        else:
            types.append(NORMAL)
    nonneg = lambda i: i if i >= 0 else None  # noqa: E731  (sentencepiece reports a missing token as -1)
    # The normalizer flags live in the protobuf, which would need the protobuf package; their effect shows.
    pieces = sp.encode("a", out_type=str)
    collapses = sp.encode(" a  b ") == sp.encode("a b")
    return Vocab(model="llama", tokens=[sp.id_to_piece(i) for i in range(n)], types=types,
                 scores=[sp.get_score(i) for i in range(n)], pre="default",
                 bos_id=nonneg(sp.bos_id()), eos_id=nonneg(sp.eos_id()), pad_id=nonneg(sp.pad_id()),
                 unk_id=nonneg(sp.unk_id()), add_space_prefix=bool(pieces) and pieces[0].startswith(SPIECE_SPACE),
                 remove_extra_whitespaces=collapses)


def _pre_name(pre: Optional[dict], where: str) -> tuple[bool, str]:
    """``(byte_level, llama.cpp pre name)`` of a ``tokenizer.json`` pre-tokenizer."""
    if pre is None:
        return False, "default"
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space"):
            raise MiniGPTError(f"{where}: a ByteLevel pre-tokenizer with add_prefix_space cannot be written to GGUF")
        if not pre.get("use_regex", True):
            raise MiniGPTError(f"{where}: a ByteLevel pre-tokenizer without its split pattern has no GGUF equivalent")
        return True, "gpt-2"
    if pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers", [])
        splits = tuple(s.get("pattern", {}).get("Regex") for s in steps[:-1])
        if (steps and steps[-1].get("type") == "ByteLevel" and all(s.get("type") == "Split" for s in steps[:-1])
                and all(s.get("behavior") == "Isolated" and not s.get("invert") for s in steps[:-1])):
            name = pretokenizers.name_for_splits(splits)
            if name is not None:
                return True, name
    if pre.get("type") == "Metaspace":
        return False, "default"
    raise MiniGPTError(f"{where}: pre-tokenizer {pre.get('type')!r} has no GGUF equivalent")


def _vocab_from_tokenizer_json(d: dict, where: str) -> Vocab:
    model = d.get("model", {})
    if model.get("type") != "BPE":
        raise MiniGPTError(f"{where}: only BPE tokenizers can be written to GGUF, not {model.get('type')!r}")
    byte_level, pre = _pre_name(d.get("pre_tokenizer"), where)
    ids: dict[str, int] = dict(model["vocab"])
    added = {t["id"]: t for t in d.get("added_tokens", [])}
    for i, t in added.items():
        ids[t["content"]] = i
    n = max(ids.values()) + 1
    tokens = [""] * n
    for t, i in ids.items():
        tokens[i] = t
    types = [NORMAL] * n
    for i, t in added.items():
        types[i] = CONTROL if t.get("special") else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    by_name = {t: i for i, t in enumerate(tokens)}

    def first(*names: str) -> Optional[int]:
        return next((by_name[x] for x in names if x in by_name), None)

    common = dict(bos_id=first("<|endoftext|>", "<s>", "<|begin_of_text|>", "<bos>"),
                  eos_id=first("<|endoftext|>", "</s>", "<|end_of_text|>", "<|eot_id|>", "<eos>"),
                  pad_id=first("<|pad|>", "<pad>", "[PAD]"))
    if byte_level:
        return Vocab(model="gpt2", tokens=tokens, types=types, merges=merges, pre=pre, **common)
    # A SentencePiece-style BPE (e.g. rebuilt from a GGUF "llama" vocabulary): GGUF wants scores, and a token's
    # score only has to order the merges, so the token made by merge r scores -r.
    scores = [float(-len(merges) - i) for i in range(n)]
    for rank, m in enumerate(merges):
        made = "".join(m.split(" ", 1))
        if made in by_name and scores[by_name[made]] < -rank:
            scores[by_name[made]] = float(-rank)
    for i, t in enumerate(tokens):
        if len(t) == 6 and t.startswith("<0x") and t.endswith(">") and types[i] == NORMAL:
            types[i] = BYTE
    unk = model.get("unk_token")
    normalizer = json.dumps(d.get("normalizer"))
    return Vocab(model="llama", tokens=tokens, types=types, scores=scores, pre="default",
                 unk_id=by_name.get(unk) if unk else None, add_space_prefix='"Prepend"' in normalizer
                 or '"prepend_scheme": "first"' in json.dumps(d.get("pre_tokenizer")), **common)


# ----------------------------------------------------------------------------------------------------- llama2.c
def read_llama2c_tokenizer(path: str | Path) -> Vocab:
    """llama2.c's ``tokenizer.bin``: ``int32 max_token_length``, then per token ``float32 score, int32 length,
    bytes``. Its ``export`` wrote SentencePiece pieces with "▁" shown as " " and BOS/EOS as ``"\\n<s>\\n"`` /
    ``"\\n</s>\\n"``; this undoes both. Ids 0/1/2 are ``<unk>``/``<s>``/``</s>`` (Llama's SentencePiece layout).

    Raises :class:`MiniGPTError` for a truncated file.
    """

    data = Path(path).read_bytes()
    tokens, scores, off = [], [], 4
    try:
        while off < len(data):
            score, length = struct.unpack_from("<fi", data, off)
            off += 8
            if length < 0 or off + length > len(data):
                raise struct.error("token runs past the end")
            tokens.append(data[off:off + length].decode("utf-8", errors="replace"))
            scores.append(score)
            off += length
    except struct.error as e:
        raise MiniGPTError(f"{path} is not a llama2.c tokenizer or is truncated ({e})") from None
    types = []
    for i, t in enumerate(tokens):
        if i == 0:
            types.append(UNKNOWN)
        elif t.strip() in ("<s>", "</s>") and i in (1, 2):
            tokens[i] = t.strip()
            types.append(CONTROL)
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            types.append(BYTE)
        else:
            tokens[i] = t.replace(" ", SPIECE_SPACE)
            types.append(NORMAL)
    return Vocab(model="llama", tokens=tokens, types=types, scores=scores, pre="default",
                 bos_id=1, eos_id=2, unk_id=0, add_space_prefix=True)


# ----------------------------------------------------------------------------------------------------- HF files
def token_string(tokenizer_file: str | Path, token_id: int) -> str:
    """The spelling of ``token_id`` in a ``tokenizer.json`` or SentencePiece ``tokenizer.model``."""
    tokenizer_file = Path(tokenizer_file)
    if tokenizer_file.suffix == ".model":
        import sentencepiece as spm

        return spm.SentencePieceProcessor(model_file=str(tokenizer_file)).id_to_piece(token_id)
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_file)).id_to_token(token_id)


def hf_tokenizer_config(
    tokenizer_file: str | Path,
    special_ids: dict[str, Optional[int]],
    model_max_length: int,
    chat_template: Optional[str] = None,
) -> tuple[dict, dict]:
    """``(tokenizer_config.json, special_tokens_map.json)`` contents for a tokenizer saved as ``tokenizer_file``.

    ``special_ids`` maps ``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token`` to ids (None = absent).
    BOS is never added by the tokenizer (``add_bos_token: false``), matching ``minigpt generate``, which prepends it
    only with ``--bos``; ``clean_up_tokenization_spaces: false`` keeps decoding byte-exact.
    """
    specials = {name: token_string(tokenizer_file, i) for name, i in special_ids.items() if i is not None}
    config: dict[str, Any] = {
        "tokenizer_class": "LlamaTokenizer" if str(tokenizer_file).endswith(".model") else "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if chat_template:
        config["chat_template"] = chat_template
    else:
        # minigpt's Tokenizer encodes the literal text "<|endoftext|>" as text; so does transformers with this flag.
        # A chat template writes special tokens as text, so models with one keep transformers' default.
        config["split_special_tokens"] = True
    return config, specials
