"""Benchmark evaluation (`minigpt eval`), scored as lm-evaluation-harness scores it: tasks and their data
(:mod:`~minigpt.eval.tasks`), prompts and few-shot sampling (:mod:`~minigpt.eval.prompts`), batched log-likelihoods
with a shared-context KV cache (:mod:`~minigpt.eval.scoring`), metrics (:mod:`~minigpt.eval.metrics`), the run
(:mod:`~minigpt.eval.runner`) and its report (:mod:`~minigpt.eval.report`). :mod:`~minigpt.eval.harness` points
lm-eval's own task YAMLs at the same files; :mod:`~minigpt.eval.lm_eval_model` (imports lm-eval) is ``--model
minigpt`` for lm-eval."""
