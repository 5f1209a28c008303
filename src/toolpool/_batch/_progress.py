"""What a person sees of a batch: a live progress bar on a terminal, and a summary table.

Built on ``rich``, imported only here. The bar goes to stderr, only when stderr is a terminal
(no bar and no control codes otherwise, so logs stay clean); the summary goes to stdout.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import IO, Any, final

from rich import box
from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from ._runner import Batch, Summary, Watcher

__all__ = ("LiveProgress", "print_summary", "print_summary_json")

#: The order outcomes are shown in: the C3 outcomes, then rejected lines.
_ORDER = (
    "ok",
    "error",
    "denied",
    "aborted_before_dispatch",
    "aborted",
    "timeout",
    "killed",
    "worker_lost",
    "rejected",
)


def _counts(counts: dict[str, int]) -> str:
    shown = [(k, counts[k]) for k in _ORDER if counts.get(k)]
    shown += [(k, v) for k, v in counts.items() if k not in _ORDER and v]
    return " · ".join(f"{k} {v:,}" for k, v in shown) or "nothing yet"


class _TwoLines(Progress):
    """The bar on one line, the counts on the next (they do not fit beside it on 80
    columns)."""

    counts = ""

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        yield Text(self.counts, overflow="ellipsis", no_wrap=True)


@final
class LiveProgress(Watcher):
    """A rich progress bar: done of total, rate, ETA, counts by outcome, in flight and
    queued. Refreshed by the batch a few times a second (never from a thread of its own)."""

    def __init__(self, stream: IO[str], *, label: str = "batch") -> None:
        self._console = Console(file=stream)
        self._label = label
        self._progress: _TwoLines | None = None
        self._task: TaskID | None = None

    @property
    def active(self) -> bool:
        """False when the stream is not a terminal: nothing is drawn."""
        return self._console.is_terminal

    def started(self, batch: Batch) -> None:
        if not self.active:
            return
        self._progress = _TwoLines(
            TextColumn(f"[bold]{self._label}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[rate]}"),
            console=self._console,
            auto_refresh=False,
        )
        self._progress.start()
        self._task = self._progress.add_task("batch", total=batch.summary.total, rate="")

    def refresh(self, batch: Batch) -> None:
        if self._progress is None or self._task is None:
            return
        s = batch.summary
        done = s.lines - batch.in_window
        self._progress.counts = (
            f"  {_counts(s.recorded)} | in flight {s.in_flight:,} · queued {s.queued:,}"
        )
        self._progress.update(self._task, completed=done, rate=f"{batch.rate():,.0f} calls/s")
        self._progress.refresh()

    def stopped(self, batch: Batch) -> None:
        if self._progress is None:
            return
        self.refresh(batch)
        self._progress.stop()
        self._progress = None


def print_summary(summary: Summary, stream: IO[str], *, command: str = "toolpool batch") -> None:
    """The summary as a table (plain text where ``stream`` is not a terminal)."""
    console = Console(file=stream)
    table = Table(box=box.SIMPLE_HEAD, title=f"{command}: {summary.output}")
    table.add_column("outcome")
    table.add_column("this run", justify="right")
    table.add_column("earlier runs", justify="right")
    keys = [k for k in _ORDER if summary.recorded.get(k) or summary.previous.get(k)]
    keys += sorted(k for k in {*summary.recorded, *summary.previous} if k not in _ORDER)
    for key in keys:
        table.add_row(key, f"{summary.recorded.get(key, 0):,}", f"{summary.previous.get(key, 0):,}")
    console.print(table)
    facts = [
        f"{summary.lines:,} lines read, {summary.skipped:,} skipped (recorded earlier)",
        f"{summary.retries:,} retries",
    ]
    if summary.rerun:
        facts.append(f"{summary.rerun:,} recorded calls run again (--rerun)")
    if summary.rejected_before:
        facts.append(
            f"{summary.rejected_before:,} lines rejected again (recorded earlier: not twice)"
        )
    facts += [
        f"{summary.elapsed_s:.1f}s, {summary.calls_per_s:,.0f} calls/s",
        f"peak RSS {summary.peak_rss_mib:.0f} MiB",
    ]
    if summary.not_recorded:
        facts.append(
            f"{summary.not_recorded:,} calls stopped before they started: not recorded, "
            "a resumed run makes them"
        )
    if summary.interrupted:
        facts.append("interrupted: run the same command again to resume")
    if summary.error:
        facts.append(f"stopped early: {summary.error}")
    for fact in facts:
        console.print(fact, highlight=False, markup=False)


def print_summary_json(summary: Summary, stream: IO[str]) -> None:
    """The summary as one JSON object on one line."""
    data: dict[str, Any] = summary.as_json()
    stream.write(json.dumps(data) + "\n")
    stream.flush()
