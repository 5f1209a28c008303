"""A HumanEval-format problem set written for toolpool's tests (not HumanEval's text).

Eight problems that exercise what crosses the jail (tuples, sets, nan and inf, bytes, dicts
with integer keys, an exception ``check`` expects, a helper of the prompt used by the
completion and by ``check``), each with a canonical and a wrong completion, and hostile
completions of the first problem that attack the evaluation. ``SAMPLES`` lists
``(kind, name, task_id, completion, verdicts it may get)``.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

__all__ = ("DAEMON_MARK", "ESCAPE_FILE", "PROBLEMS", "SAMPLES", "write")

#: A file a hostile completion tries to write outside its directory.
ESCAPE_FILE = "/tmp/toolpool-hostile-escaped-its-jail"
#: What the daemon samples put in their process title (argv can't change: they write a file).
DAEMON_MARK = "toolpool-eval-daemon"


def _d(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


PROBLEMS: list[dict[str, str]] = [
    {
        "task_id": "Set/0",
        "entry_point": "add",
        "prompt": _d('''
            def add(a: int, b: int) -> int:
                """The sum of a and b."""
            '''),
        "test": _d("""
            METADATA = {"author": "toolpool"}

            def check(candidate):
                assert candidate(1, 2) == 3
                assert candidate(-5, 5) == 0
                assert candidate(10**30, 1) == 10**30 + 1
                assert candidate(a=2, b=3) == 5
            """),
    },
    {
        "task_id": "Set/1",
        "entry_point": "min_max",
        "prompt": _d('''
            from typing import List, Tuple

            def min_max(xs: List[int]) -> Tuple[int, int]:
                """The smallest and the largest number of a non-empty list, as a tuple."""
            '''),
        "test": _d("""
            def check(candidate):
                assert candidate([3, 1, 2]) == (1, 3)
                assert candidate([7]) == (7, 7)
                assert isinstance(candidate([1, 2]), tuple)
            """),
    },
    {
        "task_id": "Set/2",
        "entry_point": "unique",
        "prompt": _d('''
            def unique(xs: list) -> set:
                """The distinct elements of xs, as a set."""
            '''),
        "test": _d("""
            def check(candidate):
                assert candidate([1, 2, 2, 3]) == {1, 2, 3}
                assert candidate([]) == set()
                assert candidate([(1, 2), (1, 2)]) == {(1, 2)}
            """),
    },
    {
        "task_id": "Set/3",
        "entry_point": "safe_div",
        "prompt": _d('''
            def safe_div(a: float, b: float) -> float:
                """a / b; for b == 0: inf or -inf by the sign of a, nan when a is 0 too."""
            '''),
        "test": _d("""
            import math

            def check(candidate):
                assert abs(candidate(1, 4) - 0.25) < 1e-12
                assert candidate(1, 0) == math.inf
                assert candidate(-3, 0) == -math.inf
                assert math.isnan(candidate(0, 0))
            """),
    },
    {
        "task_id": "Set/4",
        "entry_point": "parse_positive",
        "prompt": _d('''
            def parse_positive(text: str) -> int:
                """The positive integer written in text; ValueError if it is not one."""
            '''),
        "test": _d("""
            def check(candidate):
                assert candidate("42") == 42
                for bad in ("0", "-3", "x"):
                    try:
                        candidate(bad)
                    except ValueError:
                        pass
                    else:
                        assert False, f"no ValueError for {bad!r}"
            """),
    },
    {
        "task_id": "Set/5",
        "entry_point": "count_vowels",
        "prompt": _d('''
            def is_vowel(c: str) -> bool:
                return c.lower() in "aeiou"


            def count_vowels(s: str) -> int:
                """How many characters of s are vowels (a, e, i, o, u; either case)."""
            '''),
        "test": _d("""
            def check(candidate):
                for s in ("hello", "AEIOU", "rhythm", "Yay", ""):
                    assert candidate(s) == sum(map(is_vowel, s)), s
            """),
    },
    {
        "task_id": "Set/6",
        "entry_point": "reversed_bytes",
        "prompt": _d('''
            def reversed_bytes(s: str) -> bytes:
                """The UTF-8 encoding of s, bytes in reverse order."""
            '''),
        "test": _d("""
            def check(candidate):
                assert candidate("ab") == b"ba"
                assert candidate("") == b""
            """),
    },
    {
        "task_id": "Set/7",
        "entry_point": "length_counts",
        "prompt": _d('''
            def length_counts(words: list) -> dict:
                """How many words there are of each length: {length: count}."""
            '''),
        "test": _d("""
            def check(candidate):
                assert candidate(["a", "bb", "cc"]) == {1: 1, 2: 2}
                assert candidate([]) == {}
            """),
    },
]

_CANONICAL = {
    "Set/0": "    return a + b\n",
    "Set/1": "    return (min(xs), max(xs))\n",
    "Set/2": "    return set(xs)\n",
    "Set/3": _d("""
            if b == 0:
                return float("nan") if a == 0 else (float("inf") if a > 0 else float("-inf"))
            return a / b
        """)
    .replace("\n", "\n    ")
    .rstrip(" ")
    .join(["    ", ""]),
    "Set/4": _d("""
            value = int(text)
            if value <= 0:
                raise ValueError(text)
            return value
        """)
    .replace("\n", "\n    ")
    .rstrip(" ")
    .join(["    ", ""]),
    "Set/5": "    return sum(1 for c in s if is_vowel(c))\n",
    "Set/6": '    return s.encode("utf-8")[::-1]\n',
    "Set/7": _d("""
            out = {}
            for w in words:
                out[len(w)] = out.get(len(w), 0) + 1
            return out
        """)
    .replace("\n", "\n    ")
    .rstrip(" ")
    .join(["    ", ""]),
}

_WRONG = {
    "Set/0": "    return a - b\n",
    "Set/1": "    return [min(xs), max(xs)]\n",  # a list is not the tuple asked for
    "Set/2": "    return sorted(set(xs))\n",
    "Set/3": "    return a / b if b else 0.0\n",
    "Set/4": "    return int(text) if int(text) > 0 else -1\n",
    "Set/5": '    return sum(1 for c in s if c.lower() in "aeiouy")\n',
    "Set/6": "    return s[::-1]\n",
    "Set/7": "    return {str(len(w)): 1 for w in words}\n",
}


def _h(body: str) -> str:
    """A hostile completion of ``add``: its body, indented, continuing the prompt."""
    return textwrap.indent(_d(body), "    ")


# Each hostile completion computes a wrong sum (or none) and attacks the evaluation.
_HOSTILE: list[tuple[str, str, frozenset[str]]] = [
    (
        "forges-an-always-equal-result",
        _h("""
            class Yes(int):
                def __eq__(self, other):
                    return True
                __hash__ = int.__hash__
            class Anything:
                def __eq__(self, other):
                    return True
            return Anything() if a < 0 else Yes(-1)
            """),
        frozenset({"failed"}),
    ),
    (
        "forges-replies-on-its-pipes",
        _h("""
            import os
            for fd in range(3, 20):
                try:
                    os.write(fd, b'{"ready": true}\\n{"n": 0, "value": 3}\\n')
                    os.write(fd, b'{"verdict": "passed"}\\n')
                except OSError:
                    pass
            return a - b
            """),
        frozenset({"failed", "error"}),
    ),
    (
        "forges-the-harness-result-list",
        _h("""
            import gc, os
            for o in gc.get_objects():
                if type(o) is list and not o:
                    o.append("passed")
                elif type(o) is dict and "passed" in o:
                    o["passed"] = True
            os._exit(0)
            """),
        frozenset({"error"}),
    ),
    ("system-exit-in-the-function", _h("raise SystemExit(0)\n"), frozenset({"failed"})),
    ("sys-exit-in-the-function", _h("import sys\nsys.exit(0)\n"), frozenset({"failed"})),
    ("os-exit-in-the-function", _h("import os\nos._exit(0)\n"), frozenset({"error"})),
    (
        "system-exit-at-load",
        "    return a - b\n\nraise SystemExit(0)\n",
        frozenset({"error"}),
    ),
    ("os-exit-at-load", "    return a - b\n\nimport os\nos._exit(0)\n", frozenset({"error"})),
    (
        "setsid-double-fork-daemon",
        _h(f"""
            import os, time
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    try:
                        with open("daemon-was-here", "w") as f:
                            f.write("{DAEMON_MARK}")
                    except OSError:
                        pass
                    time.sleep(600)
                os._exit(0)
            return a - b
            """),
        frozenset({"failed"}),
    ),
    (
        "fork-bomb",
        _h("""
            import os
            for _ in range(8):
                try:
                    os.fork()
                except OSError:
                    break
            return a - b
            """),
        frozenset({"failed", "error"}),
    ),
    (
        "eats-memory",
        _h("""
            hog = []
            while True:
                hog.append(bytearray(32 << 20))
            """),
        frozenset({"failed", "error"}),
    ),
    (
        "getframe-walks-to-the-checker",
        _h("""
            import sys
            frame = sys._getframe()
            while frame is not None:
                for scope in (frame.f_globals, frame.f_locals):
                    for name in list(scope):
                        if name in ("check", "candidate", "verdict", "expected"):
                            try:
                                scope[name] = lambda *args, **kwargs: True
                            except Exception:
                                pass
                frame = frame.f_back
            return a - b
            """),
        frozenset({"failed"}),
    ),
    (
        "patches-builtins",
        _h("""
            import builtins
            builtins.AssertionError = type("AssertionError", (Exception,), {})
            builtins.isinstance = lambda *args: True
            builtins.abs = lambda x: 0
            return a - b
            """),
        frozenset({"failed", "error"}),
    ),
    (
        "writes-outside-its-directory",
        _h(f"""
            try:
                with open("{ESCAPE_FILE}", "w") as f:
                    f.write("escaped")
            except OSError:
                pass
            return a - b
            """),
        frozenset({"failed"}),
    ),
    ("sleeps-forever", _h("import time\ntime.sleep(600)\n"), frozenset({"timeout"})),
]

#: Correct, and it forks: the harness's guard (which replaces os.fork) fails it.
_FORKS_CORRECTLY = _h("""
    import os
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, str(a + b).encode())
        os._exit(0)
    os.close(w)
    answer = b""
    while chunk := os.read(r, 100):
        answer += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return int(answer)
    """)

SAMPLES: list[tuple[str, str, str, str, frozenset[str]]] = [
    *[("canonical", "ref", t, c, frozenset({"passed"})) for t, c in _CANONICAL.items()],
    *[("wrong", "wrong", t, c, frozenset({"failed"})) for t, c in _WRONG.items()],
    *[("hostile", name, "Set/0", c, expect) for name, c, expect in _HOSTILE],
    ("canonical", "uses-os-fork", "Set/0", _FORKS_CORRECTLY, frozenset({"passed"})),
]


def write(directory: Path, samples: list[Any] | None = None) -> tuple[Path, Path]:
    """Write problems.jsonl and samples.jsonl (``samples``: default every one of
    :data:`SAMPLES`) into ``directory``; their paths."""
    problems = directory / "problems.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS), encoding="utf-8")
    path = directory / "samples.jsonl"
    chosen = SAMPLES if samples is None else samples
    path.write_text(
        "".join(json.dumps({"task_id": s[2], "completion": s[3]}) + "\n" for s in chosen),
        encoding="utf-8",
    )
    return problems, path
