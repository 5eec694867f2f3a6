"""The Jinja sandbox that renders a model's chat template, and the bounds of one render.

A chat template is code that comes with a model's files. Run in Jinja's ``ImmutableSandboxedEnvironment``, as
``transformers``' ``apply_chat_template`` runs it, it cannot reach Python's internals or change its inputs, but it
can still hang the process or take all of its memory: Jinja bounds one ``range()`` (100,000 items) and nothing
else. A doubling ``{% set ns.s = ns.s ~ ns.s %}`` 29 times made a 1 GB string in 1.5 s; ``"x"|center(10**10)``
asks for 40 GB. So one render (inside :func:`render_bounds`) may

- draw :data:`RANGE_BUDGET` items from ``range()`` in all;
- run :data:`LOOP_BUDGET` for-loop iterations and macro calls in all (nested loops over a long string, a recursive
  loop's ``loop(children)``, a macro calling itself twice per call);
- repeat a string or list with ``*`` to :data:`REPEAT_LIMIT` items at most;
- make no string, list or dict longer than its *value limit*: ``max(VALUE_FLOOR, VALUE_FACTOR * n)`` characters
  (items, for lists), ``n`` being the size of the messages and tools as text. Where an operation can make more than
  it is given (``+``, ``~``, ``*``, ``%``, ``str.format``, ``ljust``/``center``/``replace``/``join``/..., the
  filters ``center``, ``indent``, ``replace``, ``join``, ``format``, ``wordwrap``, ``batch``, ``slice``, ``sum``,
  ``tojson``, ``string``, ``lipsum()``, and printing a list) its size is estimated *before* it runs; every other
  filter and method has its result checked after, so no chain of them grows far past the limit;
- work through :data:`WORK_FACTOR` times the value limit in characters (items) in all: every checked result
  counts, and so does the length of what a filter or a method of a string, list or dict is given and of the right
  side of ``in``, ``not in``, ``==`` and ``!=`` (``{% if "b" in s %}`` over a long ``s`` in a long loop ran for
  hours, reading ``s`` each time), an item counting :data:`ITEM_WORK` characters;
- make no integer wider than :data:`INT_BITS_LIMIT` bits with ``*`` or ``**`` (``9 ** 10**10`` runs for hours).

A template past a bound raises Jinja's ``SecurityError``, which :class:`minigpt.tokenizer.chat_template.ChatTemplate`
reports as the template's fault.
"""
from __future__ import annotations

import contextvars
import functools
import json
import re
import string
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Optional

# Private-use characters that mark {% generation %} blocks in the rendered text; removed before tokenizing.
OPEN_MARK, CLOSE_MARK = "\uf8f0", "\uf8f1"

# The bounds of one render (module attributes, read when a render starts). Real templates use a few ranges and
# loops over the messages and tools, and print each message once or twice.
RANGE_BUDGET = 1_000_000
REPEAT_LIMIT = 1_000_000
LOOP_BUDGET = 1_000_000
VALUE_FLOOR = 4_000_000
VALUE_FACTOR = 4
WORK_FACTOR = 256
INT_BITS_LIMIT = 1 << 16
ITEM_WORK = 64


@dataclass
class _Budget:
    range_left: int
    loops_left: int
    value_limit: int
    work_left: int


# The budget of the render in progress in this thread or task (None outside a render: compile-time constants).
_BUDGET: contextvars.ContextVar[Optional[_Budget]] = contextvars.ContextVar("chat_template_budget", default=None)


def _security_error(message: str) -> Exception:
    from jinja2.exceptions import SecurityError

    return SecurityError(message)


def text_size(value: Any, limit: int = 1 << 62) -> int:
    """The length of ``str(value)`` (or of its JSON) in characters, estimated without making it: a string's length
    plus its two quotes, two more per item of a list, tuple or set and four per item of a dict (the separators),
    the digits of an integer, 32 for any other object. Exact for plain ASCII data; escapes make the real text at
    most a few times longer. Stops counting once past ``limit`` (the result then only says it is past)."""
    from jinja2.utils import Namespace

    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v) + 2
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(v)
            stack.extend(v)
        elif isinstance(v, dict):
            total += 2 + 4 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, Namespace):  # printed as <Namespace {its attributes}>
            total += 12
            stack.append(object.__getattribute__(v, "_Namespace__attrs"))
        elif isinstance(v, int) and not isinstance(v, bool):
            total += v.bit_length() // 3 + 2
        else:
            total += 32
    return total


