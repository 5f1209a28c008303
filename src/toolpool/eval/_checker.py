"""The tool that scores one sample: ``toolpool.eval._checker:registry``, tool ``check_sample``.

The problem's ``check(candidate)`` is trusted: it runs here, in the tool body (the worker).
``candidate`` is a :class:`Candidate`, a proxy: each call goes to the jailed child that holds
the completion (``_zygote.py``, ``_child.py``) and only data comes back (``_wire.py``), or an
exception's type name and message, raised here again as an instance of a matching type.
Nothing of the child's is unpickled, evaluated or compared with its own ``__eq__``; the
verdict is decided here, where the completion cannot reach.
"""

from __future__ import annotations

import atexit
import builtins
import functools
import math
import time
import traceback
from types import CodeType
from typing import Any, Final, Literal, TypedDict

from ..worker import Registry, ToolExecution, forget_helper, keep_helper
from . import _wire
from ._zygote import Broken, Cancelled, Child, TimedOut, Wake, Zygote, describe_status

__all__ = ("CandidateError", "Candidate", "SampleVerdict", "check_sample", "registry")

registry = Registry()

#: Where the test's code is said to be in tracebacks and details.
TEST_FILE: Final = "<test>"

VerdictName = Literal["passed", "failed", "error", "timeout"]


class SampleVerdict(TypedDict):
    """What ``check_sample`` returns (a plain dict on the wire)."""

    verdict: VerdictName
    detail: str
    calls: int
    """How many calls ``check`` made to the candidate."""
    jail: list[str]
    """What the child was confined by, as it reported before the completion ran."""
    start_s: float
    """Seconds from the fork to the completion loaded."""
    check_s: float
    """Seconds ``check`` ran."""


class CandidateError(Exception):
    """An exception the candidate raised whose type has no match here (its own class, or a
    ``BaseException`` such as ``SystemExit``): the class a :class:`Candidate` raises is a
    subclass named after it."""


@functools.lru_cache(maxsize=64)
def _error_class(name: str) -> type[Exception]:
    found = getattr(builtins, name, None)
    if isinstance(found, type) and issubclass(found, Exception) and found is not CandidateError:
        return found
    return type(name, (CandidateError,), {"__module__": "candidate"})


def _raised(name: object, message: object) -> Exception:
    name = str(name)[:100] if isinstance(name, str) and name.isidentifier() else "Exception"
    text = message if isinstance(message, str) else ""
    cls = _error_class(name)
    try:
        return cls(text)
    except Exception:  # a builtin that wants other arguments (UnicodeDecodeError...)
        return CandidateError(f"{name}: {text}")


class Candidate:
    """What ``check`` gets as ``candidate``: calls go to the jailed child; data comes back."""

    def __init__(self, child: Child, deadline: float, name: str) -> None:
        self._child = child
        self._deadline = deadline
        self.__name__ = self.__qualname__ = name
        self.calls = 0
        self.fault: BaseException | None = None
        """The first time-out, cancel or broken child: every later call raises it again, and
        the verdict follows it even if ``check`` swallowed it."""
        self.raised_by_candidate: BaseException | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fault is not None:
            raise self.fault
        try:
            request = {
                "n": self.calls,
                "args": _wire.encode(list(args)),
                "kwargs": _wire.encode(kwargs) if kwargs else None,
            }
        except _wire.NotData as exc:
            raise TypeError(f"check passed the candidate a value that is not data: {exc}") from None
        n = self.calls
        self.calls += 1
        try:
            self._child.send(request, self._deadline)
            reply = self._child.receive(self._deadline)
        except (TimedOut, Cancelled, Broken) as exc:
            self.fault = exc
            raise
        if reply.get("n") != n:
            self.fault = Broken(f"answered {_show(reply)}")
            raise self.fault
        if "value" in reply:
            try:
                return _wire.decode(reply["value"])
            except _wire.NotData as exc:
                raise TypeError(f"the candidate returned a value that is not data: {exc}") from None
        if "raised" in reply:
            error = _raised(reply["raised"], reply.get("message"))
            self.raised_by_candidate = error
            raise error
        if "not_data" in reply:
            kind = _show(reply["not_data"])
            raise TypeError(f"the candidate returned a {kind}, which is not data")
        self.fault = Broken(f"answered {_show(reply)}")
        raise self.fault

    def __repr__(self) -> str:
        return f"<candidate {self.__name__}>"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


