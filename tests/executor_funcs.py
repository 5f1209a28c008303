"""Module-level functions the tests of ``toolpool.Executor`` run in workers (imported there
by module and qualified name, as any user's functions are)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any


def mul(x: int, y: int) -> int:
    return x * y


def capture(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, kwargs


def sleep_and_raise(seconds: float) -> None:
    time.sleep(seconds)
    raise Exception("this is an exception")


def sleep_and_print(seconds: float, text: str) -> None:
    time.sleep(seconds)
    print(text, flush=True)


def raise_runtime_error() -> None:
    raise RuntimeError(123)  # some comment


def raise_system_exit() -> None:
    raise SystemExit(3)


def exit_worker() -> None:
    os._exit(7)


def sleep_deaf(seconds: float) -> int:
    """Sleep, and return this worker's pid (a plain function never sees a cancel)."""
    time.sleep(seconds)
    return os.getpid()


def started_then_sleep(path: str, seconds: float) -> int:
    """Create ``path`` (the test's sign that the function runs), then :func:`sleep_deaf`."""
    with open(path, "w"):
        pass
    return sleep_deaf(seconds)


def unpicklable_result() -> object:
    return threading.Lock()


async def async_mul(x: int, y: int) -> int:
    return x * y


class MyObject:
    def my_method(self) -> None:
        pass

    @classmethod
    def make(cls, n: int) -> int:
        return n + 1


def make_dummy_object(_: object) -> MyObject:
    return MyObject()


class LockHolder:
    def __init__(self) -> None:
        self.lock = threading.Lock()

    def method(self) -> int:
        return 1


class Point:
    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)

    __hash__ = None  # type: ignore[assignment]


def swap(point: Point) -> Point:
    return Point(point.y, point.x)


class OddError(Exception):
    """An exception that does not unpickle (its __init__ takes two arguments)."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a} and {b}")


def raise_odd() -> None:
    raise OddError(1, 2)


def redefined() -> int:
    return 1


shadowed = redefined  # its name now names another function:


def redefined() -> int:  # type: ignore[no-redef]
    return 2


def pid_of(_: object) -> int:
    return os.getpid()
