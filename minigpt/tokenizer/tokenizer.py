"""Tokenizers: train a byte-level BPE, load it (or a sentencepiece ``tokenizer.model``), encode, decode, stream.

Two back ends sit behind one :class:`Tokenizer` interface:

* Hugging Face ``tokenizers`` (a ``tokenizer.json``). The ones we train with :func:`train_tokenizer` are GPT-2
  style byte-level BPE (Radford et al. 2019): every UTF-8 byte is mapped to one of 256 printable characters
  before the merges are learned, so *any* string encodes without an unknown token and decodes back byte for byte.
  There is deliberately no normalizer and no post-processor, since either would break that exact round trip.
* ``sentencepiece`` (a ``tokenizer.model``, e.g. Llama / llama2.c models such as ``stories260K``). These
  normalize whitespace on encode, so the round trip is exact only for text sentencepiece leaves unchanged.

Special tokens of the tokenizers we train (:data:`SPECIAL_TOKENS`): id 0 ``<|endoftext|>`` separates documents
and serves as both BOS and EOS (as in GPT-2); id 1 ``<|pad|>`` pads batches. Special tokens are only ever
produced by ``bos=True`` / ``eos=True``: the literal text ``"<|endoftext|>"`` inside a document is encoded as
ordinary text, so a corpus can never inject a fake document boundary.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Union

from minigpt.errors import MiniGPTError, one_line

PathLike = Union[str, Path]

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]
EOT_TOKEN, PAD_TOKEN = SPECIAL_TOKENS

# Names under which a tokenizer is stored in a model / data directory.
HF_FILE = "tokenizer.json"
SP_FILE = "tokenizer.model"

# 256 byte tokens + our 2 specials + at least one merge; ids must fit the uint32 token files of minigpt.data.prepare.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1
MAX_VOCAB_SIZE = 2**32

# Names that foreign tokenizer.json files commonly use for their BOS / EOS / pad tokens, most specific first.
_BOS_NAMES = (EOT_TOKEN, "<s>", "<|begin_of_text|>", "[CLS]", "<bos>")
_EOS_NAMES = (EOT_TOKEN, "</s>", "<|end_of_text|>", "<|eot_id|>", "[SEP]", "<eos>")
_PAD_NAMES = (PAD_TOKEN, "<pad>", "[PAD]", "<|finetune_right_pad_id|>")


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> "Tokenizer":
    """Learn a byte-level BPE tokenizer from ``texts``.

    Args:
        texts: strings of training text (documents or pieces of documents; they are not concatenated, so merges
            never cross the boundary between two items).
        vocab_size: total vocabulary size including the 256 byte tokens and the 2 special tokens; must be in
            ``[259, 2**32]``. The result can be smaller when the text is too small to supply that many merges.

    Returns:
        A :class:`Tokenizer` with ``<|endoftext|>`` = 0 and ``<|pad|>`` = 1.

    Raises:
        ValueError: ``vocab_size`` out of range or not an int.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"vocab_size must be an int, got {vocab_size!r}")
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be between {MIN_VOCAB_SIZE} (256 byte tokens + {len(SPECIAL_TOKENS)} special tokens "
            f"+ 1 merge) and 2**32, got {vocab_size}"
        )
    hf = HFTokenizer(models.BPE())
    # add_prefix_space=False: a prefix space would be added on encode but never removed on decode.
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # All 256 bytes, even those absent from the training text, so every string stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf=hf)


