"""``toolpool doctor`` and ``toolpool selftest``: what containment a pool applied, and the
hostile kit's verdicts, printed as tables (``docs/containment.md``)."""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .sandbox import Profile

__all__ = ("EXPECTED_WIDTH", "OBSERVED_WIDTH", "doctor", "kit_summary", "selftest", "table")


async def doctor(profile: Profile) -> int:
    """``toolpool doctor``: start a pool, run a call, print what containment it applied."""
    from .supervisor import Pool

    async with Pool("toolpool.testing.examples:registry", workers=1, profile=profile) as pool:
        await pool.call("noop")
        print(pool.containment().format())
    return 0


class _Collect(logging.Handler):
    """Keeps what the pool logs while the kit runs, to print after the table."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname.lower()}: {record.getMessage()}")


#: The widest the expected and observed columns get in the selftest table; longer text
#: wraps at a word.
EXPECTED_WIDTH = 36
OBSERVED_WIDTH = 48


async def selftest(profile: Profile, ours: logging.Handler | None) -> int:
    """``toolpool selftest``: the hostile kit against a pool, its verdicts as a table.
    ``ours``: the command's own log handler, set aside while the kit runs."""
    from .supervisor import Pool
    from .testing.hostile import run_kit

    # The kit provokes the pool on purpose (strangers on sockets, garbage frames): what the
    # pool logs about it is shown after the table, not in the middle of it.
    log = logging.getLogger("toolpool")
    collect = _Collect()
    log.addHandler(collect)
    if ours is not None:
        log.removeHandler(ours)
    try:
        async with Pool(
            "toolpool.testing.hostile:registry",
            workers=2,
            cancel_grace=0.3,
            term_grace=0.3,
            profile=profile,
        ) as pool:
            print(pool.containment().format(), end="\n\n")
            verdicts = await run_kit(pool)
    finally:
        log.removeHandler(collect)
        if ours is not None:
            log.addHandler(ours)
    rows = [("threat", "expected under this profile", "observed", "result", "held by")]
    rows += [(v.threat, v.expected, v.observed, v.status, v.caught_by) for v in verdicts]
    print(table(rows, wrap={1: EXPECTED_WIDTH, 2: OBSERVED_WIDTH}))
    if collect.lines:
        print("\nwhat the pool logged meanwhile (the kit provokes it):")
        for line in collect.lines:
            print(f"  {line}")
    print(f"\n{kit_summary(verdicts)}")
    return 1 if any(v.status == "FAILED" for v in verdicts) else 0


def kit_summary(verdicts: Sequence[Any]) -> str:
    """The statuses counted apart, each said plainly (a 'not held' is no pass)."""
    count = {s: sum(v.status == s for v in verdicts) for s in ("held", "not held", "not run")}
    failed = [v.threat for v in verdicts if v.status == "FAILED"]
    parts = [
        f"{count['held']} held",
        f"{count['not held']} not held (expected under this profile: see 'expected')",
        f"{count['not run']} not run",
        f"{len(failed)} FAILED" + (f" ({', '.join(failed)})" if failed else ""),
    ]
    return ", ".join(parts)


def _wrap(text: str, width: int) -> list[str]:
    """Lines of at most ``width`` at word boundaries; a word longer than that (a path, a
    repr) stands whole on a line of its own, never cut."""
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)


def table(rows: Sequence[Sequence[str]], *, wrap: Mapping[int, int]) -> str:
    """Columns padded to their widest cell; a column in ``wrap`` wraps at that width onto
    continuation lines instead (nothing is cut off). The first row is the header."""
    grid = [
        [(_wrap(c, wrap[i]) or [""]) if i in wrap else [c] for i, c in enumerate(row)]
        for row in rows
    ]
    width = len(rows[0])
    widths = [max(len(line) for row in grid for line in row[i]) for i in range(width)]
    out: list[str] = []
    for n, row in enumerate(grid):
        for k in range(max(len(c) for c in row)):
            parts = [c[k] if k < len(c) else "" for c in row]
            out.append("  ".join(p.ljust(w) for p, w in zip(parts, widths, strict=True)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
