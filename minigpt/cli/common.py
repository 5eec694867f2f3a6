"""What every verb module of the command line shares: help from docstrings, YAML-ish values."""
from __future__ import annotations

import argparse
from typing import Any, Callable

from minigpt.errors import MiniGPTError, one_line


def add_command(sub, name: str, func: Callable, **kw) -> argparse.ArgumentParser:
    """A sub-command ``name`` running ``func(args)``; its help and description are ``func``'s docstring."""
    doc = func.__doc__ or ""
    p = sub.add_parser(name, help=doc.strip().splitlines()[0], description=doc,
                       formatter_class=argparse.RawDescriptionHelpFormatter, **kw)
    p.set_defaults(func=func)
    return p


def positive_int(text: str) -> int:
    """An ``argparse`` type: a whole number of at least 1 (``--threads``); anything else is the usage error
    ``argument --threads: must be at least 1, got 0``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_value(text: str, what: str = "--set value") -> Any:
    """A ``--set KEY=VALUE`` value as YAML reads it (numbers, booleans, lists; else the string).

    Raises :class:`MiniGPTError` naming ``what`` (:func:`parse_yaml`)."""
    return parse_yaml(text, what)


def parse_yaml(text: str, what: str) -> Any:
    """``text`` read by ``yaml.safe_load``. Raises :class:`MiniGPTError` naming ``what`` (a file, a flag) for
    invalid YAML, for nesting thousands of levels deep (PyYAML's recursive reader then raises ``RecursionError``)
    and for an integer of more digits than Python converts."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise MiniGPTError(f"{what} is not valid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise MiniGPTError(f"{what} is nested too deeply to read") from None
    except ValueError as e:
        raise MiniGPTError(f"{what} is not usable YAML: {one_line(e)}") from None
