"""``toolpool eval``: score model-written code on HumanEval-style problems (docs/eval.md)."""
