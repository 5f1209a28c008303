"""The graces of the escalation ladder: each default written once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, final

__all__ = ("DEFAULT_GRACES", "Graces", "check_seconds")


def check_seconds(name: str, value: object, *, positive: bool = False) -> float:
    """``value`` as seconds, if it is a finite number at least 0 (``positive``: above 0);
    else a ValueError that names it ``name``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        what = "a positive" if positive else "a non-negative"
        raise ValueError(f"{name} must be {what} number of seconds, got {value!r}")
    return float(value)


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Graces:
    """How long each step of stopping a call is given, in seconds (CONTRACT C4.1, C4.2).

    The one place each default is written: :class:`toolpool.Pool` (its ``cancel_grace``,
    ``term_grace``, ``drain_grace`` and ``unkillable_after``), :class:`toolpool.SyncPool`,
    ``toolpool call`` and ``toolpool batch`` (their ``--cancel-grace`` and
    ``--term-grace``), and what they say on Ctrl-C all take theirs from here.
    """

    cancel: float = 5.0
    """A cancelled call's time to stop cooperatively before SIGTERM of its worker's tree."""
    term: float = 2.0
    """After SIGTERM, before SIGKILL of the whole tree."""
    drain: float = 30.0
    """A removed (or reloaded) provider's running calls' time to finish before a cancel
    with cause ``disposed``."""
    unkillable_after: float = 10.0
    """After the SIGKILL of a worker's tree: a process of it still there makes the worker
    unkillable (uninterruptible sleep)."""

    def __post_init__(self) -> None:
        for name in ("cancel", "term", "drain"):
            object.__setattr__(self, name, check_seconds(f"Graces.{name}", getattr(self, name)))
        after = check_seconds("Graces.unkillable_after", self.unkillable_after, positive=True)
        object.__setattr__(self, "unkillable_after", after)

    def ladder(self) -> str:
        """What happens to a cancelled call that does not stop, in words (the interrupt
        messages say it)."""
        return (
            f"one that does not stop within {self.cancel:g}s gets SIGTERM, then SIGKILL "
            f"{self.term:g}s later"
        )


#: The defaults.
DEFAULT_GRACES: Final = Graces()
