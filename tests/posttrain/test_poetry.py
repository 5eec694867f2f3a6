"""Tang-poem instruction sets: the form checker, the title split (no evaluation title in training), the DPO pairs'
forms, the pairs judged from a model's own answers, and the three scripts (build the sets; sample judged pairs; the
base / SFT / DPO form table)."""
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from chat_helpers import chat_tokenizer, tiny_model
from conftest import CLI_ENV

from minigpt.checkpoint.native import save_pretrained
from minigpt.data.poetry import FORMS, build_sets, check_form, dpo_pairs, form_requests, judged_pairs, read_poems
from minigpt.errors import MiniGPTError

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "minigpt" / "data" / "corpora" / "tang_poems.txt"


@pytest.fixture(scope="module")
def poems():
    return read_poems(CORPUS)


@pytest.fixture(scope="module")
def sets(poems):
    return build_sets(poems, seed=0, eval_titles=50)


def test_corpus_forms_and_checker(poems):
    assert len(poems) == 13008
    by_form = {f: [p for p in poems if p.form == f] for f in FORMS}
    assert all(len(v) > 500 for v in by_form.values())
    for form, group in by_form.items():
        for p in group[:50]:
            assert check_form(p.text, form).ok and check_form(f"\n  {p.text}\n", form).ok
            others = [f for f in FORMS if f != form]
            assert not any(check_form(p.text, f).ok for f in others)
    quatrain = by_form["五言絕句"][0]
    verdict = check_form(f"{quatrain.title}\n{quatrain.text}", "五言絕句")  # a title line is extra text
    assert not verdict.clean and not verdict.ok
    verdict = check_form(quatrain.text + "\n這是一首好詩。", "五言絕句")
    assert not verdict.ok and not verdict.verses_ok
    verdict = check_form(quatrain.text.replace("，", "a，", 1), "五言絕句")
    assert not verdict.clean and not verdict.chars_ok and verdict.verses_ok
    one_line = quatrain.text.replace("\n", "")  # four verses on one line: the couplet layout is part of the form
    assert not check_form(one_line, "五言絕句").verses_ok
    empty = check_form("", "七言律詩")
    assert not (empty.ok or empty.verses_ok or empty.chars_ok or empty.clean)
    with pytest.raises(MiniGPTError, match="unknown poem form"):
        check_form(quatrain.text, "詞")


@pytest.mark.slow
def test_split_by_title_keeps_evaluation_titles_out_of_training(poems, sets):
    held = {p["title"] for p in sets["eval_prompts"]}
    assert len(held) == 50 == len(sets["eval_prompts"])
    index = {p.index: p for p in poems}
    train_ids = [r["id"] for r in sets["sft_train"] + sets["dpo_train"]]
    train_titles = {index[int(i.split("-")[1])].title for i in train_ids}
    assert not held & train_titles
    requested = [re.fullmatch(r"寫一首.{4}，題為《(.+)》。", m["content"]) for r in sets["sft_train"]
                 for m in r["messages"][:1]] + [re.fullmatch(r"寫一首.{4}，題為《(.+)》。", r["prompt"][0]["content"])
                                                for r in sets["dpo_train"]]
    assert len([m for m in requested if m]) > 7000 and not held & {m.group(1) for m in requested if m}
    val_titles = {index[int(r["id"].split("-")[1])].title for r in sets["sft_val"] + sets["dpo_val"]}
    assert val_titles <= held
    assert build_sets(poems, seed=0, eval_titles=50) == sets  # seeded: the same files every time
    assert build_sets(poems, seed=1, eval_titles=50)["eval_prompts"] != sets["eval_prompts"]


@pytest.mark.slow
def test_dpo_pairs_prefer_the_requested_form(sets):
    tasks = {r["id"].rsplit("-", 1)[1] for r in sets["sft_train"]}
    assert tasks == {"form", "continue", "author"}
    for pair in sets["dpo_train"][:300] + sets["dpo_val"]:
        form = next(f for f in FORMS if f in pair["prompt"][0]["content"])
        assert check_form(pair["chosen"], form).ok and not check_form(pair["rejected"], form).ok
    for p in sets["eval_prompts"]:
        assert check_form(p["reference"], p["form"]).ok


