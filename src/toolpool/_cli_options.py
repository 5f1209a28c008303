"""The options several commands share (the graces, the containment profile, the log level,
a results file's run), one definition each."""

from __future__ import annotations

import argparse

from .core import DEFAULT_GRACES

__all__ = (
    "LOG_LEVELS",
    "add_grace_options",
    "add_log_level",
    "add_profile_options",
    "add_run_output",
)


def add_grace_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cancel-grace",
        type=float,
        default=DEFAULT_GRACES.cancel,
        help="seconds a cancelled call has to stop before SIGTERM "
        f"(default: {DEFAULT_GRACES.cancel:g})",
    )
    parser.add_argument(
        "--term-grace",
        type=float,
        default=DEFAULT_GRACES.term,
        help=f"seconds after SIGTERM before SIGKILL (default: {DEFAULT_GRACES.term:g})",
    )


def add_profile_options(cmd: argparse.ArgumentParser, default: str) -> None:
    cmd.add_argument(
        "--profile",
        default=default,
        choices=["default", "untrusted"],
        help=f"base containment profile (default: {default})",
    )
    cmd.add_argument("--memory", help="memory cap per worker tree, e.g. 512MiB")
    cmd.add_argument("--max-processes", type=int, help="processes+threads per worker tree")
    cmd.add_argument("--cpu-time", help="CPU time per process, e.g. 30s")
    cmd.add_argument("--max-open-files", type=int, help="open files per process")
    cmd.add_argument("--max-file-size", help="largest file a tool may write, e.g. 64MiB")
    cmd.add_argument("--no-network", action="store_true", help="an empty network namespace")
    cmd.add_argument(
        "--private-ipc", action="store_true", help="an IPC namespace of its own per worker"
    )
    cmd.add_argument(
        "--user",
        help="run workers as: 'per-worker' (a uid each), a user name or uid, or 'same' "
        "(the supervisor's); needs root",
    )
    cmd.add_argument(
        "--no-cgroups", action="store_true", help="force the fallbacks: leave cgroups off"
    )


LOG_LEVELS = ("debug", "info", "warning", "error")


def add_log_level(cmd: argparse.ArgumentParser, default: str | None) -> None:
    cmd.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        # (A subcommand's default must not override the level given before the subcommand.)
        default=argparse.SUPPRESS if default is None else default,
        help="what the pool logs to stderr, as 'toolpool: LEVEL: message' (default: warning)",
    )


def add_run_output(
    cmd: argparse.ArgumentParser,
    what: str,
    *,
    workers: int | None = 4,
    workers_help: str = "worker processes (default: 4)",
) -> None:
    """The options of a run that writes a results file: where, and what it prints."""
    cmd.add_argument(
        "-o", "--output", required=True, help="the results file (appended to; resumed from)"
    )
    cmd.add_argument("--workers", type=int, default=workers, help=workers_help)
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")
    cmd.add_argument("--json", action="store_true", help=f"print the {what} as one JSON object")