@functools.lru_cache(maxsize=256)
def _compiled(prompt: str, test: str) -> tuple[CodeType, CodeType]:
    return compile(prompt, "<prompt>", "exec"), compile(test, TEST_FILE, "exec")


def _where(exc: BaseException, test: str) -> str:
    """``line N of the test: <code>`` for the deepest frame of the test's code, or ''.
    (From the traceback's frames and the test's own text: no source file is read.)"""
    found = 0
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if frame.f_code.co_filename == TEST_FILE and lineno:
            found = lineno
    if not found:
        return ""
    lines = test.splitlines()
    code = lines[found - 1].strip() if found <= len(lines) else ""
    return f" at line {found} of the test: {code[:160]}"


def _jail_problem(report: dict[str, Any], inherited: list[str]) -> str | None:
    """Why the child's confinement is not enough, or None. (Its word, and the zygote's it
    inherits, before the completion ran.)"""
    jail, failures = report.get("jail"), report.get("failures")
    if not isinstance(jail, list) or not isinstance(failures, list):
        return "the child did not report its confinement"
    if failures or inherited:
        return "; ".join(str(f) for f in [*inherited, *failures])
    return None


_zygote: Zygote | None = None


def _warm_zygote() -> Zygote:
    """This worker's zygote: started by :func:`start_zygote` or on the first sample, and
    again if it died."""
    global _zygote
    if _zygote is None or not _zygote.alive():
        if _zygote is not None:
            _stop_zygote()
        _zygote = Zygote()
        keep_helper(_zygote.process.pid)
    return _zygote


def _stop_zygote() -> None:
    global _zygote
    zygote, _zygote = _zygote, None
    if zygote is not None:
        forget_helper(zygote.process.pid)
        zygote.close()


def start_zygote() -> None:
    """Start this worker's zygote now, without waiting for it (``toolpool.eval._tools``, the
    workers' tools module, calls it as it is loaded: the zygote's start then overlaps the
    worker's own), and stop it when the worker exits."""
    _warm_zygote()


atexit.register(_stop_zygote)  # (a worker killed outright: the zygote has PDEATHSIG)


@registry.tool
def check_sample(
    prompt: str,
    test: str,
    entry_point: str,
    completion: str,
    execution: ToolExecution,
    time_limit: float = 3.0,
    allow_weak_jail: bool = False,
) -> SampleVerdict:
    """Score one sample: run ``prompt + completion`` in a jailed child, and the problem's
    ``test`` here, calling ``check(candidate)`` with a proxy to the child's ``entry_point``.

    The verdict: ``passed`` (check returned), ``failed`` (check raised: a wrong value, an
    exception of the candidate's, a value that is not data), ``error`` (the completion did not
    load, or its process died or broke the protocol) or ``timeout`` (``time_limit`` seconds,
    wall clock, for the whole sample). A child whose jail is incomplete (no Landlock, say)
    does not run the completion (``error``) unless ``allow_weak_jail``. The call's cancel
    signal stops the sample at once (the call ends ``aborted`` or ``timeout``).
    """
    if isinstance(time_limit, bool) or not (0 < time_limit <= 3600):
        raise ValueError(f"time_limit must be a number of seconds in (0, 3600], not {time_limit!r}")
    prompt_code, test_code = _compiled(prompt, test)
    started = time.monotonic()
    deadline = started + time_limit
    wake = Wake()
    handle = execution.signal.add_callback(wake.poke)
    zygote: Zygote | None = None
    child: Child | None = None
    verdict: SampleVerdict = {
        "verdict": "error",
        "detail": "",
        "calls": 0,
        "jail": [],
        "start_s": 0.0,
        "check_s": 0.0,
    }
    try:
        zygote = _warm_zygote()
        child = Child(zygote, math.ceil(time_limit) + 1, wake.fd)
        try:
            _evaluate(
                verdict,
                child,
                prompt,
                completion,
                entry_point,
                prompt_code,
                test_code,
                test,
                deadline,
                allow_weak_jail,
            )
        except TimedOut:
            verdict["verdict"], verdict["detail"] = "timeout", "the completion did not load in time"
        except Broken as exc:
            verdict["verdict"], verdict["detail"] = "error", f"the completion's process {exc}"
        except Cancelled:
            pass
        if verdict["detail"].startswith("the completion's process") and child.dead_within(1.0):
            child.close()
            verdict["detail"] += f" (it {describe_status(child.status)})"
    finally:
        execution.signal.remove_callback(handle)
        try:
            if child is not None:
                child.close()
        finally:
            wake.close()
            # Every process of the sample is gone: empty the directory for the next one. A
            # zygote whose directory cannot be emptied, or that a process of the sample may
            # still write to (it outlived the kill), is replaced, directory and all.
            if zygote is not None and zygote is _zygote:
                clean = child is not None and child.clean
                if not (clean and zygote.empty()):
                    _stop_zygote()
    execution.signal.raise_if_cancelled()  # cancelled: the call ends aborted (or timeout)
    return verdict


