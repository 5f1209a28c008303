"""Code evaluation, HumanEval style: the tools module ``examples.codeeval.tools:registry``.

``evaluate(problem_id, completion)`` runs a completion (model-written source code defining one
function) against the reference tests of one of the problems in :mod:`.problems` and returns a
verdict: ``passed``, ``failed`` (with the test that failed and why), ``error`` (the completion
did not load, or its process died or broke the protocol) or ``timeout``.

The verdict is decided here, in the tool body, where the completion cannot reach. The
completion runs in a child process of the tool (``runner.py``: its own session, rlimits, no
capabilities, Landlock: it can read only the interpreter's library and write only a directory
of its own). The tool calls the completion's function through a pipe: arguments and return
values cross as JSON text, decoded here into plain data and compared here. Nothing of the
child's is ever unpickled, evaluated or compared with its own ``__eq__``. When the evaluation
ends, however it ends, the child and every process it started are killed and reaped before the
tool returns (with ``toolpool eval``'s own loop, shared). See ``docs/codeeval.md`` for the
design and its limits, and ``docs/eval.md`` for ``toolpool eval``, the product this example
led to.

Run it through ``toolpool batch --profile untrusted`` (from the repository's root)::

    toolpool batch examples.codeeval.tools:registry examples/codeeval/completions.jsonl \
        -o verdicts.jsonl --profile untrusted
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal, TypedDict, cast

import toolpool
from toolpool import ToolExecution
from toolpool.eval._zygote import Wake, below, kill_new_processes

from .problems import PROBLEMS, Problem, same

__all__ = ("MAX_REPLY", "RUNNER", "Verdict", "evaluate", "problems", "registry")

registry = toolpool.Registry()

#: The child's program (never imported: it runs as ``python -I -S -c RUNNER``).
RUNNER = (Path(__file__).with_name("runner.py")).read_text(encoding="utf-8")
#: The longest line the child may send; a longer one is a protocol error (bounded memory here).
MAX_REPLY = 1 << 20
#: Limits of the child process (rlimits it sets on itself before the completion runs).
CHILD_MEMORY = 256 << 20  # address space
CHILD_FILE_SIZE = 1 << 20
CHILD_OPEN_FILES = 64
_HERE = Path(__file__).resolve().parent

VerdictName = Literal["passed", "failed", "error", "timeout"]


class Verdict(TypedDict):
    """What :func:`evaluate` returns (a plain dict on the wire)."""

    problem_id: str
    verdict: VerdictName
    tests: int
    """How many tests the problem has."""
    tests_passed: int
    """How many passed before the evaluation ended."""
    failed_test: int | None
    """The index of the test that failed, errored or timed out; None if none did."""
    call: str | None
    """That test's call, e.g. ``sum_even([1, 2, 3, 4])``."""
    expected: str | None
    got: str | None
    """The value the completion returned (its repr, cut at 200 characters), if it returned."""
    detail: str
    jail: list[str]
    """What the child process was confined by, as it reported before the completion ran."""
    directory_removed: bool
    """Whether the child's working directory could be removed (else the pool's scratch
    clean-up removes it with the worker)."""


class _TimedOut(Exception):
    pass


class _Cancelled(Exception):
    pass


