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