def _evaluate(
    verdict: SampleVerdict,
    child: Child,
    prompt: str,
    completion: str,
    entry_point: str,
    prompt_code: CodeType,
    test_code: CodeType,
    test: str,
    deadline: float,
    allow_weak_jail: bool,
) -> None:
    forked = time.monotonic()
    report = child.receive(deadline)
    inherited, inherited_failures = child.inherited
    jail = verdict["jail"] = [*inherited, *(str(j) for j in report.get("jail") or [])]
    weak = _jail_problem(report, inherited_failures)
    if weak is not None and not allow_weak_jail:
        verdict["detail"] = f"the completion's jail is incomplete: {weak}"
        return
    if weak is not None:
        jail.append(f"incomplete: {weak}")
    child.send({"source": prompt + completion, "entry": entry_point}, deadline)
    loaded = child.receive(deadline)
    verdict["start_s"] = round(time.monotonic() - forked, 6)
    if "load_error" in loaded:
        error = loaded["load_error"]
        text = f"{error.get('raised')}: {error.get('message')}" if isinstance(error, dict) else "?"
        verdict["detail"] = f"the completion did not load: {_show(text)}"
        return
    if loaded != {"ready": True}:
        raise Broken(f"sent {_show(loaded)} where its readiness was due")
    candidate = Candidate(child, deadline, entry_point)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    checking = time.monotonic()
    try:
        exec(prompt_code, namespace)  # the prompt's helpers, for check (trusted code)
        namespace[entry_point] = candidate
        exec(test_code, namespace)
        namespace["check"](candidate)
    except (TimedOut, Cancelled, Broken):
        pass  # (recorded in candidate.fault)
    except Exception as exc:
        if candidate.fault is None:
            verdict["verdict"] = "failed"
            kind = type(exc).__name__
            text = f"{kind}: {exc}" if str(exc) else kind
            by = " (raised by the candidate)" if exc is candidate.raised_by_candidate else ""
            verdict["detail"] = f"check failed{_where(exc, test)}: {_show(text)}{by}"
    else:
        if candidate.fault is None:
            verdict["verdict"], verdict["detail"] = "passed", "check passed"
    finally:
        verdict["check_s"] = round(time.monotonic() - checking, 6)
        verdict["calls"] = candidate.calls
    fault = candidate.fault
    if isinstance(fault, TimedOut):
        verdict["verdict"] = "timeout"
        verdict["detail"] = f"call {candidate.calls - 1} did not finish in time"
    elif isinstance(fault, Broken):
        verdict["verdict"] = "error"
        verdict["detail"] = f"the completion's process {fault} (call {candidate.calls - 1})"
    elif isinstance(fault, Cancelled):
        raise fault
