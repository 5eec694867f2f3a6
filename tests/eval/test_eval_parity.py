"""`minigpt eval` against lm-evaluation-harness's `hf` model on the same weights, prompts and items.

lm-eval runs our task YAMLs (minigpt/eval/lm_eval_tasks) over the test slices; we run the same tasks in-process.
Both must build the same prompts (few-shot included), give every request the same log-likelihood (within 1e-4
nats: float32 sums over up to ~40 tokens, and our fused fast path rounds differently from transformers' Llama) and
the same greedy flags, and so the same accuracies.
"""
import math

import pytest
from eval_helpers import (
    DATA_DIR,
    PARITY_TASKS,
    lm_eval_loglikelihoods,
    random_gqa_model,
    run_lm_eval,
    stories_export,
)

from minigpt.eval.harness import LM_EVAL_NAMES
from minigpt.eval.runner import evaluate_source

pytest.importorskip("lm_eval", reason="lm-eval is a test-only dependency (pip install .[dev])")
pytest.importorskip("transformers", reason="transformers is a test-only dependency (pip install .[dev])")

TOLERANCE = 1e-4  # nats per request


def assert_same_as_lm_eval(ours: dict, theirs: dict, tasks: list[str]) -> None:
    for task in tasks:
        name = LM_EVAL_NAMES[task]
        their_samples, our_samples = theirs["samples"][name], ours["samples"][task]
        assert len(their_samples) == len(our_samples) > 0, task
        for t, o in zip(their_samples, our_samples):
            assert [list(a[:2]) for a in t["arguments"]] == o["arguments"], (task, t["doc_id"])
            their_lls = lm_eval_loglikelihoods(t)
            assert [g for _, g in their_lls] == o["is_greedy"], (task, t["doc_id"])
            for (ll, _), mine in zip(their_lls, o["loglikelihoods"]):
                assert abs(ll - mine) <= TOLERANCE, (task, t["doc_id"], ll, mine)
            for metric in ("acc", "acc_norm"):
                if metric in t:
                    assert t[metric] == o[metric], (task, t["doc_id"], metric)
        their_results, our_results = theirs["results"][name], ours["results"][task]
        for key, value in our_results.items():
            if key == "alias":
                continue
            if key.startswith("perplexity"):  # lm-eval bootstraps the perplexity's stderr; we use the delta method
                if key == "perplexity,none":
                    assert math.isclose(value, their_results[key], rel_tol=1e-4), task
                continue
            assert value == pytest.approx(their_results[key], abs=1e-12), (task, key)


def test_random_gqa_model_matches_lm_eval_few_shot(tmp_path, monkeypatch):
    """3-shot (shots drawn with lm-eval's seed; HellaSwag/PIQA/WinoGrande leave the evaluated item out, LAMBADA's
    double space), contexts longer than the 256-token window (left truncation), no BOS (our export's tokenizer)."""
    native, hf_dir = random_gqa_model(tmp_path)
    theirs = run_lm_eval(hf_dir, PARITY_TASKS, 3, tmp_path, monkeypatch)
    for source in (hf_dir, native):
        ours = evaluate_source(source, PARITY_TASKS, device="cpu", num_fewshot=3, data_dir=DATA_DIR, batch_size=4,
                               samples=True)
        assert ours["config"]["bos"] is False
        assert_same_as_lm_eval(ours, theirs, PARITY_TASKS)
    plain = evaluate_source(hf_dir, PARITY_TASKS, device="cpu", fast=False, num_fewshot=3, data_dir=DATA_DIR,
                            samples=True)
    assert_same_as_lm_eval(plain, theirs, PARITY_TASKS)


@pytest.mark.parametrize("bos", [True, False], ids=["bos", "no-bos"])
def test_stories260k_matches_lm_eval(shared_data, tmp_path, monkeypatch, bos):
    """Karpathy's trained stories260K (SentencePiece, GQA 8/4 heads), zero-shot, with and without a tokenizer that
    prepends BOS: we follow the tokenizer's default, as lm-eval does through transformers."""
    hf_dir = stories_export(shared_data, tmp_path / "hf", bos)
    theirs = run_lm_eval(hf_dir, PARITY_TASKS, 0, tmp_path, monkeypatch)
    ours = evaluate_source(hf_dir, PARITY_TASKS, device="cpu", data_dir=DATA_DIR, samples=True)
    assert ours["config"]["bos"] is bos
    assert_same_as_lm_eval(ours, theirs, PARITY_TASKS)


def test_single_requests_and_rolling_match_lm_eval(tmp_path, monkeypatch):
    """Requests lm-eval handles specially (an empty context: the prefix token stands for it; whitespace at the end
    of a context moves into the continuation) and rolling log-likelihood over several windows (bpb:PATH)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from minigpt.checkpoint.native import load_tokenizer
    from minigpt.eval.scoring import Scorer
    from minigpt.infer.fastpath import load_for_inference

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, hf_dir = random_gqa_model(tmp_path, max_seq_len=64)
    lm = HFLM(pretrained=str(hf_dir), batch_size=2, device="cpu")
    scorer = Scorer(load_for_inference(hf_dir), load_tokenizer(hf_dir), batch_size=3)
    pairs = [("", " The sun rises."), ("Question: why?\nAnswer: ", "because"), ("A  b\n\n", "c d"),
             ("one two three", " four"), (" ".join(["word"] * 80), " end")]  # the last one: left-truncated
    theirs = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    ours = [score for (score,) in scorer.loglikelihood([[pair] for pair in pairs])]
    for (ll, greedy), score in zip(theirs, ours):
        assert abs(ll - score.loglikelihood) <= TOLERANCE and greedy == score.is_greedy
    texts = [(DATA_DIR / "lambada_openai_test.jsonl").read_text(encoding="utf-8")[:1500], "short text"]
    theirs = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)])
    ours = scorer.loglikelihood_rolling(texts)
    assert ours[0].n_tokens > 3 * 64  # several windows
    for ll, score in zip(theirs, ours):
        assert abs(ll - score.loglikelihood) <= 10 * TOLERANCE  # hundreds of tokens summed in float32 by lm-eval
