"""What a person sees of an evaluation: the batch's summary, the verdicts, pass@k."""

from __future__ import annotations

import json
from typing import IO

from ._run import EvalReport

__all__ = ("print_report", "print_report_json")


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def print_report(report: EvalReport, stream: IO[str], *, ks: tuple[int, ...]) -> None:
    """Per problem, then the run's summary, then the verdicts and pass@k overall."""
    # (rich only here: ``--json`` and the library never load it)
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from .._batch._progress import print_summary

    console = Console(file=stream)
    per = Table(box=box.SIMPLE_HEAD, title="pass@k per problem")
    per.add_column("task_id")
    per.add_column("samples", justify="right")
    per.add_column("passed", justify="right")
    for k in ks:
        per.add_column(f"pass@{k}", justify="right")
    for task_id, score in report.problems.items():
        cells = [_percent(score.pass_at_k.get(k)) for k in ks]
        per.add_row(str(task_id), f"{score.n:,}", f"{score.passed:,}", *cells)
    if report.problems:
        console.print(per)
    print_summary(report.summary, stream, command="toolpool eval")
    verdicts = " · ".join(
        f"{name} {report.verdicts.get(name, 0):,}"
        for name in ("passed", "failed", "error", "timeout")
    )
    console.print(f"verdicts (the whole results file): {verdicts}", highlight=False, markup=False)
    overall = ", ".join(f"pass@{k} {_percent(v)}" for k, v in report.pass_at_k.items())
    console.print(
        f"over {len(report.problems):,} problems: {overall}", highlight=False, markup=False
    )
    missing = [k for k, v in report.pass_at_k.items() if v is None]
    if missing and report.problems:
        fewest = min(s.n for s in report.problems.values())
        console.print(
            f"(pass@{', pass@'.join(map(str, missing))}: some problem has only {fewest} sample(s))",
            highlight=False,
            markup=False,
        )


def print_report_json(report: EvalReport, stream: IO[str]) -> None:
    """The report as one JSON object on one line."""
    stream.write(json.dumps(report.as_json()) + "\n")
    stream.flush()
