"""An lm-evaluation-harness model backed by MiniGPT: ``--model minigpt`` (imports lm-eval; only for its users).

Importing this module registers the class under the name ``minigpt`` (``lm_eval.api.registry.register_model``).
lm-eval's own ``lm_eval`` command does not import third-party modules, so run it through this module::

    python -m minigpt.eval.lm_eval_model run --model minigpt --model_args pretrained=CKPT[,batch_size=16,bos=true] \\
        --tasks arc_easy,hellaswag

``pretrained`` is any model source ``minigpt eval`` accepts (MiniGPT checkpoint or run directory, Hugging Face
directory, GGUF, llama2.c). Scoring is :class:`~minigpt.eval.scoring.Scorer`'s, the semantics those of lm-eval's
``hf`` model (``lm_eval/models/huggingface.py``, 0.4):

* ``loglikelihood``: lm-eval's ``TemplateLM._encode_pair`` tokenization; requests sharing a context are scored as
  one group (its key/value cache computed once);
* ``loglikelihood_rolling``: the text encoded with the tokenizer's defaults (BOS included when it adds one, as
  ``hf`` does), in disjoint windows of the model's context after the prefix token;
* ``generate_until``: greedy (or sampled, with ``do_sample``/``temperature``) decoding of up to ``max_gen_toks``
  tokens after the context left-truncated to ``max_length - max_gen_toks``, cut at the first stop string (the
  ``until`` list plus the EOS text) -- one request at a time.
"""
from __future__ import annotations

import sys
from typing import Optional

from lm_eval.__main__ import cli_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from minigpt.checkpoint.native import load_tokenizer, resolve_checkpoint
from minigpt.checkpoint.tokenizer_bos import adds_bos
from minigpt.eval.scoring import Scorer, rolling_windows
from minigpt.infer.fastpath import load_for_inference
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.runtime import DTYPES, pick_device


def _flag(value) -> Optional[bool]:
    """A ``--model_args`` boolean (lm-eval passes strings such as ``"true"``); None stays None."""
    if value is None or isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("1", "true", "yes")


@register_model("minigpt")
class MiniGPTLM(TemplateLM):
    """``pretrained``: model source; ``device`` (default auto), ``dtype`` (float32 / bfloat16 / float16),
    ``batch_size`` (request rows per forward), ``bos`` (prepend BOS; default: as the tokenizer does), ``fast``
    (the fused fast path, default true), ``max_gen_toks`` (default 256)."""

    def __init__(self, pretrained: str, device: str = "auto", dtype: str = "float32", batch_size=16,
                 bos=None, fast=True, max_gen_toks: int = 256, **kwargs) -> None:
        super().__init__()
        path = resolve_checkpoint(pretrained)
        self.model = load_for_inference(path, device=pick_device(str(device or "auto")), dtype=DTYPES[dtype],
                                        fast=_flag(fast))
        self.tokenizer = load_tokenizer(path)
        bos = _flag(bos)
        self.add_bos = adds_bos(path, self.tokenizer) if bos is None else bos
        batch_size = 16 if batch_size is None or str(batch_size).startswith("auto") else int(batch_size)
        self.scorer = Scorer(self.model, self.tokenizer, add_bos=self.add_bos, batch_size=batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self._name = str(pretrained)

    # ------------------------------------------------------------------------------------ TemplateLM interface
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id if self.tokenizer.eos_id is not None else self.scorer.prefix_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.scorer.prefix_token_id

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    @property
    def tokenizer_name(self) -> str:
        return self._name

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        """Token ids, BOS first when ``add_special_tokens`` (default: when the tokenizer adds it)."""
        return self.scorer.encode(string, bos=self.add_bos if add_special_tokens is None else add_special_tokens)

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode([tokens] if isinstance(tokens, int) else tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``[((context, continuation), context_ids, continuation_ids)]`` -> ``[(loglikelihood, is_greedy)]``;
        requests with the same context ids form one group (their shared prefix is computed once)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (_, context_ids, _) in enumerate(requests):
            groups.setdefault(tuple(context_ids), []).append(i)
        order = list(groups.values())
        scores = self.scorer.loglikelihood_tokens([[(requests[i][1], requests[i][2]) for i in g] for g in order])
        results: list = [None] * len(requests)
        for members, group_scores in zip(order, scores):
            for i, score in zip(members, group_scores):
                results[i] = (score.loglikelihood, score.is_greedy)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, request in enumerate(requests):
            (text,) = request.args
            for window in rolling_windows(self.tok_encode(text), self.prefix_token_id, self.max_length):
                windows.append([window])
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (score,) in zip(owners, self.scorer.loglikelihood_tokens(windows)):
            totals[owner] += score.loglikelihood
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        outputs = []
        eos_text = self.tok_decode(self.eot_token_id)
        stop_ids = [] if self.tokenizer.eos_id is None else [self.tokenizer.eos_id]
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text or None)
            max_gen_toks = kwargs.pop("max_gen_toks")
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            ids = self.tok_encode(context)[-(self.max_length - max_gen_toks):]
            tokens, text = [], ""
            params = SamplingParams(max_tokens=max_gen_toks, temperature=temperature, top_k=kwargs.get("top_k"),
                                    top_p=kwargs.get("top_p"), seed=kwargs.get("seed"))
            for token in generate_tokens(self.model, ids, params, stop_ids=stop_ids):
                tokens.append(token)
                text = self.tok_decode(tokens)
                if any(stop and stop in text for stop in until):
                    break
            outputs.append(postprocess_generated_text(text, until, None))
        return outputs


def main(argv: Optional[list[str]] = None) -> None:
    """lm-eval's command line with the ``minigpt`` model registered (the arguments of ``lm_eval``)."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
