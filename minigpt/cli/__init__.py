"""MiniGPT: prepare data, train, convert, generate, serve and measure Llama-style language models.

The command line: argparse only, one module per verb group, nothing in the library imports it. Each
subcommand's help is its function's docstring.

Errors a user can fix (bad config, missing data, prompt too long, broken checkpoint) print one line,
``error: ...``, and exit with status 1; no traceback.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings

from minigpt.cli import analysis, bench, convert, data, evaluate, generate, posttrain, quick, serve, train
from minigpt.errors import MiniGPTError, describe_os_error
from minigpt.heap import keep_freed_blocks


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose sub-commands (argparse makes them of their parent's class) refuse an option they
    do not know with their own usage line (``usage: minigpt bench serve ...``), where argparse would report it
    from the top-level parser, whose usage lists only the commands."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="minigpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (data, train, posttrain, generate, evaluate, convert, analysis, bench, serve):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MiniGPTError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader closed early (`| head`): an OSError, so caught before those
        # Python would otherwise report the failed flush of stdout at exit (its signal-handling docs' recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError) as e:  # anything else a user can cause; MINIGPT_DEBUG=1 shows the traceback
        if os.environ.get("MINIGPT_DEBUG"):
            raise
        shown = describe_os_error(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        print(f"error: {shown}", file=sys.stderr)
        return 1


def run() -> int:
    """The ``minigpt`` executable (and ``python -m minigpt``): :func:`main`, then a cheaper interpreter exit.

    Why: at exit CPython's last garbage collections walk every object torch's modules made, 0.4-0.5 s on a 2-core
    Xeon (measured: the same for ``python -c "import torch"``) after a command's work is done; frozen objects
    (``gc.freeze``) are not walked, which took the exit to 0.1-0.2 s. ``atexit`` handlers and reference-counted
    clean-up still run. Not done in :func:`main`, which tests call in-process. Before any command: glibc keeps the
    freed blocks of a forward pass for the next (:func:`minigpt.heap.keep_freed_blocks`)."""
    if not os.environ.get("MINIGPT_DEBUG"):
        warnings.showwarning = _show_warning
    keep_freed_blocks()
    code = _native(sys.argv[1:])
    if code is None:
        code = main()
    gc.freeze()
    return code


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_default_show_warning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """MiniGPT's own warnings as one ``warning: ...`` line, as its errors are (not Python's two lines of file,
    line number and source); other libraries' warnings keep Python's form, which says where they come from.
    ``MINIGPT_DEBUG=1`` keeps Python's form for all."""
    if os.path.abspath(filename).startswith(_PACKAGE + os.sep):
        try:
            print(f"warning: {message}", file=file or sys.stderr)
        except OSError:  # stderr closed: a warning is not worth failing the command for
            pass
    else:
        _default_show_warning(message, category, filename, lineno, file, line)


def _native(argv: list[str]) -> int | None:
    """A ``generate --compile`` call run by the native launcher without importing torch (:mod:`minigpt.cli.quick`),
    or None for the ordinary command. Its errors print the ordinary command's one line."""
    from minigpt.infer.launcher import NativeError

    try:
        return quick.run(argv)
    except BrokenPipeError:  # the reader closed early, as in main
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (MiniGPTError, NativeError, ValueError, OSError) as e:
        if os.environ.get("MINIGPT_DEBUG"):
            raise
        print(f"error: {describe_os_error(e) if isinstance(e, OSError) else e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(run())
