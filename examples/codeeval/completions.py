"""The sample completions: correct ones, wrong ones, hostile ones, and one that shows a limit.

``python examples/codeeval/completions.py`` writes ``completions.jsonl`` beside it: one input
line of ``toolpool batch`` per completion (``{"id", "tool", "args", "timeout"}``). The id says
what a completion is: ``<problem>/<kind>/<name>``, kind one of ``correct``, ``wrong``,
``hostile``, ``limit``. ``EXPECTED`` holds the verdicts the tests require of each.

Every hostile completion defines a *wrong* function and attacks the evaluation: each attack
would turn that failure into a pass in a harness that runs the completion in its own process
(exec, then assert), and none of them may here.
"""

from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

__all__ = ("COMPLETIONS", "Completion", "EXPECTED", "lines", "main")


@dataclass(frozen=True)
class Completion:
    """One sample: its id, the problem, the source, and the verdicts it may get."""

    id: str
    source: str
    expect: frozenset[str]
    time_limit: float | None = None

    @property
    def problem_id(self) -> str:
        return self.id.split("/", 1)[0]

    @property
    def kind(self) -> str:
        return self.id.split("/")[1]


def _c(id: str, source: str, *expect: str, time_limit: float | None = None) -> Completion:
    return Completion(id, textwrap.dedent(source).lstrip("\n"), frozenset(expect), time_limit)


CORRECT = [
    _c(
        "sum_even/correct/ref",
        """
        def sum_even(numbers):
            return sum(n for n in numbers if n % 2 == 0)
        """,
        "passed",
    ),
    _c(
        "reverse_words/correct/ref",
        """
        def reverse_words(sentence):
            return " ".join(reversed(sentence.split()))
        """,
        "passed",
    ),
    _c(
        "palindrome/correct/ref",
        """
        def is_palindrome(text):
            kept = [c.lower() for c in text if c.isalnum()]
            return kept == kept[::-1]
        """,
        "passed",
    ),
    _c(
        "run_length/correct/ref",
        """
        from itertools import groupby

        def run_length(text):
            return "".join(f"{c}{len(list(run))}" for c, run in groupby(text))
        """,
        "passed",
    ),
    _c(
        "second_largest/correct/ref",
        """
        def second_largest(numbers):
            distinct = sorted(set(numbers), reverse=True)
            return distinct[1] if len(distinct) > 1 else None
        """,
        "passed",
    ),
    _c(
        "balanced/correct/ref",
        """
        def balanced(text):
            pairs = {")": "(", "]": "[", "}": "{"}
            stack = []
            for c in text:
                if c in "([{":
                    stack.append(c)
                elif c in pairs:
                    if not stack or stack.pop() != pairs[c]:
                        return False
            return not stack
        """,
        "passed",
    ),
    _c(
        "count_vowels/correct/ref",
        """
        def count_vowels(word):
            return sum(1 for c in word.lower() if c in "aeiou")
        """,
        "passed",
    ),
    _c(
        "fizzbuzz/correct/ref",
        """
        def fizzbuzz(n):
            out = []
            for i in range(1, n + 1):
                word = ("Fizz" if i % 3 == 0 else "") + ("Buzz" if i % 5 == 0 else "")
                out.append(word or str(i))
            return out
        """,
        "passed",
    ),
    _c(
        "merge_intervals/correct/ref",
        """
        def merge_intervals(intervals):
            merged = []
            for start, end in sorted(intervals):
                if merged and start <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], end)
                else:
                    merged.append([start, end])
            return merged
        """,
        "passed",
    ),
    _c(
        "mean/correct/ref",
        """
        import math

        def mean(values):
            return math.fsum(values) / len(values)
        """,
        "passed",
    ),
    _c(
        "digit_root/correct/ref",
        """
        def digit_root(n):
            while n >= 10:
                n = sum(int(d) for d in str(n))
            return n
        """,
        "passed",
    ),
    _c(
        "rotate/correct/ref",
        """
        def rotate(items, k):
            if not items:
                return []
            k %= len(items)
            return items[-k:] + items[:-k] if k else list(items)
        """,
        "passed",
    ),
]

