"""Tokenizers: train a byte-level BPE, load it (or a sentencepiece ``tokenizer.model``), encode, decode, stream.

Two back ends sit behind one :class:`Tokenizer` interface:

* Hugging Face ``tokenizers`` (a ``tokenizer.json``). The ones we train with :func:`train_tokenizer` are GPT-2
  style byte-level BPE (Radford et al. 2019): every UTF-8 byte is mapped to one of 256 printable characters
  before the merges are learned, so *any* string encodes without an unknown token and decodes back byte for byte.
  There is deliberately no normalizer and no post-processor, since either would break that exact round trip.
* ``sentencepiece`` (a ``tokenizer.model``, e.g. Llama / llama2.c models such as ``stories260K``). These
  normalize whitespace on encode, so the round trip is exact only for text sentencepiece leaves unchanged.

Special tokens of the tokenizers we train (:data:`SPECIAL_TOKENS`): id 0 ``<|endoftext|>`` separates documents
and serves as both BOS and EOS (as in GPT-2); id 1 ``<|pad|>`` pads batches. By default special tokens are only
ever produced by ``bos=True`` / ``eos=True``: the literal text ``"<|endoftext|>"`` inside a document is encoded as
ordinary text, so a corpus can never inject a fake document boundary. ``encode(text, special=True)`` instead maps
every special token of the tokenizer written literally in ``text`` to its id (chat prompts, ``<|im_start|>``), as
transformers does by default (``split_special_tokens=False``).

Which ids are BOS / EOS / pad / unk and which end generation comes from the model's own files when they say
(:mod:`minigpt.tokenizer.roles`), else from the token names.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, List, Optional, Sequence, Union

from minigpt.errors import MiniGPTError, one_line, os_error_from
from minigpt.tokenizer import roles as roles_mod
from minigpt.tokenizer.roles import UNSET, TokenRoles
from minigpt.tokenizer.text import InvalidText, TokenizerFailed, backend_errors, check_text  # noqa: F401 (re-exported)

PathLike = Union[str, Path]

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]
EOT_TOKEN, PAD_TOKEN = SPECIAL_TOKENS

# Names under which a tokenizer is stored in a model / data directory.
HF_FILE = "tokenizer.json"
SP_FILE = "tokenizer.model"

# 256 byte tokens + our 2 specials + at least one merge; ids must fit the uint32 token files of minigpt.data.prepare.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1
MAX_VOCAB_SIZE = 2**32


class TokenizerMissing(MiniGPTError):
    """A model source has no tokenizer at all (as opposed to one that cannot be read)."""


def check_vocab_size(vocab_size: Any, name: str = "vocab_size") -> None:
    """Refuse a size :func:`train_tokenizer` cannot learn: not an int, or outside ``[MIN_VOCAB_SIZE,
    MAX_VOCAB_SIZE]``; the message calls it ``name`` (a CLI flag). Raises ``ValueError``."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"{name} must be an int, got {vocab_size!r}")
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"{name} must be between {MIN_VOCAB_SIZE} (the 256 byte tokens, {len(SPECIAL_TOKENS)} "
                         f"special tokens and 1 merge) and 2**32, got {vocab_size}")


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

    check_vocab_size(vocab_size)
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

    def __init__(self, hf=None, sp=None, sp_proto: Optional[bytes] = None, roles: Optional[TokenRoles] = None):
        if (hf is None) == (sp is None):
            raise ValueError("Tokenizer needs exactly one of hf= (tokenizers.Tokenizer) or sp= (SentencePieceProcessor)")
        self._hf = hf
        self._sp = sp
        self._sp_proto = sp_proto
        self._hf_special = None  # a copy of hf that matches special tokens in text (encode(special=True))
        self._special_re = None  # the same for sentencepiece: one alternation of the escaped specials
        if hf is not None:
            # Text that happens to contain "<|endoftext|>" must stay text (see module docstring). This flag is not
            # part of the serialized JSON, so it does not affect sha256 and must be set again on every load.
            hf.encode_special_tokens = True
        self.set_roles(roles or TokenRoles())
        self._sha256: Optional[str] = None

    def set_roles(self, roles: TokenRoles) -> None:
        """Apply the special-token roles a model's files declare; roles they leave UNSET are found by name."""
        if self._sp is not None:
            own = {"bos": self._sp.bos_id(), "eos": self._sp.eos_id(), "pad": self._sp.pad_id(),
                   "unk": self._sp.unk_id()}
            by_name = {k: _nonneg_or_none(v) for k, v in own.items()}
        else:
            by_name = {"bos": self._lookup(roles_mod.BOS_NAMES), "eos": self._lookup(roles_mod.EOS_NAMES),
                       "pad": self._lookup(roles_mod.PAD_NAMES), "unk": self._lookup(roles_mod.UNK_NAMES)}
        ids = {k: by_name[k] if getattr(roles, k) == UNSET else getattr(roles, k) for k in by_name}
        for k, i in ids.items():
            if i is not None and not 0 <= i < self.vocab_size:
                where = f" in {roles.source}" if roles.source else ""
                raise MiniGPTError(f"the {k} token id {i}{where} is outside the vocabulary (0..{self.vocab_size - 1}); "
                                   "fix the id in the model's tokenizer files")
        self._bos_id, self._eos_id, self._pad_id, self._unk_id = ids["bos"], ids["eos"], ids["pad"], ids["unk"]
        stop = [i for i in (self._eos_id, *roles.stop) if i is not None and 0 <= i < self.vocab_size]
        names = roles_mod.LLAMA_CPP_EOG_NAMES if roles.named_eog else ()
        if not roles.stop and not roles.named_eog and roles.eos == UNSET:
            names = roles_mod.END_OF_TURN_NAMES  # no file says: end-of-turn tokens found by name also stop
        stop += [i for i in (self.token_to_id(n) for n in names) if i is not None]
        self._stop_ids = tuple(dict.fromkeys(stop))
        self._add_bos = roles.add_bos
        self._roles = roles

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
    def from_dir(cls, directory: PathLike, prefer_sentencepiece: bool = False) -> "Tokenizer":
        """Load the tokenizer stored in ``directory``: ``tokenizer.json`` if present, else ``tokenizer.model``
        (the other way round with ``prefer_sentencepiece``), with the special-token roles of the Hugging Face side
        files beside it (``tokenizer_config.json``, ``special_tokens_map.json``, ``generation_config.json``,
        ``config.json``; :func:`minigpt.tokenizer.roles.roles_from_dir`).

        Raises:
            TokenizerMissing: neither file exists (the message names the directory and both file names).
            MiniGPTError: a file cannot be read.
        """
        directory = Path(directory)
        for name in ((SP_FILE, HF_FILE) if prefer_sentencepiece else (HF_FILE, SP_FILE)):
            if (directory / name).is_file():
                tok = cls.from_file(directory / name)
                tok.set_roles(roles_mod.roles_from_dir(directory, tok.token_to_id, tok.vocab_size))
                return tok
        raise TokenizerMissing(
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

        Raises ``OSError`` (its errno and the file's name) when the file cannot be written, a full disk or a
        read-only file system; nothing is left behind then.
        """
        path = Path(path)
        if path.is_dir():
            path = path / (SP_FILE if self._sp is not None else HF_FILE)
        elif self._sp is not None and path.suffix != ".model":
            path = path.with_name(SP_FILE)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            if self._sp is not None:
                tmp.write_bytes(self._sp_proto)
            else:
                try:
                    self._hf.save(str(tmp), pretty=True)
                except Exception as e:  # tokenizers raises a bare Exception for a failed write (full disk, ...)
                    raise (os_error_from(e, path) or e) from None
            tmp.replace(path)  # atomic: a crash never leaves a half-written tokenizer next to a good model
        finally:
            tmp.unlink(missing_ok=True)
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
    def unk_id(self) -> Optional[int]:
        """Id of the unknown token, or None (byte-level BPE needs none)."""
        return self._unk_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends generation, EOS first: EOS, the ``eos_token_id`` list of generation_config.json, a
        GGUF's end-of-turn / end-of-message ids and llama.cpp's end-of-generation names (:mod:`.roles`); when no
        file says, end-of-turn tokens found by name (``<|eot_id|>``, ``<|im_end|>`` ...)."""
        return self._stop_ids

    @property
    def add_bos(self) -> Optional[bool]:
        """Whether the model's own tokenizer prepends BOS to a prompt (``add_bos_token`` / GGUF
        ``tokenizer.ggml.add_bos_token``); None when its files do not say."""
        return self._add_bos

    @property
    def roles(self) -> TokenRoles:
        """The roles as the model's files declared them (UNSET where they are silent)."""
        return self._roles

    @property
    def special_tokens(self) -> dict[str, int]:
        """Every special token that ``encode(special=True)`` recognises in text: spelling -> id (added tokens
        marked special for ``tokenizers``; control and unknown pieces for sentencepiece)."""
        if self._sp is not None:
            sp = self._sp
            return {sp.id_to_piece(i): i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
        return {t.content: i for i, t in self._hf.get_added_tokens_decoder().items() if t.special}

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

    def id_to_token(self, i: int) -> str:
        """The spelling of id ``i`` in the vocabulary (byte-level tokens in their printable-character form)."""
        return self._sp.id_to_piece(i) if self._sp is not None else self._hf.id_to_token(i)

    def vocabulary_difference(self, other: "Tokenizer") -> Optional[str]:
        """None when ``other`` gives every id the same token as this tokenizer (and has as many ids), else a short
        phrase naming the first difference. What two models must share for one to draft for the other: llama.cpp's
        speculative decoding makes the same per-id comparison of token texts (``common_speculative_are_compatible``).
        """
        if self.vocab_size != other.vocab_size:
            return f"{self.vocab_size} against {other.vocab_size} token ids"
        for i in range(self.vocab_size):
            a, b = self.id_to_token(i), other.id_to_token(i)
            if a != b:
                return f"id {i} is {a!r} against {b!r}"
        return None

    def _lookup(self, names: Sequence[str]) -> Optional[int]:
        for name in names:
            i = self._hf.token_to_id(name)
            if i is not None:
                return i
        return None

    # ----------------------------------------------------------------------------------------------- coding
    def encode(self, text: str, bos: bool = False, eos: bool = False, special: bool = False) -> List[int]:
        """Token ids of ``text``, optionally with ``bos_id`` prepended / ``eos_id`` appended.

        ``special=False`` (default): special tokens written in ``text`` are encoded as ordinary text.
        ``special=True``: each special token of the tokenizer (:attr:`special_tokens`, not only BOS/EOS/pad)
        written literally in ``text`` becomes its id, like transformers with ``split_special_tokens=False``; the
        text between them is encoded as usual (for sentencepiece each piece separately, as transformers' legacy
        Llama tokenizer does). Cost: linear in ``len(text)`` (Aho-Corasick in ``tokenizers``; one precompiled
        alternation for sentencepiece).

        Raises:
            ValueError: ``bos``/``eos`` requested but the tokenizer has no such token.
            InvalidText: ``text`` is not valid UTF-8 (a :class:`MiniGPTError` and a ``ValueError``; checked before
                the back end sees it), or :class:`TokenizerFailed` (one) when the back end gives up on it.
        """
        check_text(text)
        with backend_errors():
            if special:
                ids = self._encode_special(text)
            elif self._sp is not None:
                ids = self._sp.encode(text)
            else:
                # add_special_tokens=False: a foreign tokenizer.json's post-processor must not add its own BOS/EOS.
                ids = self._hf.encode(text, add_special_tokens=False).ids
        if bos:
            ids.insert(0, self._require(self._bos_id, "bos"))
        if eos:
            ids.append(self._require(self._eos_id, "eos"))
        return ids

    def _encode_special(self, text: str) -> List[int]:
        if self._hf is not None:
            if self._hf_special is None:
                from tokenizers import Tokenizer as HFTokenizer

                # A second instance whose added-vocabulary matcher also splits on special tokens; the flag is per
                # instance, and toggling it on the shared one would race between threads (serve).
                self._hf_special = HFTokenizer.from_str(self._hf.to_str())
                self._hf_special.encode_special_tokens = False
            return self._hf_special.encode(text, add_special_tokens=False).ids
        if self._special_re is None:
            specials = self.special_tokens
            # Longest first, so that a special token that begins with another one wins.
            alternation = "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))
            self._special_re = (re.compile(alternation) if specials else None, specials)
        pattern, specials = self._special_re
        if pattern is None:
            return self._sp.encode(text)
        ids, pos = [], 0
        for m in pattern.finditer(text):
            if m.start() > pos:
                ids += self._sp.encode(text[pos:m.start()])
            ids.append(specials[m.group()])
            pos = m.end()
        if pos < len(text):
            ids += self._sp.encode(text[pos:])
        return ids

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        """``[encode(t) for t in texts]`` without BOS/EOS, computed in parallel by the back end. Raises
        :class:`InvalidText` when a text is not valid UTF-8."""
        texts = list(texts)
        for text in texts:
            check_text(text)
        if self._sp is not None:
            return self._sp.encode(texts)
        batch = getattr(self._hf, "encode_batch_fast", None) or self._hf.encode_batch  # _fast skips offsets
        with backend_errors():
            return [e.ids for e in batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens included as text. Bytes that do not form complete UTF-8 characters
        decode to U+FFFD (one per byte for byte-level BPE). Ids outside the vocabulary decode to nothing, on both
        back ends (Hugging Face ``tokenizers`` skips them; SentencePiece would raise): a model's embedding is often
        padded past its tokenizer's vocabulary, and a generation that samples a padding row must not crash.
        Raises :class:`TokenizerFailed` when the back end gives up (a decoder pattern at its retry limit)."""
        n = self.vocab_size
        ids = [i for i in map(int, ids) if 0 <= i < n]
        if self._sp is not None:
            return self._sp.decode(ids)
        with backend_errors("decode these tokens"):
            return self._hf.decode(ids, skip_special_tokens=False)

    @staticmethod
    def _require(i: Optional[int], what: str) -> int:
        if i is None:
            raise ValueError(f"this tokenizer has no {what} token")
        return i

    def __repr__(self) -> str:
        return (f"Tokenizer(backend={self.backend!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}, pad_id={self.pad_id}, stop_ids={self.stop_ids})")


class StreamDecoder:
    """Incremental detokenizer for streaming generation.

    Feed ids one at a time with :meth:`push`; it returns the text that became final with that id (often ``""``).
    The concatenation of all returned strings plus :meth:`flush` equals ``decode(context + ids)[len(decode(context)):]``
    (with no ``context``: ``tokenizer.decode(ids)``).

    A byte-level BPE token may hold only part of a multi-byte UTF-8 character (a CJK character is 3 bytes, an
    emoji 4), which decodes to U+FFFD until the remaining bytes arrive; so text whose decoding ends in U+FFFD is
    held back. Decoding also depends on context (sentencepiece drops the leading space of a window's first piece),
    so the new text is the difference between decoding a short window *with* the new ids and *without* them, the
    scheme of Hugging Face's ``TextStreamer`` and vLLM's incremental detokenizer (its prefix and read offsets). The
    window keeps the last :data:`STREAM_WINDOW` ids before the pending ones, so a piece is never decoded first (a
    lone sentencepiece ``"▁"`` decodes to nothing there, and the space after it was lost), and the work per token
    is O(window), not O(sequence). ``context``: ids decoded before the stream and never returned, e.g. the
    prompt's last tokens, so that a completion's first piece keeps its leading space (``" upon"`` after
    ``"Once"``).
    """

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self._ids: List[int] = [int(i) for i in context]  # the window: shown ids, then pending ones
        self._read = len(self._ids)  # ids[:_read] are shown (context or returned), ids[_read:] pending

    def push(self, token_id: int) -> str:
        """Add one id; return newly completed text (``""`` while a character is still incomplete)."""
        self._ids.append(int(token_id))
        shown = self.tokenizer.decode(self._ids[: self._read])
        full = self.tokenizer.decode(self._ids)
        if len(full) <= len(shown) or full.endswith("\ufffd"):
            return ""
        drop = max(0, len(self._ids) - STREAM_WINDOW)  # the next window's left context: the last few ids
        self._ids, self._read = self._ids[drop:], len(self._ids) - drop
        return full[len(shown):]

    def flush(self) -> str:
        """End the stream: return whatever is still pending (incomplete bytes as U+FFFD). Pushing more after it
        goes on with the same left context."""
        shown = self.tokenizer.decode(self._ids[: self._read])
        full = self.tokenizer.decode(self._ids)
        self._read = len(self._ids)
        return full[len(shown):]


STREAM_WINDOW = 4  # ids a StreamDecoder keeps before the pending ones (vLLM keeps 5 before its read offset)


def _nonneg_or_none(i: int) -> Optional[int]:
    # sentencepiece reports a disabled special token as -1.
    return i if i >= 0 else None
