"""Twelve small problems, HumanEval style: a prompt (signature and docstring) and reference tests.

Written for this example. Each test is plain data: the arguments of one call and the value it
must return, compared in the worker (see :func:`same`). The completion under test never sees
this module: it runs in a child process that may not read it (``docs/codeeval.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ("PROBLEMS", "Problem", "same")

Compare = Literal["exact", "close"]


@dataclass(frozen=True)
class Problem:
    """One problem: the function to write, its prompt, and the tests that score it."""

    id: str
    entry: str
    """The name of the function a completion must define."""
    prompt: str
    """What a model is given: the signature and the docstring."""
    tests: tuple[tuple[tuple[Any, ...], Any], ...]
    """(arguments, expected value) pairs; arguments and values are JSON data."""
    compare: Compare = "exact"
    """``exact``: equal as JSON data; ``close``: numbers within 1e-9 (relative or absolute)."""


def same(got: Any, expected: Any, compare: Compare = "exact") -> bool:
    """Whether ``got`` (decoded JSON from the child) equals ``expected``.

    Strict about kinds: a bool is not a number, a list is not a string; numbers compare by
    value (``3 == 3.0``), or within 1e-9 with ``close``. Both sides are plain data here, so no
    ``__eq__`` of the completion's ever runs.
    """
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, (int, float)):
        if not isinstance(got, (int, float)):
            return False
        if compare == "close":
            return math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9)
        return got == expected
    if expected is None or isinstance(expected, str):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, (list, tuple)):
        return (
            isinstance(got, list)
            and len(got) == len(expected)
            and all(same(g, e, compare) for g, e in zip(got, expected, strict=True))
        )
    if isinstance(expected, dict):
        return (
            isinstance(got, dict)
            and got.keys() == expected.keys()
            and all(same(got[k], expected[k], compare) for k in expected)
        )
    raise TypeError(f"an expected value must be JSON data, not {type(expected).__name__}")


def _p(
    id: str,
    entry: str,
    prompt: str,
    *tests: tuple[tuple[Any, ...], Any],
    compare: Compare = "exact",
) -> Problem:
    return Problem(id, entry, prompt.strip("\n") + "\n", tuple(tests), compare)


PROBLEMS: dict[str, Problem] = {
    p.id: p
    for p in (
        _p(
            "sum_even",
            "sum_even",
            '''
def sum_even(numbers: list[int]) -> int:
    """The sum of the even numbers in the list (0 for none)."""
''',
            (([1, 2, 3, 4],), 6),
            (([],), 0),
            (([1, 3, 5],), 0),
            (([-2, -3, 8],), 6),
            (([0, 0, 7, 10],), 10),
        ),
        _p(
            "reverse_words",
            "reverse_words",
            '''
def reverse_words(sentence: str) -> str:
    """The words of the sentence in reverse order, joined by single spaces.
    Runs of whitespace separate words; leading and trailing whitespace is dropped."""
''',
            (("hello world",), "world hello"),
            (("  one   two three ",), "three two one"),
            (("single",), "single"),
            (("",), ""),
        ),
        _p(
            "palindrome",
            "is_palindrome",
            '''
def is_palindrome(text: str) -> bool:
    """Whether the text reads the same both ways, counting only letters and digits and
    ignoring case."""
''',
            (("A man, a plan, a canal: Panama",), True),
            (("racecar",), True),
            (("rac ecar!",), True),
            (("palindrome",), False),
            (("",), True),
            (("ab",), False),
        ),
        _p(
            "run_length",
            "run_length",
            '''
def run_length(text: str) -> str:
    """Run-length encoding: each run of one character becomes that character and the run's
    length. run_length("aaab") == "a3b1"."""
''',
            (("aaab",), "a3b1"),
            (("",), ""),
            (("abc",), "a1b1c1"),
            (("zzzzzzzzzzzz",), "z12"),
            (("aabbaa",), "a2b2a2"),
        ),
        _p(
            "second_largest",
            "second_largest",
            '''
def second_largest(numbers: list[int]) -> int | None:
    """The second largest distinct value, or None if there are fewer than two."""
''',
            (([3, 1, 4, 1, 5],), 4),
            (([7, 7, 7],), None),
            (([],), None),
            (([-1, -5],), -5),
            (([10, 9, 10, 8],), 9),
        ),
        _p(
            "balanced",
            "balanced",
            '''
def balanced(text: str) -> bool:
    """Whether the brackets ()[]{} in the text are balanced and properly nested; other
    characters are ignored."""
''',
            (("([]{})",), True),
            (("(]",), False),
            (("((",), False),
            (("a(b[c]d)e",), True),
            (("",), True),
            (("}{",), False),
            (("([)]",), False),
        ),
        _p(
            "count_vowels",
            "count_vowels",
            '''
def count_vowels(word: str) -> int:
    """How many of the word's letters are vowels (a, e, i, o, u, either case)."""
''',
            (("banana",), 3),
            (("RHYTHM",), 0),
            (("AeIoU",), 5),
            (("",), 0),
        ),
        _p(
            "fizzbuzz",
            "fizzbuzz",
            '''
def fizzbuzz(n: int) -> list[str]:
    """For 1..n: "Fizz" for multiples of 3, "Buzz" for multiples of 5, "FizzBuzz" for
    both, otherwise the number as text."""
''',
            ((5,), ["1", "2", "Fizz", "4", "Buzz"]),
            ((0,), []),
            (
                (15,),
                [
                    *("1", "2", "Fizz", "4", "Buzz", "Fizz", "7", "8", "Fizz", "Buzz"),
                    *("11", "Fizz", "13", "14", "FizzBuzz"),
                ],
            ),
        ),
        _p(
            "merge_intervals",
            "merge_intervals",
            '''
def merge_intervals(intervals: list[list[int]]) -> list[list[int]]:
    """Merge overlapping or touching closed intervals [start, end]; the result is sorted by
    start."""
''',
            (([[1, 3], [2, 6], [8, 10]],), [[1, 6], [8, 10]]),
            (([[5, 6], [1, 2], [2, 4]],), [[1, 4], [5, 6]]),
            (([],), []),
            (([[1, 10], [2, 3]],), [[1, 10]]),
        ),
        _p(
            "mean",
            "mean",
            '''
def mean(values: list[float]) -> float:
    """The arithmetic mean of a non-empty list of numbers."""
''',
            (([1, 2, 3, 4],), 2.5),
            (([0.1, 0.2, 0.3],), 0.2),
            (([-5],), -5.0),
            (([1e9, 1, -1e9],), 1 / 3),
            compare="close",
        ),
        _p(
            "digit_root",
            "digit_root",
            '''
def digit_root(n: int) -> int:
    """Sum the decimal digits of n >= 0, again and again, until one digit is left."""
''',
            ((0,), 0),
            ((9,), 9),
            ((38,), 2),
            ((123456789,), 9),
            ((10,), 1),
        ),
        _p(
            "rotate",
            "rotate",
            '''
def rotate(items: list, k: int) -> list:
    """The list rotated k places to the right (k may be larger than the length, or
    negative: to the left)."""
''',
            (([1, 2, 3, 4, 5], 2), [4, 5, 1, 2, 3]),
            (([1, 2, 3], 0), [1, 2, 3]),
            (([1, 2, 3], 4), [3, 1, 2]),
            (([1, 2, 3], -1), [2, 3, 1]),
            (([], 3), []),
        ),
    )
}
