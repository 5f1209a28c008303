"""Problems and samples in the published formats, and the pass@k estimator.

HumanEval (``.jsonl`` or ``.jsonl.gz``): a problem is ``{"task_id", "prompt", "test",
"entry_point"}`` (other fields, such as ``canonical_solution``, are ignored), its ``test``
defining ``check(candidate)``; a sample is ``{"task_id", "completion"}``, the completion
continuing the prompt. MBPP as published (``{"task_id", "text", "code", "test_list",
"test_setup_code"}``) is converted on reading: see :func:`from_mbpp`.
"""

from __future__ import annotations

import ast
import builtins
import gzip
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Final, cast, final

__all__ = (
    "Problem",
    "TaskId",
    "from_mbpp",
    "open_lines",
    "pass_at_k",
    "read_problems",
)

TaskId = str | int
_HUMANEVAL: Final = ("task_id", "prompt", "test", "entry_point")
_MBPP: Final = ("task_id", "code", "test_list")


@final
@dataclass(frozen=True)
class Problem:
    """One problem: the samples' ``task_id`` names it."""

    task_id: TaskId
    prompt: str
    """What the completion continues (the child runs ``prompt + completion``); also run
    before ``test``, so that ``check`` may use the prompt's helpers."""
    test: str
    """Trusted code that defines ``check(candidate)``."""
    entry_point: str
    """The function ``check`` is given as ``candidate``."""


def open_lines(path: str | os.PathLike[str]) -> IO[bytes]:
    """``path`` opened for reading lines: gunzipped if its name ends with ``.gz``."""
    if os.fspath(path).endswith(".gz"):
        return cast(IO[bytes], gzip.open(path, "rb"))
    return open(path, "rb")


def read_problems(path: str | os.PathLike[str]) -> dict[TaskId, Problem]:
    """Every problem of the file at ``path`` (HumanEval's format, or MBPP's), by task_id.

    Raises :class:`ValueError` naming the line of the first problem that is not one.
    """
    problems: dict[TaskId, Problem] = {}
    try:
        with open_lines(path) as f:
            for number, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                where = f"{os.fspath(path)} line {number}"
                try:
                    line = json.loads(raw)
                except ValueError as exc:
                    raise ValueError(f"{where}: not valid JSON ({exc})") from None
                problem = _problem(line, where)
                if problem.task_id in problems:
                    raise ValueError(f"{where}: task_id {problem.task_id!r} again")
                problems[problem.task_id] = problem
    except (OSError, EOFError) as exc:  # (a truncated .gz is an EOFError)
        raise ValueError(f"cannot read {os.fspath(path)}: {exc}") from None
    if not problems:
        raise ValueError(f"{os.fspath(path)} holds no problem")
    return problems


def _problem(line: Any, where: str) -> Problem:
    if not isinstance(line, dict):
        raise ValueError(f"{where}: a problem is a JSON object")
    task_id = line.get("task_id")
    if isinstance(task_id, bool) or not isinstance(task_id, (str, int)) or task_id == "":
        raise ValueError(f"{where}: its task_id must be a string or an integer")
    if all(k in line for k in _HUMANEVAL):
        for key in ("prompt", "test", "entry_point"):
            if not isinstance(line[key], str):
                raise ValueError(f"{where}: its {key!r} must be a string")
        if not line["entry_point"].isidentifier():
            raise ValueError(f"{where}: its entry_point is not a name")
        problem = Problem(task_id, line["prompt"], line["test"], line["entry_point"])
    elif all(k in line for k in _MBPP):
        problem = from_mbpp(line, where)
    else:
        raise ValueError(
            f"{where}: not a problem: HumanEval's has {', '.join(_HUMANEVAL)}; "
            f"MBPP's has {', '.join(_MBPP)}"
        )
    for name, code in (("prompt", problem.prompt), ("test", problem.test)):
        try:
            tree = ast.parse(code, f"<{name}>")
        except (SyntaxError, ValueError) as exc:
            raise ValueError(f"{where}: its {name} is not valid Python ({exc})") from None
        if name == "test" and not any(
            isinstance(node, ast.FunctionDef) and node.name == "check" for node in tree.body
        ):
            raise ValueError(f"{where}: its test defines no check(candidate)")
    return problem


def from_mbpp(line: dict[str, Any], where: str = "MBPP problem") -> Problem:
    """An MBPP problem as a :class:`Problem`.

    The function under test is the one the reference ``code`` defines and the tests call
    (else the first function the tests call that is not a builtin). The prompt is empty (an
    MBPP completion is a whole program); the test is ``test_setup_code`` and a
    ``check(candidate)`` that binds that name to the candidate and runs ``test_list``'s
    asserts (``challenge_test_list`` is not used, as MBPP's own evaluation does).
    """
    tests = line.get("test_list")
    setup = line.get("test_setup_code") or ""
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"{where}: its test_list must be a non-empty list of strings")
    if not isinstance(setup, str) or not isinstance(line.get("code"), str):
        raise ValueError(f"{where}: its code and test_setup_code must be strings")
    try:
        defined = [
            node.name for node in ast.parse(line["code"]).body if isinstance(node, ast.FunctionDef)
        ]
        called = [
            node.func.id
            for test in tests
            for node in ast.walk(ast.parse(test))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        ]
    except SyntaxError as exc:
        raise ValueError(f"{where}: not valid Python ({exc})") from None
    entry = next((name for name in called if name in defined), None)
    if entry is None:
        entry = next((name for name in called if not hasattr(builtins, name)), None)
    if entry is None:
        raise ValueError(f"{where}: its tests call no function to check")
    body = "\n".join(f"    {t.strip()}" for t in tests)
    test = f"{setup}\n\ndef check(candidate):\n    {entry} = candidate\n{body}\n"
    return Problem(line["task_id"], "", test, entry)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k (Chen et al., 2021) from ``n`` samples of which ``c``
    passed: ``1 - C(n - c, k) / C(n, k)``, computed as a product (no huge binomials).
    Raises :class:`ValueError` unless ``0 <= c <= n`` and ``1 <= k <= n``."""
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(counts: Iterable[tuple[int, int]], ks: Iterable[int]) -> dict[int, float | None]:
    """The mean of :func:`pass_at_k` over problems, given each problem's ``(n, c)``, for each
    k; None for a k that some problem has fewer than k samples for (as the harness, which
    reports only the k every problem has samples for)."""
    pairs = list(counts)
    out: dict[int, float | None] = {}
    for k in ks:
        if not pairs or any(n < k for n, _ in pairs):
            out[k] = None
        else:
            out[k] = sum(pass_at_k(n, c, k) for n, c in pairs) / len(pairs)
    return out


def iter_json_lines(stream: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` for each non-blank line of ``stream``."""
    for number, raw in enumerate(stream, start=1):
        if raw.strip():
            yield number, raw
