"""Code evaluation, HumanEval style: see ``tools.py`` and ``docs/codeeval.md``."""