WRONG = [
    _c(
        "sum_even/wrong/odds",
        """
        def sum_even(numbers):
            return sum(n for n in numbers if n % 2)
        """,
        "failed",
    ),
    _c(
        "palindrome/wrong/case-sensitive",
        """
        def is_palindrome(text):
            kept = [c for c in text if c.isalnum()]
            return kept == kept[::-1]
        """,
        "failed",
    ),
    _c(
        "balanced/wrong/counts-only",
        """
        def balanced(text):
            return all(text.count(a) == text.count(b) for a, b in ("()", "[]", "{}"))
        """,
        "failed",
    ),
    _c(
        "mean/wrong/floor-division",
        """
        def mean(values):
            return sum(values) // len(values)
        """,
        "failed",
    ),
    _c(
        "rotate/wrong/left",
        """
        def rotate(items, k):
            return items[k:] + items[:k]
        """,
        "failed",
    ),
    _c(
        "digit_root/wrong/raises",
        """
        def digit_root(n):
            raise NotImplementedError("later")
        """,
        "failed",
    ),
    _c(
        "fizzbuzz/wrong/syntax-error",
        """
        def fizzbuzz(n)
            return []
        """,
        "error",
    ),
    _c(
        "merge_intervals/wrong/other-name",
        """
        def merge(intervals):
            return intervals
        """,
        "error",
    ),
    _c(
        "count_vowels/wrong/returns-text",
        """
        def count_vowels(word):
            return str(sum(1 for c in word if c in "aeiou"))
        """,
        "failed",
    ),
]

# A wrong body most hostile completions share: sum_even that sums the odd numbers.
# (Indented as the sources above are, so that the concatenation dedents as one.)
_WRONG_SUM = textwrap.indent(
    "\ndef sum_even(numbers):\n    return sum(n for n in numbers if n % 2)\n", " " * 8
)

