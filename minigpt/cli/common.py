"""What every verb module of the command line shares: help from docstrings, YAML-ish values."""
from __future__ import annotations

import argparse
from typing import Any, Callable


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


def parse_value(text: str) -> Any:
    """A ``--set KEY=VALUE`` value as YAML reads it (numbers, booleans, lists; else the string)."""
    import yaml

    return yaml.safe_load(text)