class _Broken(Exception):
    """The child died, closed its pipe, or sent something that is not a valid reply."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _call_text(problem: Problem, args: tuple[Any, ...]) -> str:
    return f"{problem.entry}({', '.join(_show(a) for a in args)})"


class _Child:
    """The child process running one completion, and the two pipes to it."""

    def __init__(self, directory: str, wake: int) -> None:
        self._buffer = bytearray()
        self._wake = wake
        self.jail: list[str] = []
        """What the child reported it is confined by (set once it has)."""
        self.before = set(below(os.getpid()))
        request_r, self._request = os.pipe()
        self._reply, reply_w = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", RUNNER, str(request_r), str(reply_w)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(request_r, reply_w),
                cwd=directory,
                env={},
                start_new_session=True,
            )
        except BaseException:
            for fd in (self._request, self._reply):
                os.close(fd)
            raise
        finally:
            os.close(request_r)
            os.close(reply_w)
        os.set_blocking(self._request, False)
        self._poll = select.poll()
        self._poll.register(self._reply, select.POLLIN)
        self._poll.register(self._wake, select.POLLIN)

    def send(self, message: dict[str, Any], deadline: float) -> None:
        data = memoryview((json.dumps(message) + "\n").encode())
        out = select.poll()
        out.register(self._request, select.POLLOUT)
        out.register(self._wake, select.POLLIN)
        while data:
            events = dict(out.poll(_wait(deadline)))
            if self._wake in events:
                raise _Cancelled
            if self._request in events:
                try:
                    data = data[os.write(self._request, data) :]
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    raise _Broken(self._ended("closed its end of the pipe")) from None
            elif not events and time.monotonic() >= deadline:
                raise _TimedOut

    def receive(self, deadline: float) -> dict[str, Any]:
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return _decode(line)
            if len(self._buffer) > MAX_REPLY:
                raise _Broken(f"sent a line of over {MAX_REPLY:,} bytes")
            events = dict(self._poll.poll(_wait(deadline)))
            if self._wake in events:
                raise _Cancelled
            if self._reply in events:
                chunk = os.read(self._reply, 1 << 16)
                if not chunk:
                    raise _Broken(self._ended("closed its end of the pipe"))
                self._buffer += chunk
            elif time.monotonic() >= deadline:
                raise _TimedOut

    def _ended(self, otherwise: str) -> str:
        """How the child ended, once its pipe closed (a moment for it to exit)."""
        try:
            code = self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return f"{otherwise} (still running)"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with status {code}"

    def close(self) -> None:
        """Kill the child and everything it started; reap them all; close the pipes."""
        for fd in (self._request, self._reply):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its session's group, in one go
        except (ProcessLookupError, PermissionError):
            pass
        self.process.kill()  # (in case it left that group: a no-op if it is dead already)
        self.process.wait()
        # What left its session (setsid, double forks): reparented to the worker, a child
        # subreaper in a pool; killed and reaped with toolpool eval's own loop.
        kill_new_processes(self.before)


def _wait(deadline: float) -> int:
    """Milliseconds for poll() until ``deadline`` (at least 0)."""
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))


def _decode(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except (ValueError, RecursionError) as exc:  # not JSON, too deep, too many digits
        raise _Broken(f"sent a line that is not JSON ({type(exc).__name__})") from None
    if not isinstance(message, dict):
        raise _Broken(f"sent {type(message).__name__} where a JSON object was due")
    return message


def _verdict(problem: Problem, verdict: VerdictName, detail: str, **facts: Any) -> Verdict:
    result: dict[str, Any] = {
        "problem_id": problem.id,
        "verdict": verdict,
        "tests": len(problem.tests),
        "tests_passed": 0,
        "failed_test": None,
        "call": None,
        "expected": None,
        "got": None,
        "detail": detail,
        "jail": [],
        "directory_removed": True,
    }
    result.update(facts)
    return cast(Verdict, result)


def _check_jail(report: dict[str, Any]) -> str | None:
    """Why the child's confinement is not enough, or None if it is. (The report comes from
    ``runner.py`` before any code of the completion has run: it is the runner's word.)"""
    jail, failures = report.get("jail"), report.get("jail_failures")
    readable = report.get("readable")
    if not isinstance(jail, list) or not isinstance(failures, list):
        return "the child did not report its confinement"
    if failures:
        return "; ".join(str(f) for f in failures)
    if not isinstance(readable, list) or not all(isinstance(r, str) for r in readable):
        return "the child did not report what it may read"
    for path in readable:
        if _HERE.is_relative_to(path):  # the tests would be readable to the completion
            return f"the child may read {path}, which holds the tests ({_HERE})"
    return None


