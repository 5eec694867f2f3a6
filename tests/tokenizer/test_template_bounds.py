"""A model's chat template that grows a value without end (a doubling string, a huge width, a list printed a
thousand times over) is stopped before it allocates, as one clear error; the templates models ship render exactly
as Jinja renders them, however long the conversation."""
import json
import resource

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minigpt.tokenizer import template_sandbox
from minigpt.tokenizer.chat_template import IM_END, IM_START, ChatTemplate, TemplateFailed, add_special_tokens
from minigpt.tokenizer.template_sandbox import environment, render_bounds, text_size
from minigpt.tokenizer.tokenizer import train_tokenizer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]

# Each asked for hundreds of megabytes to terabytes (or, the integers, hours of arithmetic); a doubling string
# made 1 GB in 1.5 s before these bounds.
GROWING = [
    ('{{ "%0500000000d" % 1 }}', "a %-formatted string of 500,000,0"),
    ('{{ "%*d" % (5, 1) }}', "'*' width"),
    ('{{ "x"|center(500000000) }}', "the filter 'center' of 500,000,000"),
    ('{{ "x".ljust(10**11) }}', ".ljust() of 100,000,000,000"),
    ('{% set ns = namespace(s="xx") %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}',
     "a string with ~ of 4,194,304 characters"),
    ('{% set ns = namespace(s=[1, 2]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}',
     "a sum of 4,194,304"),
    ('{{ ("x" * 1000000).replace("", "y" * 1000) }}', ".replace() of 1,001,001,000"),
    ('{{ ("x" * 1000000)|replace("", "y" * 1000) }}', "the filter 'replace' of 1,001,001,000"),
    ('{{ "{:>500000000}".format(1) }}', ".format() of 500,000,0"),
    ('{{ "{:{w}}".format(1, w=10**9) }}', "nested field in a format spec"),
    ('{{ "{a:>500000000}".format_map({"a": 1}) }}', ".format_map()"),
    ('{{ "%500000000s"|format(1) }}', "the filter 'format' of 500,000,0"),
    ('{{ ("\n" * 1000000)|indent(1000) }}', "the filter 'indent'"),
    ('{{ ("y" * 100000)|join("x" * 100000) }}', "the filter 'join' of 10,000,10"),
    ('{{ "x".join(["y" * 100000] * 100000) }}', ".join()"),
    ('{% set l = ["x" * 1000000] * 1000 %}{{ l }}', "the text of a value"),
    ('{% set l = ["x" * 1000000] * 1000 %}{{ l|string }}', "the filter 'string'"),
    ('{% set l = ["x" * 1000000] * 1000 %}{{ l|tojson }}', "the filter 'tojson'"),
    ("{{ [[1]]|tojson(indent=1000000000) }}", "the filter 'tojson'"),
    ("{{ [1]|batch(1000000000, 0)|list }}", "the filter 'batch' of 1,000,000,001"),
    ("{{ [1]|slice(100000000)|list }}", "the filter 'slice'"),
    ("{% set l = [[0] * 1000000] * 1000 %}{{ l|sum(start=[])|length }}", "the filter 'sum'"),
    ('{{ ("\t" * 1000000).expandtabs(1000) }}', ".expandtabs()"),
    ('{{ ("a" * 1000000).translate({97: "b" * 1000}) }}', ".translate()"),
    ("{{ lipsum(100000000) }}", "lorem ipsum"),
    ('{% set s = "x" * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}', "an output of 5,000,000"),
    ('{% set ns = namespace(s="a\\"b") %}{% for i in range(60) %}{% set ns.s = ns.s|tojson %}{% endfor %}',
     "the filter 'tojson'"),
    ("{{ 9 ** 1000000000 > 1 }}", "an integer of about 4,000,000,000 bits"),
    ("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
     "an integer of about"),
]


def render(source, messages=MESSAGES, **variables):
    with render_bounds(messages, variables):
        return environment().from_string(source).render(messages=messages, **variables)


