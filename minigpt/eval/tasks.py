"""Benchmark tasks: where each one's data lives, how a record becomes a prompt, and which metrics it reports.

Every task follows one lm-evaluation-harness task YAML (cited per task below; paths inside
``EleutherAI/lm-evaluation-harness``, ``lm_eval/tasks/``) and is described in that harness's three views of a
document:

* ``text``: the question / context, or -- for tasks with one context per choice (WinoGrande, "multiple input") --
  the gold index;
* ``choices``: the answer strings of a multiple-choice task (WinoGrande: the sentence up to the blank with each
  option substituted);
* ``target``: the gold index into ``choices``, or the continuation string (LAMBADA's last word, WinoGrande's rest of
  the sentence).

The data is read offline from JSONL files (default ``../shared/data/eval`` beside the repository; field layouts in
``shared/data/README.md``): a malformed record raises :class:`~minigpt.errors.MiniGPTError` naming the file and line.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

from minigpt.errors import MiniGPTError, one_line
from minigpt.tokenizer.tokenizer import InvalidText, check_text

MULTIPLE_CHOICE = "multiple_choice"
LOGLIKELIHOOD = "loglikelihood"
ROLLING = "loglikelihood_rolling"

# The data folder beside a checkout: <repo>/../shared/data/eval.
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "eval"


@dataclass(frozen=True)
class Item:
    """One evaluation (or few-shot) document.

    ``text``: str, or the gold index (int) for multiple-input tasks; ``choices``: tuple of str (None for LAMBADA);
    ``target``: gold index (int) or continuation (str); ``raw``: the JSON record as read (few-shot sampling leaves
    out the evaluated record by comparing these); ``line``: its 1-based line in ``path``.
    """

    text: Union[str, int]
    choices: Optional[tuple[str, ...]]
    target: Union[int, str]
    raw: dict = field(repr=False, compare=False)
    line: int = 0
    path: str = ""


@dataclass(frozen=True)
class Task:
    """A benchmark task: data files, record parser, prompt layout, metrics.

    ``eval_file`` / ``fewshot_file`` are names inside the data directory (``fewshot_file`` None: shots come from the
    evaluated file itself). ``exclude_eval_item``: lm-eval samples ``k + 1`` shots and drops the evaluated record
    (it does so when the few-shot split is the task's test split, ``None == None`` included). ``first_n``: the
    first ``k`` records in file order instead of a seeded sample (lm-eval's ``first_n`` sampler, CMMLU).
    ``subset``: ``(field, value)`` keeping only the records of one subject (CMMLU). ``source``: the lm-eval YAML.
    """

    name: str
    output_type: str
    eval_file: str
    parse: Callable[[dict], tuple]
    source: str
    fewshot_file: Optional[str] = None
    exclude_eval_item: bool = False
    first_n: bool = False
    multiple_input: bool = False
    description: str = ""
    metrics: tuple[str, ...] = ("acc", "acc_norm")
    subset: Optional[tuple[str, str]] = None
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"


def _text(record: dict, key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"field {key!r} must be a string, got {type(value).__name__}")
    return value


def _answer(record: dict, key: str) -> str:
    """A field that is scored as an answer: acc_norm divides its log-likelihood by its length, so it must not be
    empty."""
    value = _text(record, key)
    if not value:
        raise ValueError(f"field {key!r} is empty; an answer needs at least one character")
    return value


def _strings(values, what: str) -> tuple[str, ...]:
    if not isinstance(values, list) or len(values) < 2 or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{what} must be a list of at least 2 strings")
    if not all(values):  # scored as answers (acc_norm divides by their length)
        raise ValueError(f"{what} holds an empty string; every choice needs at least one character")
    return tuple(values)


def _index(label, n: int, what: str) -> int:
    """A gold index given as an int or a string of digits, checked against ``n`` choices."""
    if isinstance(label, str) and label.isdigit():
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < n:
        raise ValueError(f"{what} must be an index in [0, {n}), got {label!r}")
    return label


def parse_arc(record: dict) -> tuple:
    """ARC-Easy / ARC-Challenge, ``lm_eval/tasks/arc/arc_easy.yaml``: ``"Question: {question}\\nAnswer:"``, the
    choice texts, gold ``choices.label.index(answerKey)`` (labels are ``A``-``E`` or ``1``-``5``; 3 to 5 choices)."""
    choices = record["choices"]
    if not isinstance(choices, dict):
        raise ValueError("field 'choices' must be an object with 'text' and 'label' lists")
    texts = _strings(choices["text"], "choices.text")
    labels = _strings(choices["label"], "choices.label")
    if len(labels) != len(texts):
        raise ValueError(f"choices.text has {len(texts)} entries but choices.label {len(labels)}")
    answer = _text(record, "answerKey")
    if answer not in labels:
        raise ValueError(f"answerKey {answer!r} is not one of the labels {list(labels)}")
    return f"Question: {_text(record, 'question')}\nAnswer:", texts, labels.index(answer)


_SENTENCE_END = re.compile(r"(?<=[.!?]) ")


def hellaswag_query(activity_label: str, ctx: str) -> str:
    """HellaSwag's prompt, ``lm_eval/tasks/hellaswag/utils.py``: ``activity_label + ": " + ctx_a + " " +
    ctx_b.capitalize()``, already cleaned of WikiHow's ``[title]``/``[step]`` markers in our copy of the data.

    Our copy keeps only the joined ``ctx`` (``ctx_b`` not capitalised). ``ctx_b`` is the unfinished sentence at the
    end of ``ctx`` (ActivityNet items: "... the lady"; WikiHow items mostly have none), so its capital is restored
    on the fragment after the last sentence end when that fragment starts in lower case.
    """
    last = _SENTENCE_END.split(ctx)[-1]
    if last[:1].islower():
        ctx = ctx[: len(ctx) - len(last)] + last[0].upper() + last[1:]
    return f"{activity_label}: {ctx}"


def parse_hellaswag(record: dict) -> tuple:
    """HellaSwag, ``lm_eval/tasks/hellaswag/hellaswag.yaml`` (+ ``utils.py``): query as :func:`hellaswag_query`,
    the four endings, gold ``label``."""
    endings = _strings(record["endings"], "endings")
    query = hellaswag_query(_text(record, "activity_label"), _text(record, "ctx"))
    return query, endings, _index(record["label"], len(endings), "label")


def parse_piqa(record: dict) -> tuple:
    """PIQA, ``lm_eval/tasks/piqa/piqa.yaml``: ``"Question: {goal}\\nAnswer:"``, choices ``[sol1, sol2]``, gold
    ``label``."""
    choices = (_answer(record, "sol1"), _answer(record, "sol2"))
    return f"Question: {_text(record, 'goal')}\nAnswer:", choices, _index(record["label"], 2, "label")


def parse_winogrande(record: dict) -> tuple:
    """WinoGrande, ``lm_eval/tasks/winogrande/default.yaml`` (+ ``preprocess_winogrande.py``), partial scoring
    (Trinh & Le 2018; Sakaguchi et al. 2019): each option replaces the blank ``_`` and the part of the sentence
    after the blank (stripped) is scored as the continuation of each. ``text`` is the gold index (answer "1"/"2")."""
    sentence = _text(record, "sentence")
    if "_" not in sentence:
        raise ValueError("field 'sentence' has no blank '_'")
    blank = sentence.index("_")
    contexts = (sentence[:blank] + _answer(record, "option1"), sentence[:blank] + _answer(record, "option2"))
    answer = _text(record, "answer")
    if answer not in ("1", "2"):
        raise ValueError(f"answer must be \"1\" or \"2\", got {answer!r}")
    rest = sentence[blank + 1:].strip()
    if not rest:  # nothing to score: every option would get log-likelihood 0 and the first would always win
        raise ValueError("field 'sentence' has nothing after its blank '_' to score")
    return int(answer) - 1, contexts, rest


def parse_lambada(record: dict) -> tuple:
    """LAMBADA (OpenAI's version), ``lm_eval/tasks/lambada/lambada_openai.yaml``: the passage up to its last
    space-separated word is the context, ``" " + last word`` the target (scored: log-likelihood, greedy match)."""
    words = _text(record, "text").split(" ")
    if len(words) < 2 or not words[-1]:
        raise ValueError("field 'text' does not end in a word after a space: there is no last word to predict")
    return " ".join(words[:-1]), None, " " + words[-1]


def parse_cmmlu(record: dict) -> tuple:
    """CMMLU, ``lm_eval/tasks/cmmlu/_default_template_yaml``: the question and the four lettered options, then
    ``答案：``; choices ``A``-``D``, gold ``Answer``."""
    options = [_text(record, letter) for letter in "ABCD"]
    answer = _text(record, "Answer")
    if answer not in ("A", "B", "C", "D"):
        raise ValueError(f"Answer must be one of A, B, C, D, got {answer!r}")
    text = (f"{_text(record, 'Question').strip()}\nA. {options[0]}\nB. {options[1]}\nC. {options[2]}\n"
            f"D. {options[3]}\n答案：")
    return text, ("A", "B", "C", "D"), "ABCD".index(answer)


# CMMLU subjects and the Chinese names lm-eval's per-subject YAMLs use in their description.
CMMLU_SUBJECTS = {
    "agronomy": "农学", "anatomy": "解剖学", "ancient_chinese": "古汉语", "arts": "艺术学", "astronomy": "天文学",
    "business_ethics": "商业伦理", "chinese_civil_service_exam": "中国公务员考试", "chinese_driving_rule": "中国驾驶规则",
    "chinese_food_culture": "中国饮食文化", "chinese_foreign_policy": "中国外交政策", "chinese_history": "中国历史",
    "chinese_literature": "中国文学", "chinese_teacher_qualification": "中国教师资格", "clinical_knowledge": "临床知识",
    "college_actuarial_science": "大学精算学", "college_education": "大学教育学",
    "college_engineering_hydrology": "大学工程水文学", "college_law": "大学法律", "college_mathematics": "大学数学",
    "college_medical_statistics": "大学医学统计", "college_medicine": "大学医学", "computer_science": "计算机科学",
    "computer_security": "计算机安全", "conceptual_physics": "概念物理学", "construction_project_management": "建设工程管理",
    "economics": "经济学", "education": "教育学", "electrical_engineering": "电气工程", "elementary_chinese": "小学语文",
    "elementary_commonsense": "小学常识", "elementary_information_and_technology": "小学信息技术",
    "elementary_mathematics": "初等数学", "ethnology": "民族学", "food_science": "食品科学", "genetics": "遗传学",
    "global_facts": "全球事实", "high_school_biology": "高中生物", "high_school_chemistry": "高中化学",
    "high_school_geography": "高中地理", "high_school_mathematics": "高中数学", "high_school_physics": "高中物理学",
    "high_school_politics": "高中政治", "human_sexuality": "人类性行为", "international_law": "国际法学",
    "journalism": "新闻学", "jurisprudence": "法理学", "legal_and_moral_basis": "法律与道德基础", "logical": "逻辑学",
    "machine_learning": "机器学习", "management": "管理学", "marketing": "市场营销", "marxist_theory": "马克思主义理论",
    "modern_chinese": "现代汉语", "nutrition": "营养学", "philosophy": "哲学", "professional_accounting": "专业会计",
    "professional_law": "专业法学", "professional_medicine": "专业医学", "professional_psychology": "专业心理学",
    "public_relations": "公共关系", "security_study": "安全研究", "sociology": "社会学", "sports_science": "体育学",
    "traditional_chinese_medicine": "中医中药", "virology": "病毒学", "world_history": "世界历史", "world_religions": "世界宗教",
}


def _cmmlu_task(subject: str) -> Task:
    return Task(f"cmmlu_{subject}", MULTIPLE_CHOICE, "cmmlu_test.jsonl", parse_cmmlu,
                f"lm_eval/tasks/cmmlu/cmmlu_{subject}.yaml", fewshot_file="cmmlu_dev.jsonl", first_n=True,
                description=f"以下是关于{CMMLU_SUBJECTS[subject]}的单项选择题，请直接给出正确答案的选项。\n\n",
                subset=("subject", subject))


TASKS: dict[str, Task] = {t.name: t for t in [
    Task("arc_easy", MULTIPLE_CHOICE, "arc_easy_test.jsonl", parse_arc, "lm_eval/tasks/arc/arc_easy.yaml",
         fewshot_file="arc_easy_train.jsonl"),
    Task("arc_challenge", MULTIPLE_CHOICE, "arc_challenge_test.jsonl", parse_arc,
         "lm_eval/tasks/arc/arc_challenge.yaml", fewshot_file="arc_challenge_train.jsonl"),
    # lm-eval draws HellaSwag's and PIQA's shots from their train splits, which shared/data does not hold; without
    # a train split lm-eval falls back to the validation split with the evaluated record left out, as here.
    Task("hellaswag", MULTIPLE_CHOICE, "hellaswag_validation.jsonl", parse_hellaswag,
         "lm_eval/tasks/hellaswag/hellaswag.yaml", exclude_eval_item=True),
    Task("piqa", MULTIPLE_CHOICE, "piqa_validation.jsonl", parse_piqa, "lm_eval/tasks/piqa/piqa.yaml",
         exclude_eval_item=True),
    # Shots from train_xs (160 records; lm-eval uses winogrande_xl's train split, 40k records).
    Task("winogrande", MULTIPLE_CHOICE, "winogrande_dev.jsonl", parse_winogrande,
         "lm_eval/tasks/winogrande/default.yaml", fewshot_file="winogrande_train_xs.jsonl", exclude_eval_item=True,
         multiple_input=True, metrics=("acc",)),
    # LAMBADA has a test split only: lm-eval samples its shots from it without leaving the evaluated passage out.
    Task("lambada_openai", LOGLIKELIHOOD, "lambada_openai_test.jsonl", parse_lambada,
         "lm_eval/tasks/lambada/lambada_openai.yaml", metrics=("perplexity", "acc")),
]} | {f"cmmlu_{s}": _cmmlu_task(s) for s in CMMLU_SUBJECTS}

# Groups: one name for several tasks, reported each and aggregated (mean weighted by size, as lm-eval's
# lm_eval/tasks/cmmlu/_cmmlu.yaml aggregate_metric_list).
GROUPS: dict[str, list[str]] = {"cmmlu": [f"cmmlu_{s}" for s in CMMLU_SUBJECTS]}

BPB_PREFIX = "bpb:"


def bpb_task(path: str) -> Task:
    """``bpb:PATH``: perplexity and bits per byte of one text file, scored as lm-eval scores a document of a
    ``loglikelihood_rolling`` task (e.g. ``lm_eval/tasks/wikitext/wikitext.yaml``)."""
    return Task(f"{BPB_PREFIX}{path}", ROLLING, path, lambda record: (None, None, None), "lm_eval/api/model.py",
                metrics=("word_perplexity", "byte_perplexity", "bits_per_byte", "token_perplexity"))


def resolve_tasks(names: list[str]) -> tuple[list[Task], dict[str, list[str]]]:
    """The tasks ``names`` asks for (groups expanded, duplicates dropped, order kept) and the groups named.

    Raises :class:`MiniGPTError` for an unknown name.
    """
    tasks: dict[str, Task] = {}
    groups: dict[str, list[str]] = {}
    for name in names:
        name = name.strip()
        if not name:
            continue
        if name.startswith(BPB_PREFIX):
            if name == BPB_PREFIX:
                raise MiniGPTError("bpb: needs a file, e.g. --tasks bpb:data/valid.txt")
            tasks.setdefault(name, bpb_task(name[len(BPB_PREFIX):]))
        elif name in GROUPS:
            groups[name] = GROUPS[name]
            for sub in GROUPS[name]:
                tasks.setdefault(sub, TASKS[sub])
        elif name in TASKS:
            tasks.setdefault(name, TASKS[name])
        else:
            known = ", ".join([n for n in TASKS if not n.startswith("cmmlu_")] + list(GROUPS) + ["cmmlu_<subject>"])
            raise MiniGPTError(f"unknown task {name!r}; known tasks: {known}, bpb:PATH")
    if not tasks:
        raise MiniGPTError("no task given (e.g. --tasks arc_easy,hellaswag)")
    return list(tasks.values()), groups


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """``(line number, record)`` for every non-blank line of a JSONL file.

    Raises :class:`MiniGPTError` for a missing file or a line that is not a JSON object.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MiniGPTError(f"{path} does not exist (point --data-dir at the folder holding the benchmark "
                           "JSONL files; see shared/data/README.md)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MiniGPTError(f"cannot read {path}: {one_line(e)}") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise MiniGPTError(f"{path}:{number}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise MiniGPTError(f"{path}:{number}: JSON nested too deeply to read") from None
        except ValueError as e:  # an integer of more digits than Python converts
            raise MiniGPTError(f"{path}:{number}: not usable JSON ({one_line(e)})") from None
        if not isinstance(record, dict):
            raise MiniGPTError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append((number, record))
    return records


def load_items(task: Task, path: Path, cache: Optional[dict] = None) -> list[Item]:
    """The records of ``path`` (a JSONL file of ``task``'s layout) as :class:`Item`\\ s, in file order; only those
    of ``task.subset`` when set. ``cache`` (a dict) keeps parsed files across calls (CMMLU reads one file for 67
    subjects).

    Raises :class:`MiniGPTError` naming the file and line of the first malformed record.
    """
    key = (str(path), task.parse)
    if cache is not None and key in cache:
        items = cache[key]
    else:
        items = []
        for number, record in read_jsonl(path):
            try:
                text, choices, target = task.parse(record)
            except KeyError as e:
                raise MiniGPTError(f"{path}:{number}: missing field {e} for task {task.name}") from None
            except (ValueError, TypeError, AttributeError) as e:
                raise MiniGPTError(f"{path}:{number}: {one_line(e)} (task {task.name})") from None
            # A JSON escape such as \ud800 reads as a lone surrogate, which no tokenizer can encode: caught here,
            # where the file and line are known, rather than when the prompt is encoded.
            for value in (text, target, *(choices or ())):
                if isinstance(value, str):
                    try:
                        check_text(value)
                    except InvalidText as e:
                        raise MiniGPTError(f"{path}:{number}: {one_line(e)} (task {task.name})") from None
            items.append(Item(text, choices, target, record, number, str(path)))
        if cache is not None:
            cache[key] = items
    if task.subset is not None:
        name, value = task.subset
        items = [item for item in items if item.raw.get(name) == value]
    return items