@contextmanager
def render_bounds(*inputs: Any):
    """Apply this module's bounds to the renders run inside; ``inputs`` (the messages, tools and variables given
    to the template) set the value limit."""
    limit = max(VALUE_FLOOR, VALUE_FACTOR * text_size(inputs))
    token = _BUDGET.set(_Budget(RANGE_BUDGET, LOOP_BUDGET, limit, WORK_FACTOR * limit))
    try:
        yield
    finally:
        _BUDGET.reset(token)


def _grow(size: int, what: str) -> None:
    """Account for a value of ``size`` characters (items) about to be made, or just made; raise past a bound."""
    budget = _BUDGET.get()
    if budget is None:
        return
    if size > budget.value_limit:
        raise _security_error(f"the template makes {what} of {size:,} characters, past the limit of "
                              f"{budget.value_limit:,} for these messages")
    _work(size)


def _work(size: int) -> None:
    """Account for ``size`` characters (items) made, or read through by a filter, method or comparison."""
    budget = _BUDGET.get()
    if budget is not None:
        budget.work_left -= size
        if budget.work_left < 0:
            raise _security_error(f"the template works through more than {WORK_FACTOR * budget.value_limit:,} "
                                  "characters or items in one render (a loop that would not end?)")


def _length(value: Any) -> int:
    """The work of reading ``value`` through: a character of a string is 1 (C reads it), an item of a list, tuple,
    dict or set :data:`ITEM_WORK` (a filter such as ``select`` spends a Python call on each)."""
    if isinstance(value, str):
        return len(value)
    return ITEM_WORK * len(value) if isinstance(value, (list, tuple, dict, set, frozenset)) else 0


def _measure(value: Any) -> int:
    budget = _BUDGET.get()
    return text_size(value, budget.value_limit if budget else 0)


def _text_len(value: Any) -> int:
    return len(value) if isinstance(value, str) else _measure(value)


def _count_loop() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.loops_left -= 1
        if budget.loops_left < 0:
            raise _security_error(f"the template runs more than {LOOP_BUDGET:,} loop iterations or macro calls in "
                                  "one render (a loop that would not end?)")


def _check_result(result: Any, what: str) -> Any:
    """After a filter or method: a string counts its length, a list or dict its items (they are references)."""
    if isinstance(result, (str, list, tuple, dict)):
        _grow(len(result), what)
    return result


def _number(digits: str) -> int:
    return int(digits[:12]) if digits else 0  # int() of a 5,000-digit string raises; 12 digits already exceed


_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?([a-zA-Z%])")


def _printf_size(fmt: str, args: Any) -> int:
    """``fmt % args``: the format, the arguments as text, and every field's width and precision."""
    size = len(fmt) + _measure(args)
    for width, precision, _conversion in _PRINTF.findall(fmt):
        if "*" in (width, precision):
            raise _security_error("the template formats with a '*' width or precision, which is not allowed")
        size += _number(width) + _number(precision)
    return size


def _format_size(fmt: str, args: Any, kwargs: Any) -> int:
    """``fmt.format(*args, **kwargs)``: the format, the arguments as text, and the numbers in each field's spec."""
    size = len(fmt) + _measure(args) + _measure(kwargs)
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return size  # the call itself reports the malformed format
    for _text, _field, spec, _conversion in fields:
        if spec and "{" in spec:
            raise _security_error("the template formats with a nested field in a format spec, which is not "
                                  "allowed")
        size += sum(_number(d) for d in re.findall(r"\d+", spec or ""))
    return size


def _replace_size(s: Any, old: str, new: str, count: Any = -1) -> int:
    """``s.replace(old, new, count)``: at most one replacement per ``len(old)`` characters (``len(s) + 1`` of an
    empty ``old``)."""
    size = _text_len(s)
    n = size // max(len(old), 1) + 1
    count = -1 if count is None else int(count)
    return size + (min(n, count) if count >= 0 else n) * len(new)


def _join_size(sep: str, items: list) -> int:
    return _measure(items) + len(sep) * len(items)


# Estimates, before the call, of the methods of a string that can make more than they are given.
_STR_METHODS: dict[str, Callable[..., int]] = {
    "ljust": lambda s, width, *a: max(len(s), width),
    "rjust": lambda s, width, *a: max(len(s), width),
    "center": lambda s, width, *a: max(len(s), width),
    "zfill": lambda s, width: max(len(s), width),
    "expandtabs": lambda s, tabsize=8: len(s) * max(tabsize, 1),
    "replace": _replace_size,
    "join": lambda s, items: _join_size(s, items),
    "translate": lambda s, table: len(s) * max([len(v) for v in getattr(table, "values", lambda: [])()
                                                 if isinstance(v, str)] + [1]),
}


