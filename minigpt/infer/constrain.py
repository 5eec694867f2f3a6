"""Grammar-constrained decoding: a per-request logits processor that lets only the tokens a grammar allows be drawn.

A :class:`GrammarConstraint` holds one grammar matcher (a JSON schema, "any JSON object", or a Lark grammar) for one
request. Before each draw it asks the matcher for the bitmask of allowed next tokens (one bit per vocabulary id) and
sets every other logit to ``-inf``; at the next call it first advances the matcher by the tokens accepted since
(the engine passes the request's generated ids). When the grammar is complete the matcher allows only its end ids
(the engine's stop ids, plus a chat template's end-of-turn token), so the generation ends with ``finish_reason
"stop"`` right after the last character the grammar needs; where the grammar may go on or stop (``{"a": 1}`` can be
followed by whitespace), the model chooses. A ``max_tokens`` that ends the generation earlier leaves the output
cut, as with OpenAI's API (``finish_reason "length"``).

The library: llguidance (Microsoft's guidance project, PyPI ``llguidance``; Moskal et al., "llguidance", the
engine behind OpenAI-style structured outputs in vLLM, SGLang and llama.cpp) rather than xgrammar (Dong et al.
2024, "XGrammar: Flexible and Efficient Structured Generation Engine for Large Language Models"). Why, for this
engine:

* it installs as one self-contained CPU wheel (abi3, no dependencies); xgrammar's wheel pulls ``triton`` and
  ``apache-tvm-ffi`` (and transformers) into a CPU-only environment whose torch is pinned;
* its tokenizer side reads a ``tokenizers`` JSON directly (``LLTokenizer(tokenizer_json)``), which is what our
  :class:`~minigpt.tokenizer.tokenizer.Tokenizer` is (byte-level BPE), and what a SentencePiece model becomes through
  :func:`~minigpt.tokenizer.chat_template.tokenizers_backend` -- one code path for both back ends, with special
  tokens kept apart from text as our encoder does;
* its matcher computes one row's mask on its own (``compute_bitmask``, the GIL released, an Earley parser over a
  lazily built lexer: no grammar precompilation per vocabulary), so each constrained row of a batched decode step is
  masked independently and unconstrained rows pay nothing; a request's grammar compiles in about a millisecond
  (a small JSON schema, 21.7k-token vocabulary; the vocabulary's own table, built once per tokenizer and cached, takes
  0.35 s), so it is done when the request is prepared, off the decode loop;
* it takes JSON schemas (``response_format``), Lark grammars with embedded JSON schemas (``%json {...}``: the
  tool-call formats of :mod:`minigpt.serve.tools`) and regular expressions through one call.

Cost, measured on 2 shared CPU cores (a 4-layer, 256-wide random model, 8 rows decoding 64 tokens each): the mask
takes 68 us per constrained row and token with an 8k vocabulary, 142 us with 21.7k, about 5 % of the decode step's
time when every row is constrained; the tokens/s with and without constraints were within the run-to-run noise of
the loaded machine.

llguidance is an optional dependency (``pip install 'minigpt[structured]'``): without it, :class:`GrammarConstraint`
raises :class:`~minigpt.infer.sampling.InvalidRequest` naming the request field that asked for it.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Optional, Sequence

import numpy as np
import torch

from minigpt.errors import MiniGPTError
from minigpt.infer.sampling import InvalidRequest
from minigpt.tokenizer.chat_template import tokenizers_backend
from minigpt.tokenizer.tokenizer import Tokenizer

INSTALL_HINT = "pip install 'minigpt[structured]' (llguidance)"


def _library(param: str):
    try:
        import llguidance
    except ImportError:
        raise InvalidRequest(f"'{param}' needs grammar-constrained decoding, which this server does not have: "
                             f"{INSTALL_HINT}", param) from None
    return llguidance


def json_grammar(schema: Optional[dict[str, Any]] = None, param: str = "response_format") -> str:
    """The llguidance grammar of JSON text matching ``schema`` (None: any JSON object, OpenAI's ``json_object``
    mode). Whitespace between tokens is allowed as JSON allows it; ``x-guidance`` keys in the schema tune it
    (llguidance's ``docs/json_schema.md``). Raises :class:`InvalidRequest` naming ``param``."""
    llg = _library(param)
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"} if schema is None else schema))
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"'{param}' has a schema that cannot be compiled: {e}", param) from None