@pytest.mark.parametrize("source, fragment", GROWING)
def test_growing_templates_are_stopped_before_they_allocate(source, fragment):
    from jinja2.exceptions import SecurityError

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(SecurityError, match="^the template ") as info:
        render(source)
    assert fragment in str(info.value)
    # The peak resident size of this process grew by less than 200 MB (ru_maxrss: KiB on Linux).
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024


def test_other_filters_and_methods_are_checked_after_the_call(monkeypatch):
    """A filter or method without an estimate (urlencode makes three characters of each '%') has its result
    checked: past the limit, the render stops there."""
    from jinja2.exceptions import SecurityError

    monkeypatch.setattr(template_sandbox, "VALUE_FLOOR", 1000)
    assert render('{{ ("%" * 300)|urlencode|length }}') == "900"
    with pytest.raises(SecurityError, match="the filter 'urlencode' of 1,200 characters, past the limit of 1,000"):
        render('{{ ("%" * 400)|urlencode|length }}')
    with pytest.raises(SecurityError, match=r"upper\(\) of 1,200 characters"):
        render('{{ ("ß" * 600).upper()|length }}')  # "SS" for each "ß"


def test_filters_of_constants_are_not_run_while_the_template_compiles():
    """Jinja folds a filter of constants at compile time, outside any render: `"x"|center(3 * 10**9)` asked for
    12 GB (a MemoryError) as the model's template compiled. It now compiles at once and is stopped when rendered."""
    from jinja2.exceptions import SecurityError

    template = environment().from_string('{{ "x"|center(3000000000) }}')
    with pytest.raises(SecurityError, match="the filter 'center' of 3,000,000,000 characters"):
        with render_bounds(MESSAGES):
            template.render(messages=MESSAGES)
    assert render('{{ "ab"|upper ~ "c"|center(3) }}') == "AB c "


@pytest.mark.parametrize("source", [
    '{% set s = "a" * 999999 %}{% for c in s %}{% if "b" in s %}{% endif %}{% endfor %}',
    '{% set s = "a" * 999999 %}{% for c in s %}{% if s == s ~ "" %}{% endif %}{% endfor %}',
    '{% set s = "a" * 999999 %}{% for c in s %}{{ s.count("b") }}{% endfor %}',
    '{% set s = ["a"] * 999999 %}{% for c in s %}{{ s|select("equalto", "b")|list|length }}{% endfor %}',
])
def test_reading_a_long_value_in_a_long_loop_counts_as_work(source, monkeypatch):
    """Within the loop budget (999,999 iterations), each reads 999,999 characters or items: 10^12 steps, hours.
    Counted as work, the render stops after at most 1,000 iterations; with the work budget lowered 16 times here,
    after at most 64, so that the test is quick (Python's `select` spends about 0.5 s on each pass over the list)."""
    from jinja2.exceptions import SecurityError

    monkeypatch.setattr(template_sandbox, "WORK_FACTOR", 16)
    with pytest.raises(SecurityError, match="works through more than 64,000,000 characters or items"):
        render(source)


def test_macros_calling_themselves_count_against_the_loop_budget(monkeypatch):
    """2^40 calls of a macro that calls itself twice, and prints nothing: it ran for days."""
    from jinja2.exceptions import SecurityError

    monkeypatch.setattr(template_sandbox, "LOOP_BUDGET", 10_000)
    with pytest.raises(SecurityError, match="more than 10,000 loop iterations or macro calls"):
        render("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}")


def test_the_value_limit_grows_with_the_messages():
    """The floor is 4,000,000 characters; a 3,000,000-character message printed twice is 6,000,000, fine for it."""
    long = [{"role": "user", "content": "word " * 600_000}]
    out = render("{% for m in messages %}{{ m.content }}{{ m.content|upper }}{% endfor %}", long)
    assert len(out) == 6_000_000
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError, match="past the limit of 12,000,"):  # 4 x the input's size
        render("{% for m in messages %}{{ m.content ~ m.content ~ m.content ~ m.content ~ m.content }}{% endfor %}",
               long)


