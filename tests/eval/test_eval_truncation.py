"""Items longer than the model's context window: scored left-truncated as lm-evaluation-harness does, counted and
reported, never stopping the run."""
import json

import pytest
import torch
from eval_helpers import random_gqa_model

from minigpt.checkpoint.native import load_tokenizer
from minigpt.eval.prompts import build_requests
from minigpt.eval.runner import evaluate_source
from minigpt.eval.scoring import Scorer
from minigpt.eval.tasks import TASKS, load_items
from minigpt.infer.fastpath import load_for_inference

CONTEXT = 64  # tokens: the model's window

SHORT = {"goal": "How do I open a jar?", "sol1": "Twist the lid.", "sol2": "Kick the lid.", "label": 0}
LONG_GOAL = {"goal": " ".join(["How do I keep the garden watered while I am away on a long holiday"] * 6),
             "sol1": "Set up a drip line.", "sol2": "Paint the hose.", "label": 0}
LONG_SOLUTION = {"goal": "How do I bake bread?",
                 "sol1": " ".join(["Mix flour, water, salt and yeast, knead the dough, let it rise"] * 8),
                 "sol2": "Freeze the flour.", "label": 0}


@pytest.fixture(scope="module")
def tiny_context(tmp_path_factory):
    """``(HF export of a random GQA model with a 64-token window, data dir holding a 3-item PIQA slice)``."""
    root = tmp_path_factory.mktemp("truncation")
    _, hf_dir = random_gqa_model(root, max_seq_len=CONTEXT)
    data = root / "data"
    data.mkdir()
    lines = [json.dumps(item) for item in (SHORT, LONG_GOAL, LONG_SOLUTION)]
    (data / "piqa_validation.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return hf_dir, data


def test_over_long_items_are_counted_not_fatal(tiny_context):
    hf_dir, data = tiny_context
    notes = []
    out = evaluate_source(hf_dir, ["piqa"], device="cpu", data_dir=data, samples=True, log=notes.append)
    assert out["n-samples"]["piqa"]["effective"] == 3
    assert out["truncated"]["piqa"] == {"items": 2, "continuation_too_long": 1}
    assert [s["truncated"] for s in out["samples"]["piqa"]] == [False, True, True]
    note = [line for line in notes if "context" in line]
    assert len(note) == 1 and "2 item(s)" in note[0] and "in 1 a choice alone" in note[0]
    assert 0.0 <= out["results"]["piqa"]["acc,none"] <= 1.0


def test_truncation_matches_lm_eval_and_scores_what_fits(tiny_context, monkeypatch):
    """An item whose context + continuation overflow: the same log-likelihoods as lm-eval's ``hf`` model (which
    left-truncates). A continuation longer than the window by itself: lm-eval stops with an AssertionError; we score
    its last ``CONTEXT`` tokens, what a forward pass of the window ``transformers`` runs gives."""
    pytest.importorskip("lm_eval", reason="lm-eval is a test-only dependency (pip install .[dev])")
    transformers = pytest.importorskip("transformers", reason="a test-only dependency (pip install .[dev])")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf_dir, data = tiny_context
    task = TASKS["piqa"]
    items = load_items(task, data / "piqa_validation.jsonl", {})
    requests = [build_requests(task, item, []) for item in items]
    scorer = Scorer(load_for_inference(hf_dir), load_tokenizer(hf_dir), batch_size=4)
    ours = scorer.loglikelihood(requests)
    assert [[s.truncated for s in item] for item in ours] == [[False, False], [True, True], [True, False]]
    assert [s.continuation_truncated for s in ours[2]] == [True, False]

    lm = HFLM(pretrained=str(hf_dir), batch_size=2, device="cpu")
    assert lm.max_length == CONTEXT
    fitting = [pair for item in requests[:2] for pair in item]
    theirs = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(fitting)])
    for (ll, greedy), score in zip(theirs, [s for item in ours[:2] for s in item]):
        assert abs(ll - score.loglikelihood) <= 1e-4 and greedy == score.is_greedy
    with pytest.raises(AssertionError):
        lm.loglikelihood([Instance("loglikelihood", {}, requests[2][0], 0)])

    context_ids, cont_ids = scorer.encode_pair(*requests[2][0])
    assert len(cont_ids) > CONTEXT
    window = (context_ids + cont_ids)[-(CONTEXT + 1):]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([window[:-1]])).logits[0].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(window[1:])[:, None]).sum().item()
    assert ours[2][0].n_tokens == CONTEXT
    assert ours[2][0].loglikelihood == pytest.approx(expected, abs=1e-4)