def _indent_size(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> int:
    text = s if isinstance(s, str) else ""
    return _text_len(s) + (text.count("\n") + 1) * (len(width) if isinstance(width, str) else max(int(width), 0))


def _wordwrap_size(s: Any, width: int = 79, break_long_words: bool = True, wrapstring: Optional[str] = None,
                   *args: Any, **kwargs: Any) -> int:
    n = _text_len(s)
    return n + (n // max(int(width), 1) + 1) * len(wrapstring or "\n")


def _sum_size(items: list, attribute: Any = None, start: Any = 0) -> int:
    parts = [start, *items] if attribute is None else [start]
    return sum(len(p) for p in parts if isinstance(p, (str, list, tuple))) + len(items)


def _tojson_size(x: Any, ensure_ascii: bool = False, indent: Any = None, *args: Any, **kwargs: Any) -> int:
    """``json.dumps(x, indent=indent)``: the text of ``x``, and with ``indent`` a new line and ``depth`` indents
    before each item (escapes can make a string up to 6 times longer: bounded, and checked after)."""
    width = len(indent) if isinstance(indent, str) else max(int(indent or 0), 0)
    size = _measure(x)
    if width:
        limit, stack = _BUDGET.get().value_limit, [(x, 1)]
        while stack and size <= limit:
            v, depth = stack.pop()
            items = list(v.values()) if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else ()
            size += len(items) * (1 + depth * width) + (1 + (depth - 1) * width if items else 0)
            stack.extend((item, depth + 1) for item in items)
    return size


# Estimates, before the call, of the filters that can make more than they are given (value first).
_FILTERS: dict[str, Callable[..., int]] = {
    "center": lambda s, width=80: max(_text_len(s), int(width)),
    "indent": _indent_size,
    "replace": lambda s, old, new, count=None: _replace_size(s, str(old), str(new), count),
    "join": lambda items, d="", attribute=None: _join_size(str(d), items),
    "format": lambda s, *args, **kwargs: _printf_size(s, args or kwargs) if isinstance(s, str) else _measure(s),
    "wordwrap": _wordwrap_size,
    "batch": lambda items, linecount, fill_with=None: len(items) + max(int(linecount), 0),
    "slice": lambda items, slices, fill_with=None: len(items) + max(int(slices), 0),
    "sum": _sum_size,
    "tojson": _tojson_size,
    "string": _text_len,
    "pprint": lambda s: 2 * _measure(s),
}
_MATERIALIZE = {"join", "batch", "slice", "sum"}  # filters whose estimate needs the items of a generator


def _checked_filter(name: str, f: Callable) -> Callable:
    skip = 0 if getattr(f, "jinja_pass_arg", None) is None else 1  # the environment or context comes first
    estimate = _FILTERS.get(name)

    @functools.wraps(f)  # keeps jinja_pass_arg
    def run(*args: Any, **kwargs: Any) -> Any:
        if _BUDGET.get() is None:
            # Jinja's compiler calls filters of constants to fold them, outside any render and its bounds:
            # `"x"|center(10**10)` took 40 GB while the template compiled. Refused, the filter runs at render time.
            raise RuntimeError(f"the filter '{name}' runs only inside a render")
        if len(args) > skip:
            _work(_length(args[skip]))  # a filter reads what it is given: `x|length` in a loop is its length each
        if estimate is not None and len(args) > skip:
            if name in _MATERIALIZE and isinstance(args[skip], Iterator):
                args = (*args[:skip], list(args[skip]), *args[skip + 1:])
            _grow(estimate(*args[skip:], **kwargs), f"a value with the filter '{name}'")
        return _check_result(f(*args, **kwargs), f"a value with the filter '{name}'")

    return run


def _finalize(value: Any) -> Any:
    """What ``{{ value }}`` prints is ``str(value)``: measured first when ``value`` is not already a string."""
    if not isinstance(value, str):
        _grow(_measure(value), "the text of a value")
    return value


def environment():
    """A sandboxed Jinja environment for chat templates: ``transformers``' conventions (``trim_blocks``,
    ``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, a ``tojson`` that does not escape HTML,
    ``strftime_now``), the ``{% generation %}`` tag (its body between :data:`OPEN_MARK` and :data:`CLOSE_MARK`),
    and the bounds of this module, applied inside :func:`render_bounds`; its filters run only there (so Jinja's
    compiler does not fold a filter of constants, unbounded, while a template compiles)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.runtime import LoopContext, Macro
    from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
    from jinja2.utils import generate_lorem_ipsum
    from jinja2.visitor import NodeTransformer

    class GenerationMarks(Extension):
        """``{% generation %}BODY{% endgeneration %}`` renders BODY between the two marker characters."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return OPEN_MARK + caller() + CLOSE_MARK

    class Checked(NodeTransformer):
        """Every for loop iterates through the counting filter, whatever it loops over; every ``a ~ b`` joins
        through the measuring one; the right side of ``in``, ``not in``, ``==`` and ``!=`` (linear in its length)
        goes through the one that counts it as work."""

        def visit_Compare(self, node):
            node = self.generic_visit(node)
            for operand in node.ops:
                if operand.op in ("in", "notin", "eq", "ne"):
                    operand.expr = nodes.Filter(operand.expr, "minigpt_scanned", [], [], None, None,
                                                lineno=node.lineno)
            return node

        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = nodes.Filter(node.iter, "minigpt_counted", [], [], None, None, lineno=node.lineno)
            return node

        def visit_Concat(self, node):
            node = self.generic_visit(node)
            return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), "minigpt_concat", [], [], None, None,
                                lineno=node.lineno)

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "+", "%", "**"])

        @staticmethod
        def concat(parts):  # the render's output, and that of set-blocks, macros and caller()
            budget, out, total = _BUDGET.get(), [], 0
            for part in parts:
                total += len(part)
                if budget is not None and total > budget.value_limit:
                    _grow(total, "an output")
                out.append(part)
            _grow(total, "an output")
            return "".join(out)

        def _parse(self, source, name, filename):
            return Checked().visit(super()._parse(source, name, filename))

        def call(__self, __context, __obj, *args, **kwargs):
            if isinstance(__obj, LoopContext) and args:  # loop(children) iterates past the filter on the for
                args = (counted(args[0]), *args[1:])
            elif isinstance(__obj, Macro):
                _count_loop()
            owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
            _work(_length(owner))  # a method of a string, list or dict reads it: `s.count("x")`, `l.index(x)`
            if isinstance(owner, str) and name in _STR_METHODS and _BUDGET.get() is not None:
                if name == "join" and args and not isinstance(args[0], (list, tuple)):
                    args = (list(args[0]), *args[1:])
                _grow(_STR_METHODS[name](owner, *args, **kwargs), f"a string with .{name}()")
            result = super().call(__context, __obj, *args, **kwargs)
            return _check_result(result, f"a value with {name or 'a call'}()") if owner is not None else result

        def wrap_str_format(self, value):
            wrapper = super().wrap_str_format(value)
            if wrapper is None:
                return None
            fmt, is_map = value.__self__, value.__name__ == "format_map"

            def checked(*args, **kwargs):
                _grow(_format_size(fmt, args, kwargs) if not is_map else _format_size(fmt, (), args),
                      f"a string with .{value.__name__}()")
                return wrapper(*args, **kwargs)

            return checked

        def call_binop(self, context, operator, left, right):
            if operator in ("*", "**") and isinstance(left, int) and isinstance(right, int):
                bits = (abs(left).bit_length() * max(right, 0) if operator == "**"
                        else left.bit_length() + right.bit_length())
                if bits > INT_BITS_LIMIT:
                    raise _security_error(f"the template makes an integer of about {bits:,} bits (at most "
                                          f"{INT_BITS_LIMIT:,})")
            elif operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    if len(seq) * n > REPEAT_LIMIT:
                        raise _security_error(f"the template repeats a value to more than {REPEAT_LIMIT:,} items")
                    _grow(len(seq) * max(n, 0), "a repeated value")
            elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _grow(len(left) + len(right), "a sum")
            elif operator == "%" and isinstance(left, str):
                _grow(_printf_size(left, right), "a %-formatted string")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):  # Llama 3.x templates print today's date in the system header
        return datetime.now().strftime(format)

    def budget_range(*args):
        items = safe_range(*args)
        budget = _BUDGET.get()
        if budget is not None:
            if len(items) > budget.range_left:
                raise _security_error(f"the template draws more than {RANGE_BUDGET:,} items from range() in one "
                                      "render (a loop that would not end?)")
            budget.range_left -= len(items)
        return items

    def counted(iterable):
        for item in iterable:
            _count_loop()
            yield item

    def concat_filter(parts):
        texts = [str(_finalize(p)) for p in parts]
        _grow(sum(map(len, texts)), "a string with ~")
        return "".join(texts)

    def scanned(value):
        _work(_length(value))
        return value

    def lipsum(n=5, html=True, min=20, max=100):
        _grow(int(n) * int(max) * 16, "lorem ipsum")
        return generate_lorem_ipsum(n, html, min, max)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationMarks, loopcontrols],
                  finalize=_finalize)
    env.filters["tojson"] = tojson
    env.filters = {name: _checked_filter(name, f) for name, f in env.filters.items()}
    env.filters["minigpt_counted"] = counted
    env.filters["minigpt_concat"] = concat_filter
    env.filters["minigpt_scanned"] = scanned
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["range"] = budget_range
    env.globals["lipsum"] = lipsum
    return env
