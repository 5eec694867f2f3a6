"""Task data, prompts, few-shot sampling and metrics, checked against lm-eval's own code where it has one."""
import json

import pytest
from eval_helpers import DATA_DIR

from minigpt.errors import MiniGPTError
from minigpt.eval import metrics
from minigpt.eval.prompts import FewshotSampler, build_requests
from minigpt.eval.tasks import CMMLU_SUBJECTS, GROUPS, TASKS, load_items, resolve_tasks


def items_of(name, data_dir=DATA_DIR):
    task = TASKS[name]
    return task, load_items(task, data_dir / task.eval_file)


# ---------------------------------------------------------------------------------------------------- metrics
def test_acc_norm_divides_by_the_choice_length_in_characters():
    """Choice 0 is likelier in total (-10 > -12) but choice 1 per character (-12/6 = -2 > -10/2 = -5)."""
    values = metrics.multiple_choice_metrics([-10.0, -12.0], ["ab", "abcdef"], gold=1)
    assert values == {"acc": 0.0, "acc_norm": 1.0}
    assert metrics.multiple_choice_metrics([-3.0, -3.0, -1.0], ["a", "b", "c"], gold=2) == {"acc": 1.0,
                                                                                          "acc_norm": 1.0}
    assert metrics.argmax([1.0, 3.0, 3.0]) == 1  # ties: the first, as numpy.argmax


def test_stderrs_match_lm_eval():
    lm_metrics = pytest.importorskip("lm_eval.api.metrics", reason="lm-eval is a test-only dependency")
    values = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert metrics.mean_stderr(values) == pytest.approx(lm_metrics.mean_stderr(values), rel=1e-12)
    assert metrics.mean_stderr([1.0]) is None
    stderrs, sizes = [0.1, 0.2, 0.05], [10, 30, 7]
    assert metrics.pooled_stderr(stderrs, sizes) == pytest.approx(lm_metrics.pooled_sample_stderr(stderrs, sizes))
    lls = [-2.0, -3.5, -1.0]
    assert metrics.perplexity(lls)[0] == pytest.approx(lm_metrics.perplexity(lls))
    assert metrics.rolling_metrics(-20.0, 10, "ab cd")["bits_per_byte"] == pytest.approx(
        lm_metrics.bits_per_byte([(-20.0, 5)]))


# ---------------------------------------------------------------------------------------------------- parsing
def test_records_become_lm_eval_prompts():
    task, items = items_of("arc_easy")
    assert items[0].text.startswith("Question: Which statement best explains") and items[0].text.endswith(
        "\nAnswer:")
    numeric = next(i for i in items if i.raw["choices"]["label"][0] == "1")  # labels 1-4: gold by label index
    assert numeric.target == numeric.raw["choices"]["label"].index(numeric.raw["answerKey"])
    assert sorted({len(i.choices) for i in items}) == [3, 4, 5]
    _, items = items_of("hellaswag")
    assert items[0].text == "Roof shingle removal: A man is sitting on a roof. He"  # ctx_b capitalised
    wikihow = items[4].raw  # no unfinished sentence: unchanged
    assert items[4].text == f"{wikihow['activity_label']}: {wikihow['ctx']}"
    _, items = items_of("winogrande")
    assert items[0].choices == ("Sarah was a much better surgeon than Maria so Sarah",
                                "Sarah was a much better surgeon than Maria so Maria")
    assert (items[0].text, items[0].target) == (1, "always got the easier cases.")
    task, items = items_of("lambada_openai")
    (context, target), = build_requests(task, items[0])
    assert context + target == items[0].raw["text"] and target.startswith(" ") and " " not in target[1:]


def test_fewshot_prompts_equal_lm_eval(tmp_path, monkeypatch):
    """lm-eval's own ConfigurableTask, seeded as its evaluator seeds it, builds the same 2-shot prompts for the
    first items (its sampler's state carries from item to item, so several items are compared in order)."""
    pytest.importorskip("lm_eval", reason="lm-eval is a test-only dependency")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    from minigpt.eval.harness import LM_EVAL_NAMES, write_task_dir

    manager = TaskManager(include_path=str(write_task_dir(DATA_DIR, tmp_path / "tasks", tmp_path / "cache")),
                          include_defaults=False)
    for name in ("arc_easy", "hellaswag", "winogrande", "lambada_openai"):
        lm_task = manager.load(LM_EVAL_NAMES[name])["tasks"][LM_EVAL_NAMES[name]]
        lm_task.set_fewshot_seed(1234)
        task, items = items_of(name)
        sampler = FewshotSampler(task, load_items(task, DATA_DIR / (task.fewshot_file or task.eval_file)))
        for doc, item in zip(list(lm_task.eval_docs)[:3], items):
            theirs = lm_task.fewshot_context(doc, num_fewshot=2)
            ours = [context for context, _ in build_requests(task, item, sampler.sample(2, item))]
            assert (theirs if isinstance(theirs, list) else [theirs]) == sorted(set(ours), key=ours.index), name