def test_text_size_bounds_the_printed_and_json_length_of_plain_data():
    values = ["abc", [1, "xy", [None, 2.5]], {"a": [1, 2], "b": {"c": "d"}}, (True, -12345), [], {}, 2**200,
              [{"type": "function", "function": {"name": "t", "parameters": {"x": 1}}}] * 3]
    for value in values:
        assert text_size(value) >= len(str(value))
        assert text_size(value) >= len(json.dumps(value))
    with render_bounds():
        for value in values:
            for indent in (None, 2, 4, "\t"):
                assert template_sandbox._tojson_size(value, indent=indent) >= len(json.dumps(value, indent=indent))
    assert text_size(["x" * 100] * 100, limit=500) > 500  # stops early, past the limit


# A template with what the templates models ship use: namespaces, loops with loop.*, macros, tojson with indent,
# selectattr/map/join, string methods, format and %, ~ and +, trim/upper/replace/indent/center, generation blocks.
RICH_TEMPLATE = """{%- macro render_tool(t) -%}
{{ t.function.name }}: {{ t.function.description|trim }}
{{ t|tojson(indent=4) }}
{%- endmacro -%}
{{ bos_token }}
{%- set ns = namespace(system="", last_user=-1, count=0) -%}
{%- for m in messages -%}
  {%- if m.role == "system" %}{% set ns.system = ns.system ~ m.content|trim %}{% endif -%}
  {%- if m.role == "user" %}{% set ns.last_user = loop.index0 %}{% endif -%}
  {%- set ns.count = ns.count + (m.content|length) -%}
{%- endfor -%}
<|im_start|>system
{{ ns.system|default("You are helpful.", true) }}
{%- if tools %}

Tools ({{ tools|length }}): {{ tools|map(attribute="function.name")|join(", ") }}
{% for t in tools %}{{ render_tool(t) }}
{% endfor %}
{%- endif %}
Characters: {{ "%d"|format(ns.count) }} / {{ "{:,}".format(ns.count) }} / {{ "%05d" % ns.count }}<|im_end|>
{% for m in messages if m.role != "system" -%}
<|im_start|>{{ m.role|upper|lower }}{{ " (last)" if loop.index0 == ns.last_user else "" }}
{% if m.role == "assistant" %}{% generation %}{{ m.content.strip() + "<|im_end|>" }}{% endgeneration %}
{% else %}{{ m.content|replace("\r\n", "\n")|indent(2) }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{{ "thinking"|center(12) ~ ("." * 3) }}{% endif -%}"""

TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"  does thing {i}  ",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
         for i in range(3)]


@pytest.fixture(scope="module")
def tokenizer():
    tok = train_tokenizer(["the cat sat on a mat why is sky blue tell me about tea"] * 50, 300)
    return add_special_tokens(tok, (IM_START, IM_END))[0]


@pytest.mark.parametrize("size", [10, 2_500_000])
def test_a_rich_template_renders_as_jinja_renders_it(tokenizer, size):
    """Checked against Jinja's own sandbox, with transformers' tojson, on a short conversation and on one whose
    user message alone is past the value limit's floor."""
    messages = [{"role": "system", "content": " sys "}, {"role": "user", "content": "q\r\n" + "w" * size},
                {"role": "assistant", "content": " a "}, {"role": "user", "content": "again"}]
    template = ChatTemplate(tokenizer, RICH_TEMPLATE)
    jinja = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    jinja.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    jinja.add_extension(type(environment().extensions["minigpt.tokenizer.template_sandbox.GenerationMarks"]))
    expected = jinja.from_string(RICH_TEMPLATE).render(
        messages=messages, tools=TOOLS, add_generation_prompt=True, documents=None, **template._variables)
    got = template.render(messages, add_generation_prompt=True, tools=TOOLS)
    assert got == expected.replace(template_sandbox.OPEN_MARK, "").replace(template_sandbox.CLOSE_MARK, "")
    assert "tool_0: does thing 0" in got and "Characters: " in got


def test_chat_template_reports_a_growing_template_as_its_fault(tokenizer):
    template = ChatTemplate(tokenizer, '{{ "x".ljust(10**10) }}')
    with pytest.raises(TemplateFailed, match=r"the chat template was stopped: the template makes a string with "
                                             r"\.ljust\(\) of 10,000,000,000 characters"):
        template.render(MESSAGES)
