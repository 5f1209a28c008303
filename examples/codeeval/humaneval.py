"""The example's problems and samples in HumanEval's format, for ``toolpool eval``.

``python -m examples.codeeval.humaneval DIR`` (from the repository's root) writes
``DIR/problems.jsonl`` (``task_id``, ``prompt``, ``test`` defining ``check(candidate)``,
``entry_point``) and ``DIR/samples.jsonl`` (``task_id``, ``completion``, in the order of
``completions.COMPLETIONS``). Each problem's
``check`` calls the candidate with each test's arguments and compares what comes back with
:func:`problems.same` (its source is part of the test), so the verdicts are the example's.
Then::

    toolpool eval DIR/problems.jsonl DIR/samples.jsonl -o DIR/results.jsonl

(Keep DIR outside the interpreter's library directories: completions may read those.)
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

from .completions import COMPLETIONS
from .problems import PROBLEMS, Problem, same

__all__ = ("main", "problem_record", "problem_records", "sample_records")

_SAME = (
    inspect.getsource(same).replace("def same(", "def _same(").replace("same(g, e", "_same(g, e")
)
_SAME = _SAME.replace("same(got[k]", "_same(got[k]")


def problem_record(problem: Problem) -> dict[str, str]:
    """One problem as a HumanEval problem."""
    test = "\n".join(
        [
            "import math",
            "from typing import Any",
            "",
            _SAME,
            f"TESTS = {[[list(args), expected] for args, expected in problem.tests]!r}",
            "",
            "def check(candidate):",
            "    for args, expected in TESTS:",
            "        got = candidate(*args)",
            f"        assert _same(got, expected, {problem.compare!r}), (args, got)",
            "",
        ]
    )
    return {
        "task_id": problem.id,
        "prompt": problem.prompt,
        "test": test,
        "entry_point": problem.entry,
    }


def problem_records() -> list[dict[str, str]]:
    """Every problem of the example, as HumanEval problems."""
    return [problem_record(p) for p in PROBLEMS.values()]


def sample_records() -> list[dict[str, str]]:
    """Every completion of the example, as a HumanEval sample (its own id beside)."""
    return [
        {"task_id": c.problem_id, "completion": "\n" + c.source, "example_id": c.id}
        for c in COMPLETIONS
    ]


def main(argv: list[str]) -> int:
    """Write problems.jsonl and samples.jsonl into the directory ``argv[0]``."""
    if len(argv) != 1:
        print("usage: python -m examples.codeeval.humaneval DIR", file=sys.stderr)
        return 2
    directory = Path(argv[0])
    directory.mkdir(parents=True, exist_ok=True)
    for name, records in (("problems", problem_records()), ("samples", sample_records())):
        path = directory / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        print(f"wrote {len(records)} lines to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