def test_judged_pairs_prefer_the_models_right_answer_to_its_wrong_one(poems):
    formed = [p for form in FORMS for p in [p for p in poems if p.form == form][:10]]
    requests = form_requests(dpo_pairs(formed, random.Random(0)))
    assert [r["form"] for r in requests] == [p.form for p in formed]
    assert [r["reference"] for r in requests] == [p.text for p in formed]
    other = {r["form"]: r["reference"] for r in requests}
    r0, r1, r2 = requests[:3]
    wrong = [r0["reference"].replace("\n", ""), next(t for f, t in other.items() if f != r0["form"])]
    samples = [
        [wrong[0], r0["reference"], wrong[1]],  # right and wrong answers: a pair of the model's own
        [wrong[0], wrong[1]],                   # only wrong answers: the corpus poem is chosen
        [r2["reference"], r2["reference"]],     # only right answers: no pair
    ]
    pairs, counts = judged_pairs([r0, r1, r2], samples, random.Random(0))
    assert counts == {"rows": 3, "answers": 7, "answers_ok": 3, "pairs": 2, "reference_chosen": 1, "all_ok": 1}
    assert [p["id"] for p in pairs] == [f"{r0['id']}-judged", f"{r1['id']}-judged"]
    assert pairs[0]["chosen"] == r0["reference"] and pairs[0]["rejected"] in wrong
    assert pairs[1]["chosen"] == r1["reference"] and pairs[1]["rejected"] in wrong
    for pair, request in zip(pairs, (r0, r1)):
        assert pair["prompt"] == request["prompt"]
        assert check_form(pair["chosen"], request["form"]).ok and not check_form(pair["rejected"], request["form"]).ok
    with pytest.raises(MiniGPTError, match="2 lists of answers"):
        judged_pairs([r0, r1, r2], samples[:2], random.Random(0))
    with pytest.raises(MiniGPTError, match="no regular form"):
        form_requests([{"id": "x", "prompt": r0["prompt"], "chosen": "not a poem"}])
    for bad in ([1, 2], {"prompt": r0["prompt"]}, {"chosen": r0["reference"]}, {"prompt": "x", "chosen": 3}):
        with pytest.raises(MiniGPTError, match="not a form request pair"):
            form_requests([bad])


def run_script(name, *args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *map(str, args)], capture_output=True,
                          text=True, env=CLI_ENV, timeout=300)


@pytest.mark.slow
def test_poetry_scripts_run(tmp_path):
    out = tmp_path / "poetry"
    proc = run_script("build_poetry_sets.py", "--out-dir", out, "--eval-titles", 20, "--seed", 3)
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in out.iterdir()} == {f"{n}.jsonl" for n in ("sft_train", "sft_val", "dpo_train", "dpo_val",
                                                                       "eval_prompts")}
    tok = chat_tokenizer()
    save_pretrained(tiny_model(tok.vocab_size), tmp_path / "model", tok)
    proc = run_script("poetry_form_table.py", "--prompts", out / "eval_prompts.jsonl", "--limit", 2,
                      "--max-new-tokens", 4, tmp_path / "model", "--answers", tmp_path / "answers.jsonl")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("| model | prompts | form right") and lines[2].endswith("| 2 | 0% | 0% | 0% | 0% |")
    assert len((tmp_path / "answers.jsonl").read_text().splitlines()) == 2
    proc = run_script("sample_poetry_pairs.py", tmp_path / "model", "--pairs", out / "dpo_train.jsonl", "--out",
                      tmp_path / "judged.jsonl", "--limit", 3, "--samples", 2, "--max-new-tokens", 4)
    assert proc.returncode == 0, proc.stderr
    assert "3 requests x 2 answers: 0.0% in form; 3 pairs (3 with the corpus poem as chosen)" in proc.stdout
    built = [json.loads(line) for line in (out / "dpo_train.jsonl").read_text().splitlines()[:3]]
    judged = [json.loads(line) for line in (tmp_path / "judged.jsonl").read_text().splitlines()]
    assert [(j["prompt"], j["chosen"]) for j in judged] == [(b["prompt"], b["chosen"]) for b in built]
    proc = run_script("sample_poetry_pairs.py", tmp_path / "model", "--pairs", tmp_path / "missing.jsonl", "--out",
                      tmp_path / "x.jsonl")
    assert proc.returncode == 1 and "does not exist; run scripts/build_poetry_sets.py" in proc.stderr
