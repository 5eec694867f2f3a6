"""lm-evaluation-harness's `local-completions` model (the OpenAI-compatible client: token ids, `echo: true`,
`logprobs: 1`, `max_tokens: 1`) against a live `minigpt serve` gives the log-likelihoods that minigpt's own
in-process lm-eval model (`minigpt.eval.lm_eval_model.MiniGPTLM`) gives on the same weights and task slices."""
import sys
from pathlib import Path

import pytest
import torch
from serve_helpers import InProcessServer

pytest.importorskip("lm_eval", reason="lm-eval is a test-only dependency (pip install .[dev])")
pytest.importorskip("transformers", reason="lm-eval's local-completions tokenizes with transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from eval_helpers import DATA_DIR, lm_eval_loglikelihoods, random_gqa_model, run_lm_eval  # noqa: E402

TASKS = ["arc_easy", "lambada_openai"]  # 0-shot: every request fits the 256-token context


@pytest.mark.parametrize("batch_size", [1, 4], ids=["one prompt a request", "batches of 4 prompts"])
def test_local_completions_against_the_server_equals_in_process_scores(tmp_path, monkeypatch, batch_size):
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    from minigpt.checkpoint.native import load_model
    from minigpt.eval.harness import LM_EVAL_NAMES, write_task_dir
    from minigpt.eval.lm_eval_model import MiniGPTLM
    from minigpt.infer.engine import Engine
    from minigpt.serve.app import ServerState
    from minigpt.tokenizer.tokenizer import Tokenizer

    torch.set_num_threads(1)
    native, hf_dir = random_gqa_model(tmp_path)
    ours = run_lm_eval(hf_dir, TASKS, 0, tmp_path, monkeypatch, model_cls=MiniGPTLM)
    tok = Tokenizer.from_dir(native)
    srv = InProcessServer(ServerState(Engine(load_model(native), tok, max_batch_size=4), tok, "tiny"))
    try:
        client = LocalCompletionsAPI(base_url=srv.url + "/v1/completions", model="tiny", tokenizer=str(hf_dir),
                                     tokenizer_backend="huggingface", batch_size=batch_size, max_length=256, max_retries=1)
        task_dir = write_task_dir(DATA_DIR, tmp_path / "lm_eval_tasks", cache_dir=tmp_path / "datasets_cache")
        served = lm_eval.simple_evaluate(model=client, tasks=[LM_EVAL_NAMES[t] for t in TASKS],
                                         task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                                         num_fewshot=0, log_samples=True, bootstrap_iters=10)
    finally:
        srv.stop()
    for task in TASKS:
        name = LM_EVAL_NAMES[task]
        assert len(served["samples"][name]) == len(ours["samples"][name]) > 0
        for s, o in zip(served["samples"][name], ours["samples"][name], strict=True):
            assert s["arguments"] == o["arguments"]
            for (a, ga), (b, gb) in zip(lm_eval_loglikelihoods(s), lm_eval_loglikelihoods(o), strict=True):
                assert a == pytest.approx(b, abs=1e-4) and ga == gb
        for key, value in ours["results"][name].items():
            if key.startswith("acc") and "stderr" not in key:
                assert served["results"][name][key] == value, (task, key)
