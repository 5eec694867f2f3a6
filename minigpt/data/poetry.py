"""Tang poems as instruction data: the corpus parser, the regular forms, a form checker, and seeded SFT / DPO sets.

Corpus layout (``minigpt/data/corpora/tang_poems.txt``, 全唐詩 from chinese-poetry, traditional characters): one
poem per paragraph, a title line, an author line, then one line per couplet (``秦川雄帝宅，函谷壯皇居。``), a blank
line between poems.

Forms (:data:`FORMS`): 五言絕句 / 七言絕句 are 4 verses (句) of 5 / 7 characters, 五言律詩 / 七言律詩 8 verses; a
verse is the text between two punctuation marks. A poem has a form only when it is written in ideographs and the
punctuation of :data:`PUNCT` alone, one couplet (two verses) per line, and every verse has the same length.

:func:`check_form` judges a model's answer against a requested form: the number of verses and couplet lines, the
characters per verse, and no extra text (a title, the author, explanations, Latin letters, template tokens).

:func:`build_sets` makes, from a seeded split **by title** (every poem whose title is held out goes to the
evaluation side, so no evaluation title, nor any same-titled poem, is seen in training):

* SFT conversations: ``寫一首{form}，題為《{title}》。`` -> the poem; ``續寫這首詩：{first couplet}`` -> the rest;
  ``《{title}》（首句「{first verse}」）的作者是誰？`` -> the author;
* DPO pairs: the same form request, chosen = the poem, rejected = a poem of another form from the same side;
* evaluation prompts: one form request per held-out title, with the reference poem.

:func:`judged_pairs` makes DPO pairs from a model's own answers instead (on-policy), judged by :func:`check_form`:
its right answer is chosen and its wrong one rejected, so the pairs hold the mistakes that model makes.

The instructions are written in traditional characters, like the corpus, so a model pretrained on it knows them.
"""
from __future__ import annotations

import random
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from minigpt.errors import MiniGPTError

PUNCT = "，。？！；、："
FORMS = {"五言絕句": (4, 5), "七言絕句": (4, 7), "五言律詩": (8, 5), "七言律詩": (8, 7)}  # name -> (verses, chars)
_SPLIT = re.compile(f"[{PUNCT}]")


@dataclass
class Poem:
    title: str
    author: str
    lines: list[str]
    index: int = 0  # position in the corpus

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    @property
    def form(self) -> Optional[str]:
        """The :data:`FORMS` name this poem has, or None (see the module docstring)."""
        if not all(_clean(line) and len(_verses(line)) == 2 for line in self.lines):
            return None
        lengths = {len(v) for v in _verses(self.text)}
        for name, (n, chars) in FORMS.items():
            if 2 * len(self.lines) == n and lengths == {chars}:
                return name
        return None


def _is_ideograph(ch: str) -> bool:
    return unicodedata.name(ch, "").startswith("CJK") and ch not in PUNCT


def _clean(line: str) -> bool:
    """Only ideographs and :data:`PUNCT`, ending with a punctuation mark."""
    return bool(line) and line[-1] in PUNCT and all(_is_ideograph(c) or c in PUNCT for c in line)


def _verses(text: str) -> list[str]:
    return [v for v in _SPLIT.split(text.replace("\n", "")) if v]


def read_poems(path: str | Path) -> list[Poem]:
    """The poems of a corpus file (title, author, body lines per paragraph); paragraphs without a body are
    skipped. Raises :class:`MiniGPTError` for a missing file."""
    path = Path(path)
    if not path.is_file():
        raise MiniGPTError(f"poem corpus {path} does not exist")
    poems = []
    for i, block in enumerate(path.read_text(encoding="utf-8").strip().split("\n\n")):
        lines = [line.strip() for line in block.strip().split("\n") if line.strip()]
        if len(lines) >= 3:
            poems.append(Poem(lines[0], lines[1], lines[2:], i))
    return poems


