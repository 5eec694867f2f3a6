"""``python -m minigpt`` (and ``torchrun -m minigpt``) runs the CLI."""
import sys

from .cli import main

sys.exit(main())