class Tokenizer:
    """A loaded tokenizer (Hugging Face ``tokenizers`` or ``sentencepiece`` back end).

    Construct with :meth:`from_file`, :meth:`from_dir` or :func:`train_tokenizer`. Token ids are plain Python
    ints in ``[0, vocab_size)``.
    """

    def __init__(self, hf=None, sp=None, sp_proto: Optional[bytes] = None):
        if (hf is None) == (sp is None):
            raise ValueError("Tokenizer needs exactly one of hf= (tokenizers.Tokenizer) or sp= (SentencePieceProcessor)")
        self._hf = hf
        self._sp = sp
        self._sp_proto = sp_proto
        if hf is not None:
            # Text that happens to contain "<|endoftext|>" must stay text (see module docstring). This flag is not
            # part of the serialized JSON, so it does not affect sha256 and must be set again on every load.
            hf.encode_special_tokens = True
            self._bos_id = self._lookup(_BOS_NAMES)
            self._eos_id = self._lookup(_EOS_NAMES)
            self._pad_id = self._lookup(_PAD_NAMES)
        else:
            self._bos_id = _nonneg_or_none(sp.bos_id())
            self._eos_id = _nonneg_or_none(sp.eos_id())
            self._pad_id = _nonneg_or_none(sp.pad_id())
        self._sha256: Optional[str] = None

    # ----------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_file(cls, path: PathLike) -> "Tokenizer":
        """Load a ``tokenizer.json`` (or, by suffix ``.model``, a sentencepiece model).

        Raises:
            MiniGPTError: the file is missing or cannot be parsed.
        """
        path = Path(path)
        if not path.is_file():
            raise MiniGPTError(f"tokenizer file {path} does not exist")
        if path.suffix == ".model":
            return cls._from_sentencepiece(path)
        from tokenizers import Tokenizer as HFTokenizer

        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception with a serde message
            raise MiniGPTError(f"cannot read tokenizer {path}: {one_line(e)}") from e
        return cls(hf=hf)

    @classmethod
    def from_dir(cls, directory: PathLike) -> "Tokenizer":
        """Load the tokenizer stored in ``directory``: ``tokenizer.json`` if present, else ``tokenizer.model``.

        Raises:
            MiniGPTError: neither file exists (the message names the directory and both file names).
        """
        directory = Path(directory)
        for name in (HF_FILE, SP_FILE):
            if (directory / name).is_file():
                return cls.from_file(directory / name)
        raise MiniGPTError(
            f"no tokenizer in {directory}: expected {HF_FILE} (Hugging Face tokenizers) or {SP_FILE} (sentencepiece)"
        )

    @classmethod
    def _from_sentencepiece(cls, path: Path) -> "Tokenizer":
        import sentencepiece as spm

        proto = path.read_bytes()
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(proto)
        except Exception as e:
            raise MiniGPTError(f"cannot read sentencepiece model {path}: {one_line(e)}") from e
        return cls(sp=sp, sp_proto=proto)

    def save(self, path: PathLike) -> Path:
        """Write the tokenizer and return the file written.

        ``path`` is either an existing directory (the file is then ``tokenizer.json``, or ``tokenizer.model`` for a
        sentencepiece tokenizer, so that :meth:`from_dir` finds it) or a file path used as is, except that a
        sentencepiece model asked to be saved under a name not ending in ``.model`` (say ``dir/tokenizer.json``) is
        written to ``tokenizer.model`` in that folder instead: its bytes are a protobuf, not JSON.
        """
        path = Path(path)
        if path.is_dir():
            path = path / (SP_FILE if self._sp is not None else HF_FILE)
        elif self._sp is not None and path.suffix != ".model":
            path = path.with_name(SP_FILE)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        if self._sp is not None:
            tmp.write_bytes(self._sp_proto)
        else:
            self._hf.save(str(tmp), pretty=True)
        tmp.replace(path)  # atomic: a crash never leaves a half-written tokenizer next to a good model
        return path

    # ----------------------------------------------------------------------------------------------- properties
    @property
    def backend(self) -> str:
        """``"tokenizers"`` or ``"sentencepiece"``."""
        return "sentencepiece" if self._sp is not None else "tokenizers"

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (ids are ``0 .. vocab_size - 1``)."""
        if self._sp is not None:
            return self._sp.get_piece_size()
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> Optional[int]:
        """Id prepended by ``encode(bos=True)``; ``<|endoftext|>`` for our BPE, ``<s>`` for sentencepiece."""
        return self._bos_id

    @property
    def eos_id(self) -> Optional[int]:
        """Id appended by ``encode(eos=True)`` and after every document in prepared data; generation stops on it."""
        return self._eos_id

    @property
    def pad_id(self) -> Optional[int]:
        """Padding id, or None when the tokenizer has none (e.g. most sentencepiece models)."""
        return self._pad_id

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of the canonical serialized tokenizer; equal before and after save/load.

        For ``tokenizers`` it hashes the JSON re-dumped with sorted keys and no whitespace (the on-disk file may be
        pretty-printed); for sentencepiece the model bytes. Stored in data ``meta.json`` and checkpoints so a model
        is never trained or sampled with a different tokenizer than its data.
        """
        if self._sha256 is None:
            if self._sp is not None:
                blob = self._sp_proto
            else:
                canonical = json.dumps(json.loads(self._hf.to_str()), sort_keys=True, separators=(",", ":"),
                                       ensure_ascii=False)
                blob = canonical.encode("utf-8")
            self._sha256 = hashlib.sha256(blob).hexdigest()
        return self._sha256

    def token_to_id(self, token: str) -> Optional[int]:
        """Id of the token spelled ``token`` (e.g. ``"<|endoftext|>"``), or None."""
        if self._sp is not None:
            i = self._sp.piece_to_id(token)
            # sentencepiece maps unknown pieces to unk; only report a real match.
            return i if self._sp.id_to_piece(i) == token else None
        return self._hf.token_to_id(token)

    def _lookup(self, names: Sequence[str]) -> Optional[int]:
        for name in names:
            i = self._hf.token_to_id(name)
            if i is not None:
                return i
        return None

    # ----------------------------------------------------------------------------------------------- coding
    def encode(self, text: str, bos: bool = False, eos: bool = False) -> List[int]:
        """Token ids of ``text``, optionally with ``bos_id`` prepended / ``eos_id`` appended.

        Raises:
            ValueError: ``bos``/``eos`` requested but the tokenizer has no such token.
        """
        if self._sp is not None:
            ids = self._sp.encode(text)
        else:
            # add_special_tokens=False: a foreign tokenizer.json's post-processor must not add its own BOS/EOS.
            ids = self._hf.encode(text, add_special_tokens=False).ids
        if bos:
            ids.insert(0, self._require(self._bos_id, "bos"))
        if eos:
            ids.append(self._require(self._eos_id, "eos"))
        return ids

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        """``[encode(t) for t in texts]`` without BOS/EOS, computed in parallel by the back end."""
        texts = list(texts)
        if self._sp is not None:
            return self._sp.encode(texts)
        batch = getattr(self._hf, "encode_batch_fast", None) or self._hf.encode_batch  # _fast skips offsets
        return [e.ids for e in batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens included as text. Bytes that do not form complete UTF-8 characters
        decode to U+FFFD (one per byte for byte-level BPE)."""
        ids = [int(i) for i in ids]
        if self._sp is not None:
            return self._sp.decode(ids)
        return self._hf.decode(ids, skip_special_tokens=False)

    @staticmethod
    def _require(i: Optional[int], what: str) -> int:
        if i is None:
            raise ValueError(f"this tokenizer has no {what} token")
        return i

    def __repr__(self) -> str:
        return (f"Tokenizer(backend={self.backend!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}, pad_id={self.pad_id})")


class StreamDecoder:
    """Incremental detokenizer for streaming generation.

    Feed ids one at a time with :meth:`push`; it returns the text that became final with that id (often ``""``).
    The concatenation of all returned strings plus :meth:`flush` equals ``tokenizer.decode(all_ids)``.

    A byte-level BPE token may hold only part of a multi-byte UTF-8 character (a CJK character is 3 bytes, an
    emoji 4), which decodes to U+FFFD until the remaining bytes arrive; so text whose decoding ends in U+FFFD is
    held back. Decoding also depends on context (sentencepiece drops the leading space of the first piece), so
    the new text is the difference between decoding a short window *with* the new ids and *without* them, the
    scheme of Hugging Face's ``TextStreamer`` and vLLM's incremental detokenizer. The window starts at the last
    point where text was emitted, so the work per token is O(window), not O(sequence).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._ids: List[int] = []  # ids from the start of the decode window on
        self._read = 0  # ids[:_read] are already emitted; ids[_read:] are pending

    def push(self, token_id: int) -> str:
        """Add one id; return newly completed text (``""`` while a character is still incomplete)."""
        self._ids.append(int(token_id))
        emitted = self.tokenizer.decode(self._ids[: self._read])
        full = self.tokenizer.decode(self._ids)
        if len(full) <= len(emitted) or full.endswith("\ufffd"):
            return ""
        # Keep the just-emitted ids as left context for the next decode; drop everything older.
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        return full[len(emitted):]

    def flush(self) -> str:
        """End the stream: return whatever is still pending (incomplete bytes as U+FFFD) and reset.

        After a flush the decoder starts a new stream, without left context (a sentencepiece tokenizer would then
        drop the leading space of the next piece), so call it once, at the end.
        """
        emitted = self.tokenizer.decode(self._ids[: self._read])
        full = self.tokenizer.decode(self._ids)
        self._ids, self._read = [], 0
        return full[len(emitted):]


def _nonneg_or_none(i: int) -> Optional[int]:
    # sentencepiece reports a disabled special token as -1.
    return i if i >= 0 else None