def lark_grammar(text: str, param: str = "response_format") -> str:
    """The llguidance grammar of a Lark grammar (llguidance's dialect: ``%json {schema}`` embeds a JSON schema,
    ``<name>`` a special token). Raises :class:`InvalidRequest` naming ``param`` without the library."""
    return _library(param).LLMatcher.grammar_from_lark(text)


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer: Tokenizer, vocab_size: int, end_ids: tuple[int, ...]):
    """llguidance's view of ``tokenizer``: the bytes of every token and which ids end a generation. Built from the
    ``tokenizers`` JSON (a SentencePiece model is converted first); ids from the tokenizer's size up to the model's
    ``vocab_size`` (padding rows of the embedding) are never allowed. Cached: building it walks the vocabulary."""
    import llguidance as llg

    hf = tokenizers_backend(tokenizer)
    return llg.LLTokenizer(hf.to_str(), n_vocab=vocab_size, eos_token=list(end_ids))


class GrammarConstraint:
    """A logits processor that masks one request's logits to the tokens ``grammar`` allows next.

    Args:
        grammar: an llguidance grammar (:func:`json_grammar`, :func:`lark_grammar`).
        tokenizer: the model's tokenizer.
        vocab_size: the model's logits width (at least ``tokenizer.vocab_size``).
        end_ids: the ids that end the generation (the engine's stop ids, a chat template's end-of-turn id); the
            matcher allows them once the grammar is complete, and only them once it cannot grow.
        param: the request field named in errors.

    Call it as ``constraint(generated_ids, logits)`` with the request's ids generated so far and its logits
    ``[vocab_size]`` (or ``[1, vocab_size]``); it returns them with the disallowed entries at ``-inf``.

    Raises :class:`InvalidRequest` (naming ``param``) when the library is missing, the grammar does not compile or
    there is no end id; :class:`MiniGPTError` when the generated ids leave the grammar (ids the mask did not allow).
    """

    def __init__(self, grammar: str, tokenizer: Tokenizer, vocab_size: int, end_ids: Sequence[int],
                 param: str = "response_format") -> None:
        llg = _library(param)
        ends = tuple(sorted({int(i) for i in end_ids}))
        if not ends:
            raise InvalidRequest(f"'{param}' needs an end-of-sequence token to end the output, and this tokenizer "
                                 "has none", param)
        self.vocab_size = vocab_size
        self.end_ids = ends
        ll_tok = _ll_tokenizer(tokenizer, vocab_size, ends)
        error = llg.LLMatcher.validate_grammar(grammar, ll_tok)
        if error:
            raise InvalidRequest(f"'{param}' cannot be compiled into a grammar: {error.splitlines()[0]}", param)
        self._matcher = llg.LLMatcher(ll_tok, grammar, log_level=0)
        self._consumed = 0  # generated ids the matcher has taken

    @property
    def done(self) -> bool:
        """True once the grammar cannot take anything but an end id."""
        return self._matcher.is_stopped()

    def advance(self, generated_ids: Sequence[int]) -> None:
        """Feed the matcher the ids generated since the last call."""
        m = self._matcher
        for token in generated_ids[self._consumed:]:
            if not m.consume_token(int(token)):
                raise MiniGPTError(f"token {token} does not fit the grammar: {m.get_error()}")
        self._consumed = len(generated_ids)

    def allowed(self) -> torch.Tensor:
        """The bool mask ``[vocab_size]`` of the ids allowed next."""
        packed = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        # Bit j of 32-bit word k (little-endian) is id 32 * k + j: byte b of that word holds ids 32k + 8b .. + 7.
        bits = np.unpackbits(packed, bitorder="little")[:self.vocab_size]
        return torch.from_numpy(bits.astype(np.bool_))

    def __call__(self, generated_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        self.advance(generated_ids)
        if self._matcher.is_error():
            raise MiniGPTError(f"the grammar matcher failed: {self._matcher.get_error()}")
        allowed = self.allowed()
        if not allowed.any():  # no way on (validation refuses unsatisfiable schemas; a backstop): end, never draw
            allowed[list(self.end_ids)] = True  # from an all -inf row
        allowed = allowed.to(logits.device)
        if logits.shape[-1] != allowed.shape[0]:
            raise MiniGPTError(f"logits of width {logits.shape[-1]} for a grammar over {allowed.shape[0]} ids")
        return logits.masked_fill(~allowed, float("-inf"))