def _run(
    problem: Problem, completion: str, child: _Child, deadline: float, allow_weak_jail: bool
) -> Verdict:
    """The evaluation proper. Raises _TimedOut, _Cancelled or _Broken (with no test yet)."""
    report = child.receive(deadline)
    jail = child.jail = [str(j) for j in report.get("jail") or []]
    weak = _check_jail(report)
    if weak is not None and not allow_weak_jail:
        detail = f"the completion's sandbox is incomplete: {weak}"
        return _verdict(problem, "error", detail, jail=jail)
    if weak is not None:
        jail.append(f"incomplete: {weak}")
    child.send({"source": completion, "entry": problem.entry}, deadline)
    loaded = child.receive(deadline)
    if "load_error" in loaded:
        error = loaded["load_error"]
        text = f"{error.get('raised')}: {error.get('message')}" if isinstance(error, dict) else ""
        return _verdict(problem, "error", f"the completion did not load: {text}", jail=jail)
    if loaded != {"ready": True}:
        raise _Broken(f"sent {_show(loaded)} where its readiness was due")
    for n, (args, expected) in enumerate(problem.tests):
        facts: dict[str, Any] = {
            "jail": jail,
            "tests_passed": n,
            "failed_test": n,
            "call": _call_text(problem, args),
            "expected": _show(expected),
        }
        try:
            child.send({"n": n, "args": list(args)}, deadline)
            reply = child.receive(deadline)
        except _TimedOut:
            return _verdict(problem, "timeout", f"test {n} did not finish in time", **facts)
        except _Broken as exc:
            return _verdict(problem, "error", f"the completion's process {exc}", **facts)
        if reply.get("n") != n:
            return _verdict(problem, "error", f"answered {_show(reply)} to test {n}", **facts)
        if "raised" in reply:
            raised = f"{reply.get('raised')}: {reply.get('message')}"
            return _verdict(problem, "failed", f"test {n} raised {_show(raised)}", **facts)
        if "unserializable" in reply:
            kind = _show(reply["unserializable"])
            return _verdict(problem, "failed", f"test {n} returned a {kind}, not data", **facts)
        if "return" not in reply:
            return _verdict(problem, "error", f"answered {_show(reply)} to test {n}", **facts)
        got = reply["return"]
        if not same(got, expected, problem.compare):
            facts["got"] = _show(got)
            return _verdict(problem, "failed", f"test {n} returned a wrong value", **facts)
    return _verdict(
        problem, "passed", "every test passed", jail=jail, tests_passed=len(problem.tests)
    )


@registry.tool
def evaluate(
    problem_id: str,
    completion: str,
    execution: ToolExecution,
    time_limit: float = 5.0,
    allow_weak_jail: bool = False,
) -> Verdict:
    """Run ``completion`` (Python source defining the problem's function) against the reference
    tests of ``problem_id``, in a child process that cannot reach the verdict; return the
    verdict: ``passed``, ``failed`` (which test, expected and got), ``error`` or ``timeout``.

    ``time_limit`` is wall-clock seconds for the whole evaluation (the child's start included).
    ``allow_weak_jail`` runs the completion even where the child could not confine itself fully
    (no Landlock on this kernel, say); by default that is an ``error`` verdict.
    The call's own cancel signal (a cancel, or the call's ``timeout``) stops the evaluation at
    once: the child's tree is killed and the call ends ``aborted`` or ``timeout``.
    """
    problem = PROBLEMS.get(problem_id)
    if problem is None:
        raise ValueError(f"unknown problem {problem_id!r}; the problems: {', '.join(PROBLEMS)}")
    if isinstance(time_limit, bool) or not (0 < time_limit <= 300):
        raise ValueError(f"time_limit must be a number of seconds in (0, 300], not {time_limit!r}")
    deadline = time.monotonic() + time_limit
    wake = Wake()
    handle = execution.signal.add_callback(wake.poke)
    directory = tempfile.mkdtemp(prefix="codeeval-")
    child: _Child | None = None
    verdict: Verdict | None = None
    try:
        child = _Child(directory, wake.fd)
        config = {
            "directory": directory,
            "memory": CHILD_MEMORY,
            "cpu_seconds": math.ceil(time_limit) + 1,
            "file_size": CHILD_FILE_SIZE,
            "open_files": CHILD_OPEN_FILES,
        }
        try:
            child.send(config, deadline)
            verdict = _run(problem, completion, child, deadline, allow_weak_jail)
        except _TimedOut:
            detail = "the completion did not load in time"
            verdict = _verdict(problem, "timeout", detail, jail=child.jail)
        except _Broken as exc:
            detail = f"the completion's process {exc}"
            verdict = _verdict(problem, "error", detail, jail=child.jail)
        except _Cancelled:
            pass
    finally:
        execution.signal.remove_callback(handle)
        if child is not None:
            child.close()
        removed = _remove(directory)
        wake.close()
    execution.signal.raise_if_cancelled()  # cancelled: the call ends aborted (or timeout)
    assert verdict is not None
    verdict["directory_removed"] = removed
    return verdict


def _remove(directory: str) -> bool:
    """Remove the child's directory; False if something of it is left."""
    try:
        shutil.rmtree(directory, ignore_errors=True)
    except RecursionError:  # a deep tree: the pool's bounded remover gets it with the scratch
        pass
    return not os.path.lexists(directory)


@registry.tool
def problems() -> list[dict[str, Any]]:
    """The problems: id, the function to write, the prompt, and how many tests score it."""
    return [
        {"id": p.id, "entry": p.entry, "prompt": p.prompt, "tests": len(p.tests)}
        for p in PROBLEMS.values()
    ]
