"""``python -m toolpool``: the command line."""

from ._cli import console

console()