def test_fewshot_sampling_is_seeded_and_leaves_the_item_out():
    task, items = items_of("hellaswag")  # shots from the evaluated split itself
    first = [FewshotSampler(task, items).sample(5, items[0]) for _ in range(2)]
    assert first[0] == first[1] and items[0] not in first[0] and len(first[0]) == 5
    with pytest.raises(MiniGPTError, match="more than the 5 few-shot examples of hellaswag"):
        FewshotSampler(task, items).sample(6, items[0])


# ---------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("line, fragment", [
    ('{"question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "C"}',
     "answerKey 'C' is not one of the labels"),
    ('{"question": "q", "answerKey": "A"}', "missing field 'choices'"),
    ('{"question": "q", "choices": {"text": ["a"], "label": ["A"]}, "answerKey": "A"}', "at least 2 strings"),
    ('not json', "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
])
def test_malformed_record_names_file_and_line(tmp_path, line, fragment):
    good = (DATA_DIR / "arc_easy_test.jsonl").read_text(encoding="utf-8").splitlines()[0]
    path = tmp_path / "arc_easy_test.jsonl"
    path.write_text(f"{good}\n\n{line}\n", encoding="utf-8")
    with pytest.raises(MiniGPTError) as e:
        load_items(TASKS["arc_easy"], path)
    message = str(e.value)
    assert f"{path}:3:" in message and fragment in message and "\n" not in message


def test_unknown_task_and_missing_data_are_clear_errors(tmp_path):
    with pytest.raises(MiniGPTError, match="unknown task 'arc_medium'.*arc_easy"):
        resolve_tasks(["arc_medium"])
    with pytest.raises(MiniGPTError, match="does not exist.*--data-dir"):
        load_items(TASKS["piqa"], tmp_path / "piqa_validation.jsonl")
    tasks, groups = resolve_tasks(["cmmlu", "arc_easy", "cmmlu_anatomy"])
    assert len(tasks) == len(CMMLU_SUBJECTS) + 1 and list(groups) == ["cmmlu"]


# ------------------------------------------------------------------------------------------- the shared files
SPLIT_SIZES = {"arc_easy": 2376, "arc_challenge": 1172, "hellaswag": 10042, "piqa": 1838, "winogrande": 1267,
               "lambada_openai": 5153}


def test_every_shared_benchmark_file_parses(shared_data):
    data_dir = shared_data / "eval"
    cache = {}
    for name, size in SPLIT_SIZES.items():
        task = TASKS[name]
        assert len(load_items(task, data_dir / task.eval_file, cache)) == size, name
        if task.fewshot_file:
            assert load_items(task, data_dir / task.fewshot_file, cache), name
    total = 0
    for sub in GROUPS["cmmlu"]:
        task = TASKS[sub]
        total += len(load_items(task, data_dir / task.eval_file, cache))
        assert len(load_items(task, data_dir / task.fewshot_file, cache)) == 5, sub
    assert total == 11582


def test_cmmlu_prompt_equals_lm_eval(shared_data, tmp_path, monkeypatch):
    """lm-eval's CMMLU template (its installed _default_template_yaml: description, first_n shots from dev) on
    one subject of the shared files gives our prompts (the data is copied to tmp_path only, never the repo)."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a test-only dependency")
    import yaml
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    subject = "anatomy"
    for split in ("test", "dev"):
        rows = [line for line in (shared_data / "eval" / f"cmmlu_{split}.jsonl").read_text("utf-8").splitlines()
                if json.loads(line)["subject"] == subject]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(rows[:3] if split == "test" else rows) + "\n", "utf-8")
    template_path = next(p for p in lm_eval.__path__)
    template = yaml.safe_load(open(f"{template_path}/tasks/cmmlu/_default_template_yaml", encoding="utf-8"))
    config = {**template, "task": "cmmlu_local", "dataset_path": "json", "dataset_name": None,
              "dataset_kwargs": {"data_files": {"test": str(tmp_path / "test.jsonl"),
                                                "dev": str(tmp_path / "dev.jsonl")}, "cache_dir": str(tmp_path)},
              "description": f"以下是关于{CMMLU_SUBJECTS[subject]}的单项选择题，请直接给出正确答案的选项。\n\n"}
    lm_task = TaskManager(include_defaults=False).load(config)["tasks"]["cmmlu_local"]
    task = TASKS[f"cmmlu_{subject}"]
    items = load_items(task, shared_data / "eval" / task.eval_file)
    sampler = FewshotSampler(task, load_items(task, shared_data / "eval" / task.fewshot_file))
    for doc, item in zip(lm_task.eval_docs, items):
        requests = build_requests(task, item, sampler.sample(5, item))
        assert lm_task.fewshot_context(doc, num_fewshot=5) == requests[0][0]
        assert [r.args[1] for r in lm_task.construct_requests(doc, requests[0][0], metadata=("x", 0, 1))] == [
            x for _, x in requests]