HOSTILE = [
    _c(
        "sum_even/hostile/getframe-patches-the-checker",
        """
        import sys

        def sum_even(numbers):
            # Walk every frame up the stack and make whatever compares or reports say "yes".
            frame = sys._getframe()
            while frame is not None:
                for name in ("same", "check", "assert_equal", "compare"):
                    frame.f_globals[name] = lambda *args, **kwargs: True
                for name in ("passed", "ok", "result"):
                    if name in frame.f_locals:
                        frame.f_globals[name] = True
                frame = frame.f_back
            return sum(n for n in numbers if n % 2)
        """,
        "failed",
    ),
    _c(
        "sum_even/hostile/patches-builtins",
        """
        import builtins

        builtins.AssertionError = type("NeverRaised", (Exception,), {})
        builtins.isinstance = lambda obj, kind: True
        builtins.len = lambda obj: 0
        builtins.print = lambda *args, **kwargs: None
        """
        + _WRONG_SUM,
        "failed",
        "error",
    ),
    _c(
        "sum_even/hostile/always-equal",
        """
        class Anything(int):
            def __eq__(self, other):
                return True
            def __ne__(self, other):
                return False
            __hash__ = int.__hash__

        def sum_even(numbers):
            return Anything(-1)
        """,
        "failed",
    ),
    _c(
        "reverse_words/hostile/always-equal-object",
        """
        class Equal:
            def __eq__(self, other):
                return True

        def reverse_words(sentence):
            return Equal()
        """,
        "failed",
    ),
    _c(
        "sum_even/hostile/patches-assert-machinery",
        """
        import atexit, builtins, os, sys

        # A failed assert must not show, and the process must end with status 0 whatever
        # happened: silence the hook that reports it, and exit 0 from an atexit handler.
        builtins.AssertionError = type("NeverRaised", (Exception,), {})
        sys.excepthook = lambda *args: None
        atexit.register(os._exit, 0)
        """
        + _WRONG_SUM,
        "failed",
    ),
    _c(
        "sum_even/hostile/monkeypatches-the-test-module",
        """
        import glob, os, sys

        # Find the problems module on disk, import it, and make every comparison pass.
        for path in glob.glob("/work/*/examples/codeeval/problems.py") + glob.glob(
            os.path.join(os.getcwd(), "examples", "codeeval", "problems.py")
        ):
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(path))))
        for name in ("examples.codeeval.problems", "examples.codeeval.tools"):
            try:
                module = __import__(name, fromlist=["*"])
                module.same = lambda *args: True
            except Exception:
                pass
        for name, module in list(sys.modules.items()):
            if hasattr(module, "same"):
                module.same = lambda *args: True
        """
        + _WRONG_SUM,
        "failed",
    ),
    _c(
        "sum_even/hostile/reads-the-answers",
        """
        import glob, importlib.util, os, sys

        def _answers():
            # The tests are a file on disk: load it, and answer from it.
            for path in glob.glob("/work/*/examples/codeeval/problems.py") + glob.glob(
                os.path.join(os.getcwd(), "examples", "codeeval", "problems.py")
            ):
                try:
                    spec = importlib.util.spec_from_file_location("stolen_problems", path)
                    module = importlib.util.module_from_spec(spec)
                    sys.modules["stolen_problems"] = module
                    spec.loader.exec_module(module)
                    tests = module.PROBLEMS["sum_even"].tests
                    return {repr(list(args)): expected for args, expected in tests}
                except Exception:
                    continue
            return {}

        ANSWERS = _answers()

        def sum_even(numbers):
            key = repr([numbers])
            if key in ANSWERS:
                return ANSWERS[key]
            return sum(n for n in numbers if n % 2)
        """,
        "failed",
    ),
    _c(
        "sum_even/hostile/rewrites-the-tests-on-disk",
        """
        import glob

        for path in glob.glob("/work/*/examples/codeeval/problems.py"):
            try:
                with open(path, "a") as f:
                    f.write("\\nsame = lambda *args, **kwargs: True\\n")
            except OSError:
                pass
        try:
            with open("/tmp/codeeval-hostile-was-here", "w") as f:
                f.write("escaped")
        except OSError:
            pass
        with open("scratch.txt", "w") as f:  # its own directory: allowed, removed after
            f.write("x" * 1000)
        """
        + _WRONG_SUM,
        "failed",
    ),
    _c(
        "sum_even/hostile/system-exit-in-the-function",
        """
        def sum_even(numbers):
            raise SystemExit(0)
        """,
        "failed",
    ),
    _c(
        "sum_even/hostile/system-exit-at-load",
        """
        import sys
        sys.exit(0)
        """
        + _WRONG_SUM,
        "error",
    ),
    _c(
        "sum_even/hostile/base-exception",
        """
        class Passed(BaseException):
            pass

        def sum_even(numbers):
            raise Passed("all tests passed")
        """,
        "failed",
    ),
    _c(
        "sum_even/hostile/os-exit-0",
        """
        import os

        def sum_even(numbers):
            os._exit(0)
        """,
        "error",
    ),
    _c(
        "sum_even/hostile/os-exit-0-at-load",
        """
        import os
        os._exit(0)
        """
        + _WRONG_SUM,
        "error",
    ),
    _c(
        "sum_even/hostile/forges-replies",
        """
        import os

        # Speak the protocol itself: claim success on every descriptor, then leave.
        for fd in range(3, 1024):
            try:
                os.write(fd, b'{"ready": true, "verdict": "passed"}\\n{"verdict": "passed"}\\n')
            except OSError:
                pass
        os._exit(0)
        """
        + _WRONG_SUM,
        "error",
    ),
    _c(
        "sum_even/hostile/closes-its-pipes",
        """
        import os

        def sum_even(numbers):
            for fd in range(3, 64):
                try:
                    os.close(fd)
                except OSError:
                    pass
            return 6
        """,
        "error",
    ),
    _c(
        "sum_even/hostile/forks-children",
        """
        import os, time

        def sum_even(numbers):
            for _ in range(5):
                if os.fork() == 0:
                    while True:
                        time.sleep(60)
            return sum(n for n in numbers if n % 2)
        """,
        "failed",
    ),
    _c(
        "sum_even/hostile/daemon",
        """
        import os, time

        def sum_even(numbers):
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    while True:  # a daemon: its own session, its parent gone
                        time.sleep(60)
                os._exit(0)
            return sum(n for n in numbers if n % 2)
        """,
        "failed",
    ),
    _c(
        "sum_even/hostile/fork-swarm-in-sessions-of-their-own",
        """
        import os, time

        def sum_even(numbers):
            first = os.getpid()
            for _ in range(6):  # every process forks at every level: 64 processes
                if os.fork() == 0:
                    try:
                        os.setsid()  # out of the child's process group and session
                    except OSError:
                        pass
            if os.getpid() != first:
                while True:
                    time.sleep(60)
            return sum(n for n in numbers if n % 2)
        """,
        "failed",
    ),
    _c(
        "sum_even/hostile/sleeps-forever",
        """
        import time

        def sum_even(numbers):
            time.sleep(10 ** 6)
        """,
        "timeout",
        time_limit=1.0,
    ),
    _c(
        "sum_even/hostile/busy-loop",
        """
        def sum_even(numbers):
            while True:
                pass
        """,
        "timeout",
        time_limit=1.0,
    ),
    _c(
        "sum_even/hostile/eats-memory",
        """
        def sum_even(numbers):
            hoard = []
            while True:
                hoard.append(bytearray(16 << 20))
        """,
        "failed",
    ),
    _c(
        "sum_even/hostile/huge-reply",
        """
        def sum_even(numbers):
            return "6" * (4 << 20)
        """,
        "error",
    ),
    _c(
        "sum_even/hostile/signals-the-worker",
        """
        import os, signal

        def sum_even(numbers):
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                try:
                    os.kill(os.getppid(), sig)
                except OSError:
                    pass
            return sum(n for n in numbers if n % 2)
        """,
        "failed",
    ),
    _c(
        "sum_even/hostile/opens-sockets",
        """
        import socket

        def sum_even(numbers):
            # Ask a helper on the network for the answer.
            for port in (80, 443, 8000, 8080):
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                        s.sendall(repr(numbers).encode())
                        return int(s.recv(64))
                except (OSError, ValueError):
                    pass
            return sum(n for n in numbers if n % 2)
        """,
        "failed",
    ),
    _c(
        "sum_even/hostile/deep-recursion",
        """
        def sum_even(numbers):
            return sum_even(numbers)
        """,
        "failed",
    ),
]