# ------------------------------------------------------------------------------------------------ the checker
@dataclass
class FormCheck:
    """:func:`check_form`'s verdict: ``verses_ok`` (verse and couplet-line counts), ``chars_ok`` (every verse
    has the form's length), ``clean`` (nothing but the poem); ``ok`` when all three hold."""

    form: str
    verses_ok: bool
    chars_ok: bool
    clean: bool
    verse_lengths: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.verses_ok and self.chars_ok and self.clean


def check_form(answer: str, form: str) -> FormCheck:
    """Judge ``answer`` (a model's reply) as a poem of ``form`` (a :data:`FORMS` name): the expected number of
    verses, written one couplet per line, each verse of the form's length, and no other text. Leading and
    trailing whitespace is ignored. Raises :class:`MiniGPTError` for an unknown form."""
    if form not in FORMS:
        raise MiniGPTError(f"unknown poem form {form!r}; choose one of {', '.join(FORMS)}")
    n, chars = FORMS[form]
    lines = [line.strip() for line in answer.strip().split("\n")]
    clean = all(_clean(line) for line in lines)
    verses = _verses("".join(lines))
    verses_ok = len(verses) == n and len(lines) == n // 2 and all(len(_verses(line)) == 2 for line in lines)
    lengths = [len(v) for v in verses]
    return FormCheck(form, verses_ok, bool(lengths) and all(x == chars for x in lengths), clean, lengths)


# ------------------------------------------------------------------------------------------------ the sets
def form_request(form: str, title: str) -> str:
    return f"寫一首{form}，題為《{title}》。"


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def sft_examples(poems: list[Poem]) -> list[dict[str, Any]]:
    """The three SFT tasks (module docstring) for ``poems``, as ``{"id", "messages"}`` records."""
    out = []
    for p in poems:
        if p.form:
            out.append({"id": f"poem-{p.index}-form", "messages": _user(form_request(p.form, p.title)) + [
                {"role": "assistant", "content": p.text}]})
        if len(p.lines) >= 2 and all(_clean(line) for line in p.lines):
            out.append({"id": f"poem-{p.index}-continue", "messages": _user(f"續寫這首詩：{p.lines[0]}") + [
                {"role": "assistant", "content": "\n".join(p.lines[1:])}]})
            out.append({"id": f"poem-{p.index}-author",
                        "messages": _user(f"《{p.title}》（首句「{_verses(p.lines[0])[0]}」）的作者是誰？") + [
                            {"role": "assistant", "content": p.author}]})
    return out


def dpo_pairs(poems: list[Poem], rng: random.Random) -> list[dict[str, Any]]:
    """One pair per poem with a form: the form request, chosen = the poem, rejected = a random poem of ``poems``
    with a different form (``{"id", "prompt", "chosen", "rejected"}``, the layout of ``shared/data/dpo``)."""
    by_form: dict[str, list[Poem]] = {}
    for p in poems:
        if p.form:
            by_form.setdefault(p.form, []).append(p)
    out = []
    for p in poems:
        others = [f for f in by_form if f != p.form]
        if not p.form or not others:
            continue
        rejected = rng.choice(by_form[rng.choice(others)])
        out.append({"id": f"poem-{p.index}-form-pair", "prompt": _user(form_request(p.form, p.title)),
                    "chosen": p.text, "rejected": rejected.text})
    return out


