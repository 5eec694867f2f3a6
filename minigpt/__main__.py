"""``python -m minigpt`` (and ``torchrun -m minigpt``) runs the CLI."""
import sys

from minigpt.cli import run

sys.exit(run())
