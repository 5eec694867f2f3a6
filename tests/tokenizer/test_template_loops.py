"""A model's chat template that loops without end, or renders nothing, is one clear error (a TemplateFailed: a
400 from the server, a refused turn in `minigpt chat`, one `error:` line from `minigpt generate --chat`), not a
hung process or an "empty prompt" blamed on the user's message. Ordinary loops render as Jinja renders them."""
import random

import pytest
from conftest import TINY_MODEL, assert_one_line_error, random_model, run_cli
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minigpt.checkpoint.native import save_pretrained
from minigpt.tokenizer import template_sandbox
from minigpt.tokenizer.chat_template import IM_END, IM_START, ChatTemplate, TemplateFailed, add_special_tokens
from minigpt.tokenizer.tokenizer import train_tokenizer

WORDS = "the cat sat on a mat why is sky blue tell me about tea".split()
MESSAGES = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}]
# 10^12 iterations of loops over a 1,000,000-character string (within the repeat limit, no range()): this hung
# `minigpt generate --chat` past any timeout.
NESTED_STRING_LOOPS = ('{% set s = "a" * 999999 %}{% for c in s %}{% for d in s %}{% endfor %}{% endfor %}'
                       "{{ messages[0].content }}")


@pytest.fixture(scope="module")
def tokenizer():
    rng = random.Random(0)
    tok = train_tokenizer([" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(200)], 300)
    return add_special_tokens(tok, (IM_START, IM_END))[0]


def test_nested_loops_over_a_long_string_are_stopped(tokenizer):
    with pytest.raises(TemplateFailed, match="runs more than 1,000,000 loop iterations"):
        ChatTemplate(tokenizer, NESTED_STRING_LOOPS).prompt(MESSAGES)


def test_the_loops_of_a_recursive_for_count_too(tokenizer, monkeypatch):
    """``loop(children)`` iterates outside the loop's own ``in`` expression: counted as well. 10,100 iterations
    against a budget lowered to 1,000."""
    monkeypatch.setattr(template_sandbox, "LOOP_BUDGET", 1000)
    template = ('{% set s = "a" * 100 %}{% for c in [1] recursive %}{% if loop.depth < 3 %}{{ loop(s) }}{% endif %}'
                "{% endfor %}")
    with pytest.raises(TemplateFailed, match="runs more than 1,000 loop iterations"):
        ChatTemplate(tokenizer, template).render(MESSAGES)


@pytest.mark.parametrize("template", [
    '{% for m in messages %}{{ loop.index }}/{{ loop.length }}/{{ loop.revindex }}{% if loop.last %}L{% endif %}'
    '{{ loop.cycle("a", "b") }}{{ loop.previtem.role if loop.previtem else "-" }}{% else %}none{% endfor %}',
    "{% for m in [] %}x{% else %}none{% endfor %}",
    '{% for k, v in {"a": 1}.items() %}{{ k }}{{ v }}{% endfor %}',
    '{% for m in messages if m.role != "system" %}{{ loop.index }}{{ m.role }}{% endfor %}',
    "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.role }}{% break %}{% endfor %}",
    "{% for x in [[1, [2]], [3]] recursive %}[{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}{% endif %}]"
    "{% endfor %}",
])
def test_counted_loops_render_as_jinja_renders_them(tokenizer, template):
    jinja = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    assert ChatTemplate(tokenizer, template).render(MESSAGES) == jinja.from_string(template).render(
        messages=MESSAGES)


def test_a_template_that_renders_nothing_is_the_templates_fault(tokenizer):
    with pytest.raises(TemplateFailed, match="renders nothing for these messages"):
        ChatTemplate(tokenizer, "{% if false %}x{% endif %}").prompt(MESSAGES)


@pytest.mark.parametrize("template, fragment", [
    (NESTED_STRING_LOOPS, "runs more than 1,000,000 loop iterations"),
    ("{% if false %}x{% endif %}", "renders nothing for these messages"),
])
def test_generate_chat_with_such_a_template_is_one_error_line(tmp_path, tokenizer, template, fragment):
    path = save_pretrained(random_model(TINY_MODEL, vocab_size=tokenizer.vocab_size), tmp_path / "m", tokenizer,
                           template)
    proc = run_cli("generate", path, "--chat", "hi", "--max-new-tokens", "2")
    assert_one_line_error(proc, f"the chat template of {path / 'chat_template.jinja'}", fragment)
