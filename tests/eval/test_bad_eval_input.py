"""Malformed benchmark files: each is one error naming the file and line, never a traceback nor a score computed
from an item with nothing to score (an empty choice, WinoGrande's blank at the sentence's end, a LAMBADA passage
without a last word)."""
import json
import re

import pytest
from conftest import assert_one_line_error, run_cli
from eval_helpers import DATA_DIR, random_gqa_model

from minigpt.errors import MiniGPTError
from minigpt.eval.tasks import TASKS, load_items

PIQA = {"goal": "g", "sol1": "a", "sol2": "b", "label": 0}
WINOGRANDE = {"sentence": "Sarah beat Maria so _ won.", "option1": "Sarah", "option2": "Maria", "answer": "1"}
HELLASWAG = {"activity_label": "a", "ctx": "c", "endings": ["x", "y"], "label": 0}


def write(path, *lines: str):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.mark.parametrize("task, line, fragment", [
    ("piqa", json.dumps({**PIQA, "sol1": ""}), "field 'sol1' is empty"),
    ("hellaswag", json.dumps({**HELLASWAG, "endings": ["x", ""]}), "endings holds an empty string"),
    ("arc_easy", json.dumps({"question": "q", "choices": {"text": ["", "b"], "label": ["A", "B"]},
                             "answerKey": "A"}), "choices.text holds an empty string"),
    ("winogrande", json.dumps({**WINOGRANDE, "option2": ""}), "field 'option2' is empty"),
    ("winogrande", json.dumps({**WINOGRANDE, "sentence": "Sarah beat Maria so _"}), "nothing after its blank"),
    ("lambada_openai", json.dumps({"text": "the cat sat on the "}), "no last word to predict"),
    # A JSON escape of a lone surrogate: no tokenizer can encode it.
    ("piqa", json.dumps(PIQA).replace('"g"', '"g\\ud800"'), "lone surrogate U+D800"),
    ("piqa", "[" * 100000 + "]" * 100000, "nested too deeply"),
    ("piqa", json.dumps(PIQA).replace('"label": 0', '"label": ' + "9" * 5000), "not usable JSON"),
])
def test_a_malformed_record_names_its_file_and_line(tmp_path, task, line, fragment):
    path = write(tmp_path / TASKS[task].eval_file, json.dumps(PIQA) if task == "piqa" else "", line)
    with pytest.raises(MiniGPTError, match=re.escape(fragment)) as e:
        load_items(TASKS[task], path)
    assert str(e.value).startswith(f"{path}:2: ")


def test_real_records_still_load():
    for name in ("arc_easy", "hellaswag", "piqa", "winogrande", "lambada_openai"):
        assert load_items(TASKS[name], DATA_DIR / TASKS[name].eval_file)


def test_an_empty_choice_is_one_error_line_not_a_zero_division(tmp_path):
    """`minigpt eval` used to end in a ZeroDivisionError traceback (acc_norm divides by the choice's length)."""
    model, _ = random_gqa_model(tmp_path / "model", max_seq_len=64)
    data = tmp_path / "data"
    data.mkdir()
    path = write(data / "piqa_validation.jsonl", json.dumps({**PIQA, "sol2": ""}))
    proc = run_cli("eval", model, "--tasks", "piqa", "--data-dir", data)
    assert_one_line_error(proc, f"{path}:1:", "field 'sol2' is empty")


@pytest.mark.parametrize("reference", ["[1]", '{"results": 5}', '{"results": {"piqa": 5}}', "null"])
def test_a_reference_of_the_wrong_shape_is_refused_before_the_evaluation(tmp_path, reference):
    """Valid JSON that is not a results file used to end the evaluation (hours, maybe) in an AttributeError
    traceback when the report read it. Here the model does not even exist: the --reference error must come
    first."""
    path = tmp_path / "reference.json"
    path.write_text(reference, encoding="utf-8")
    proc = run_cli("eval", tmp_path / "no_model", "--tasks", "piqa", "--report", tmp_path / "report",
                   "--reference", path)
    assert_one_line_error(proc, f"--reference {path} is not a results JSON")