def build_sets(poems: list[Poem], seed: int = 0, eval_titles: int = 200) -> dict[str, list[dict[str, Any]]]:
    """Split ``poems`` by title (``eval_titles`` titles with a formed poem, drawn with ``random.Random(seed)``,
    go to evaluation with every poem of the same title) and build ``sft_train``, ``sft_val``, ``dpo_train``,
    ``dpo_val`` and ``eval_prompts`` (one form request per held-out title: ``{"id", "messages", "form", "title",
    "reference"}``). Deterministic for a given corpus and seed."""
    rng = random.Random(seed)
    formed_titles = sorted({p.title for p in poems if p.form})
    if len(formed_titles) <= eval_titles:
        raise MiniGPTError(f"only {len(formed_titles)} titles have a poem of a regular form; ask for fewer than "
                           f"{eval_titles} evaluation titles")
    held_out = set(rng.sample(formed_titles, eval_titles))
    train = [p for p in poems if p.title not in held_out]
    held = [p for p in poems if p.title in held_out]
    prompts, seen = [], set()
    for p in held:
        if p.form and p.title not in seen:
            seen.add(p.title)
            prompts.append({"id": f"poem-{p.index}-eval", "messages": _user(form_request(p.form, p.title)),
                            "form": p.form, "title": p.title, "reference": p.text})
    sets = {"sft_train": sft_examples(train), "sft_val": sft_examples(held), "dpo_train": dpo_pairs(train, rng),
            "dpo_val": dpo_pairs(held, rng), "eval_prompts": prompts}
    for name in ("sft_train", "dpo_train"):
        rng.shuffle(sets[name])
    return sets


def judged_pairs(rows: list[dict[str, Any]], samples: list[list[str]],
                 rng: random.Random) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """DPO pairs from a model's own answers (on-policy), judged by :func:`check_form`.

    ``rows[i]`` is a form request ``{"id", "prompt", "form", "reference"}`` (``reference``: a poem of that form),
    ``samples[i]`` the answers the model sampled for it. Per row: chosen = one of the answers that pass, else the
    reference poem; rejected = one of the answers that fail; no pair when every answer passes (nothing to prefer).
    Returns the pairs (``{"id", "prompt", "chosen", "rejected"}``) and counts: ``rows``, ``answers``,
    ``answers_ok``, ``pairs``, ``reference_chosen``, ``all_ok``. Raises :class:`MiniGPTError` when the two lists
    differ in length or a row's form is unknown.

    Chosen and rejected answers both come from the policy being tuned, as in on-policy / "online" DPO (Guo et al.
    2024, "Direct Language Model Alignment from Online AI Feedback"), with a rule in place of the AI judge.
    """
    if len(rows) != len(samples):
        raise MiniGPTError(f"{len(rows)} requests but {len(samples)} lists of answers")
    counts = dict.fromkeys(("rows", "answers", "answers_ok", "pairs", "reference_chosen", "all_ok"), 0)
    pairs = []
    for row, answers in zip(rows, samples):
        verdicts = [check_form(a, row["form"]).ok for a in answers]
        good = [a for a, ok in zip(answers, verdicts) if ok]
        bad = [a for a, ok in zip(answers, verdicts) if not ok]
        counts["rows"] += 1
        counts["answers"] += len(answers)
        counts["answers_ok"] += len(good)
        if not bad:
            counts["all_ok"] += 1
            continue
        chosen = rng.choice(good) if good else row["reference"]
        counts["reference_chosen"] += not good
        counts["pairs"] += 1
        pairs.append({"id": f"{row['id']}-judged", "prompt": row["prompt"], "chosen": chosen,
                      "rejected": rng.choice(bad)})
    return pairs, counts


def form_requests(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The form requests of :func:`dpo_pairs`' rows, as :func:`judged_pairs` reads them: ``{"id", "prompt",
    "form", "reference"}``, the form being the chosen poem's. Raises :class:`MiniGPTError` for a row whose chosen
    poem has no regular form, or that is not an object with a string ``chosen`` and a ``prompt``."""
    out = []
    for row in pairs:
        if not isinstance(row, dict) or not isinstance(row.get("chosen"), str) or "prompt" not in row:
            raise MiniGPTError(f"{str(row)[:80]!r} is not a form request pair with a prompt and a chosen poem")
        form = Poem("", "", row["chosen"].split("\n")).form
        if form is None:
            raise MiniGPTError(f"row {row.get('id')!r}: the chosen poem has no regular form")
        out.append({"id": row["id"], "prompt": row["prompt"], "form": form, "reference": row["chosen"]})
    return out
