"""The command line: thin. Parse, call the API, print; ``Type: message`` on errors."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import anyio

from .core import ToolpoolError


def _add_profile_options(cmd: argparse.ArgumentParser, default: str) -> None:
    cmd.add_argument(
        "--profile", default=default, choices=["default", "untrusted"], help="base profile"
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="toolpool",
        description="Run tool calls in isolated worker processes and stop them truthfully.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("demo", help="run the built-in example job and show what happened")

    tools = sub.add_parser("tools", help="list the tools a registry provides")
    tools.add_argument("spec", help="module:attribute naming a toolpool.Registry")

    for name, text in (
        ("doctor", "show which containment layers protect workers on this machine"),
        ("selftest", "run the hostile-tool kit against this machine and profile"),
    ):
        _add_profile_options(sub.add_parser(name, help=text), "untrusted")

    call = sub.add_parser("call", help="run one call in a fresh pool and print its result")
    call.add_argument("spec", help="module:attribute naming a toolpool.Registry")
    call.add_argument("tool", help="the tool's name")
    call.add_argument("args", nargs="?", default="{}", help="arguments as a JSON object")
    call.add_argument("--timeout", type=float, default=None, help="seconds before cancelling")
    call.add_argument("--cancel-grace", type=float, default=5.0)
    call.add_argument("--term-grace", type=float, default=2.0)
    _add_profile_options(call, "default")
    return parser


def _result_json(result: Any) -> dict[str, Any]:
    return {
        "call_id": result.call_id,
        "tool": result.tool,
        "outcome": result.outcome.value,
        "value": result.value,
        "error": result.error,
        "body_started": result.body_started,
        "cause": dict(result.cause) if result.cause else None,
        "rung": result.rung.value,
        "worker_pid": result.worker_pid,
        "exit_code": result.exit_code,
        "exit_signal": result.exit_signal,
        "timeline": result.timeline.as_dict(),
    }


async def _call(ns: argparse.Namespace) -> int:
    from .supervisor import Pool

    try:
        args = json.loads(ns.args)
    except json.JSONDecodeError as exc:
        raise ValueError(f"args is not valid JSON: {exc}") from None
    if not isinstance(args, dict):
        raise ValueError("args must be a JSON object")
    async with Pool(
        ns.spec,
        workers=1,
        cancel_grace=ns.cancel_grace,
        term_grace=ns.term_grace,
        profile=_profile(ns),
    ) as pool:
        result = await pool.call(ns.tool, args, timeout=ns.timeout)
    print(json.dumps(_result_json(result), indent=2, default=repr))
    return 0 if result.ok else 1


def _profile(ns: argparse.Namespace) -> Any:
    from .sandbox import Profile

    profile = Profile.named(ns.profile)
    changes: dict[str, Any] = {
        name: getattr(ns, name)
        for name in ("memory", "max_processes", "cpu_time", "max_open_files", "max_file_size")
        if getattr(ns, name) is not None
    }
    if ns.no_network:
        changes["network"] = False
    if ns.private_ipc:
        changes["private_ipc"] = True
    if ns.user is not None:
        changes["user"] = (
            None if ns.user == "same" else int(ns.user) if ns.user.isdigit() else ns.user
        )
    if ns.no_cgroups:
        changes["disable"] = frozenset({"cgroups"})
    return profile.with_limits(**changes) if changes else profile


async def _doctor(ns: argparse.Namespace) -> int:
    from .supervisor import Pool

    async with Pool("toolpool.testing.examples:registry", workers=1, profile=_profile(ns)) as pool:
        await pool.call("noop")
        print(pool.containment().format())
    return 0


async def _selftest(ns: argparse.Namespace) -> int:
    from .supervisor import Pool
    from .testing.hostile import run_kit

    async with Pool(
        "toolpool.testing.hostile:registry",
        workers=2,
        cancel_grace=0.3,
        term_grace=0.3,
        profile=_profile(ns),
    ) as pool:
        print(pool.containment().format(), end="\n\n")
        verdicts = await run_kit(pool)
    rows = [("threat", "expected", "observed", "result", "caught by")]
    rows += [
        (v.threat, v.expected, v.observed, "pass" if v.passed else "FAIL", v.caught_by)
        for v in verdicts
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for n, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[4])
        if n == 0:
            print("  ".join("-" * w for w in widths) + "  " + "-" * 9)
    failed = [v for v in verdicts if not v.passed]
    print(f"\n{len(verdicts) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _tools(ns: argparse.Namespace) -> int:
    from .worker._main import load_registry

    registry = load_registry(ns.spec)
    print(json.dumps(registry.catalog(), indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``toolpool`` command."""
    ns = _parser().parse_args(argv)
    try:
        if ns.command == "demo":
            from ._demo import main as demo

            return demo(sys.stdout)
        if ns.command == "tools":
            return _tools(ns)
        if ns.command == "call":
            return anyio.run(_call, ns)
        if ns.command == "doctor":
            return anyio.run(_doctor, ns)
        if ns.command == "selftest":
            return anyio.run(_selftest, ns)
    except (ToolpoolError, ValueError, TypeError, ImportError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    raise AssertionError(f"unhandled command {ns.command!r}")  # pragma: no cover
