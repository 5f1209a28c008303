"""``toolpool serve``, and the commands that ask a running service (``status``, ``scale``,
``reload``, ``drain``; ``docs/service.md``); the ``--http`` and ``--token-file`` options the
MCP face takes too."""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import anyio

from ._cli_options import add_grace_options
from ._cli_report import OBSERVED_WIDTH, table
from .core import DEFAULT_GRACES

__all__ = (
    "add_service_commands",
    "control_command",
    "host_port",
    "read_token",
    "serve",
    "status_text",
)


def host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--http takes HOST:PORT (e.g. 127.0.0.1:8000), not {value!r}")
    return host.strip("[]"), int(port)


def read_token(path: str | None) -> str | None:
    """The bearer token in ``path`` (as the MCP face reads it: at least 16 characters)."""
    if path is None:
        return None
    from .mcp._http import read_token

    return read_token(path)


def serve(ns: argparse.Namespace, ours: logging.Handler | None) -> int:
    """``toolpool serve``. ``ours``: the command's own log handler, replaced by the
    service's while it runs."""
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
    host, port = host_port(ns.http)
    token = read_token(ns.token_file)
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
    if ours is not None:
        log.removeHandler(ours)
    handler = configure_logging(ns.log_format, level=logging.getLevelName(ns.log_level.upper()))
    try:
        return anyio.run(Service(options).run)
    finally:
        log.removeHandler(handler)
        if ours is not None:
            log.addHandler(ours)


def control_command(ns: argparse.Namespace) -> int:
    """``toolpool status``, ``scale``, ``reload`` and ``drain``: ask a running service."""
    from .serve import control, default_control_path

    path = ns.control or default_control_path()
    if ns.command == "status":
        answer = control(path, {"op": "status"}, timeout=30)
        answer.pop("ok", None)
        if ns.json:
            print(json.dumps(answer, indent=2))
        else:
            print(status_text(answer))
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


def status_text(s: Mapping[str, Any]) -> str:
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
        lines += ["", table(rows, wrap={6: OBSERVED_WIDTH})]
    return "\n".join(lines)


def add_service_commands(sub: Any) -> None:
    """``serve`` and the commands that ask a running service, on the parser's subparsers."""
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
    add_grace_options(serve)
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