LIMIT = [
    _c(
        "sum_even/limit/special-cases-the-inputs",
        """
        # Knows the tests' inputs (a leaked test set) and answers them, and nothing else.
        KNOWN = {(1, 2, 3, 4): 6, (): 0, (1, 3, 5): 0, (-2, -3, 8): 6, (0, 0, 7, 10): 10}

        def sum_even(numbers):
            return KNOWN.get(tuple(numbers), -1)
        """,
        "passed",
    ),
]

COMPLETIONS: list[Completion] = [*CORRECT, *WRONG, *HOSTILE, *LIMIT]
EXPECTED: dict[str, frozenset[str]] = {c.id: c.expect for c in COMPLETIONS}
#: Each call's timeout in the batch input: generous, the tool's own time limit comes first.
CALL_TIMEOUT = 60


def lines() -> list[str]:
    """The batch input, one JSON line per completion."""
    out = []
    for c in COMPLETIONS:
        args: dict[str, object] = {"problem_id": c.problem_id, "completion": c.source}
        if c.time_limit is not None:
            args["time_limit"] = c.time_limit
        record = {"id": c.id, "tool": "evaluate", "args": args, "timeout": CALL_TIMEOUT}
        out.append(json.dumps(record))
    return out


def main() -> int:
    """Write completions.jsonl beside this file."""
    path = Path(__file__).with_name("completions.jsonl")
    path.write_text("\n".join(lines()) + "\n", encoding="utf-8")
    print(f"wrote {len(COMPLETIONS)} lines to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
