"""``toolpool serve``: one pool as a long-lived service (docs/service.md).

One process: the pool (its providers), the HTTP listener (the MCP face at ``/mcp``, the
probes, ``/metrics``), the control socket, and the signals. Its states:

``starting`` (the listener answers: healthy, not ready) -> ``serving`` (ready while a worker
serves) -> ``draining`` (not ready at once; new calls refused "draining"; running calls get
the drain grace, then a ``disposed`` cancel and the ladder) -> ``stopped`` (every call settled,
every process tree gone: the process exits 0).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol, final

import anyio
import anyio.abc

from ..core import DEFAULT_GRACES, ToolpoolError
from ..supervisor import (
    Pool,
    PoolEvent,
    ProviderAdded,
    ProviderRemoved,
    ProviderResized,
    WorkerExited,
    WorkerStarted,
)
from ._config import ProviderConfig
from ._control import ControlServer, default_control_path
from ._http import AsgiApp, ServiceApp
from ._logs import lifecycle

__all__ = ("Face", "Service", "ServiceOptions", "ServiceState")

ServiceState = Literal["starting", "serving", "draining", "stopped"]

#: Worker states in which a worker serves calls (``/readyz``).
_SERVING: Final = ("ready", "busy", "cleaning")
#: Seconds the listener gives open connections to finish their answers once every call has
#: settled (each call's answer is written by then: this is for slow readers).
_HTTP_SHUTDOWN_GRACE: Final = 5.0


class Face(Protocol):
    """What the service needs of the MCP face (``toolpool.mcp.McpServer``)."""

    def asgi_app(
        self,
        *,
        token: str | None = ...,
        allowed_origins: list[str] | None = ...,
        allowed_hosts: list[str] | None = ...,
    ) -> AsgiApp:
        """The streamable HTTP app at ``/mcp``; its lifespan runs the face."""
        ...

    def begin_drain(self) -> None:
        """New calls are answered "draining" from now on."""
        ...

    def cancel_all(self, cause: Mapping[str, str] | None = ..., *, force: bool = ...) -> int:
        """Cancel every call in flight with ``cause`` (``force``: SIGKILL at once)."""
        ...

    def close(self) -> None:
        """Stop mirroring the pool."""
        ...


FaceFactory = Callable[[Pool, "ServiceOptions"], "Face | None"]


@final
@dataclass(frozen=True, kw_only=True)
class ServiceOptions:
    """How a service runs (``toolpool serve``'s options)."""

    providers: tuple[ProviderConfig, ...]
    host: str = "127.0.0.1"
    port: int = 8080
    token: str | None = None
    """The bearer token callers of ``/mcp`` must send; required for a non-loopback host."""
    control: str | None = None
    """The control socket's path (default: :func:`toolpool.serve.default_control_path`)."""
    cancel_grace: float = DEFAULT_GRACES.cancel
    term_grace: float = DEFAULT_GRACES.term
    drain_grace: float = DEFAULT_GRACES.drain
    """Seconds running calls get to finish when the service drains (and when a provider is
    reloaded or shrunk), before a ``disposed`` cancel and the ladder."""
    timeout: float | None = None
    """The default timeout of a call through the face (a tool's own metadata may say)."""
    allowed_hosts: tuple[str, ...] = ()
    """``Host`` header values ``/mcp`` accepts besides loopback and the listening address
    (DNS-rebinding protection): the names callers use, e.g. a Kubernetes Service's."""

    def __post_init__(self) -> None:
        if not self.providers:
            raise ValueError("a service needs at least one provider (TOOLS or --config)")
        for name in ("cancel_grace", "term_grace", "drain_grace"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{name} must be a number of seconds, 0 or more")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0-65535, got {self.port}")
        from ..mcp._http import is_loopback

        if not is_loopback(self.host) and not self.token:
            raise ValueError(
                f"refusing to listen on {self.host}: not a loopback address, and no token "
                "(--token-file) to authenticate callers"
            )


def _load_face(pool: Pool, options: ServiceOptions) -> Face | None:
    try:
        from ..mcp import McpServer  # type: ignore[import-not-found,unused-ignore]
    except ImportError:  # (until the MCP face, issue 23, is merged: /mcp answers 404)
        lifecycle("no_face", "toolpool.mcp is not there: /mcp is not served", level=logging.WARNING)
        return None
    face: Face = McpServer(pool, timeout=options.timeout)
    return face


def _hosts(options: ServiceOptions) -> list[str]:
    """What ``/mcp`` accepts as ``Host``: loopback, the address it listens on, and the
    names given (each with any port)."""
    from ..mcp._http import is_loopback

    names = ["127.0.0.1", "localhost", "[::1]"]
    host = options.host
    if host not in ("0.0.0.0", "::") and not is_loopback(host):
        names.append(f"[{host}]" if ":" in host else host)
    names += list(options.allowed_hosts)
    return [form for name in names for form in (name, f"{name}:*")]


class Service:
    """One ``toolpool serve`` process's service: ``await Service(options).run()``."""

    def __init__(self, options: ServiceOptions, *, face: FaceFactory = _load_face) -> None:
        self.options = options
        self.control_path = options.control or default_control_path()
        self._face_factory = face
        self._face: Face | None = None
        self._pool: Pool | None = None
        self._state: ServiceState = "starting"
        self._started_at = time.monotonic()
        self._drain_asked: anyio.Event | None = None  # (events are made in the loop: run)
        self._stopped: anyio.Event | None = None
        self._drain_grace = options.drain_grace
        self._grace_scope: anyio.CancelScope | None = None
        self._forced = False
        self._address: tuple[str, int] | None = None
        self._metrics: Any = None
        self._busy: set[str] = set()  # control operations running (scale, reload)

    # ------------------------------------------------------------------ state

    @property
    def state(self) -> ServiceState:
        """``starting``, ``serving``, ``draining`` or ``stopped``."""
        return self._state

    @property
    def address(self) -> tuple[str, int] | None:
        """The listener's host and port, once bound (port 0 asks for any free port)."""
        return self._address

    def health(self) -> tuple[bool, dict[str, Any]]:
        """The process answers (this runs), and the pool's reaper is alive."""
        facts: dict[str, Any] = {"state": self._state, "pid": os.getpid()}
        pool = self._pool
        if pool is None or self._state in ("starting", "stopped"):
            facts["reaper"] = "not started" if self._state == "starting" else "stopped"
            return True, facts
        pid = pool.reaper_pid
        alive = pid is not None and _alive(pid)
        facts["reaper"] = "alive" if alive else "down"
        facts["reaper_pid"] = pid
        return alive or self._state == "draining", facts

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Serving, and at least one worker serves."""
        serving = self._serving_workers()
        facts = {"state": self._state, "serving_workers": serving}
        return self._state == "serving" and serving > 0, facts

    def metrics(self) -> tuple[bytes, str]:
        """``/metrics``: the pool's metrics and the service's."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self._metrics is None:
            return b"", CONTENT_TYPE_LATEST
        return generate_latest(self._metrics), CONTENT_TYPE_LATEST

    def _serving_workers(self) -> int:
        pool = self._pool
        if pool is None or self._state in ("starting", "stopped"):
            return 0
        stats = pool.statistics()
        return sum(stats.workers.get(s, 0) for s in _SERVING)

    def status(self) -> dict[str, Any]:
        """What ``toolpool status`` shows."""
        from .. import __version__

        pool = self._pool
        out: dict[str, Any] = {
            "state": self._state,
            "pid": os.getpid(),
            "version": __version__,
            "uptime_s": round(time.monotonic() - self._started_at, 3),
            "listen": None if self._address is None else f"{self._address[0]}:{self._address[1]}",
            "control": self.control_path,
            "ready": self.readiness()[0],
            "drain_grace_s": self._drain_grace,
            "providers": {},
        }
        if pool is None:
            return out
        stats = pool.statistics()
        out.update(
            in_flight=stats.in_flight,
            queued=stats.queued,
            submitted=stats.submitted,
            settled=dict(stats.settled),
            workers=dict(stats.workers),
        )
        for name, info in pool.providers.items():
            ps = pool.statistics(name)
            config = next((p for p in self.options.providers if p.name == name), None)
            out["providers"][name] = {
                "tools_spec": info.tools_spec,
                "tools": sorted(info.tools),
                "profile": info.profile,
                "generation": info.generation,
                "size": info.workers,
                "autoscale": None if config is None else config.autoscale,
                "workers": dict(ps.workers),
                "in_flight": ps.in_flight,
                "queued": ps.queued,
                "settled": dict(ps.settled),
                "containment": dict(info.containment),
            }
        return out

    # ------------------------------------------------------------------ operations

    def drain(self, grace: float | None = None) -> None:
        """Begin draining (idempotent): readiness fails now, new calls are refused
        "draining"; running calls get ``grace`` seconds (default: the drain grace) to
        finish, then a ``disposed`` cancel and the ladder; the service then stops."""
        if self._state in ("draining", "stopped"):
            return
        if grace is not None:
            self._drain_grace = grace
        previous = self._state
        self._state = "draining"
        if self._face is not None:
            self._face.begin_drain()
        pool = self._pool
        stats = pool.statistics() if pool is not None and previous == "serving" else None
        lifecycle(
            "draining",
            f"draining: readiness fails; new calls are refused; running calls get "
            f"{self._drain_grace:g}s, then a disposed cancel "
            f"({self.options.cancel_grace:g}s, then SIGTERM, {self.options.term_grace:g}s, "
            "then SIGKILL)",
            in_flight=0 if stats is None else stats.in_flight,
            queued=0 if stats is None else stats.queued,
            drain_grace_s=self._drain_grace,
        )
        if self._drain_asked is not None:
            self._drain_asked.set()

    def force(self) -> None:
        """Stop now: every call still running is killed (SIGKILL of its tree, cause
        ``disposed``); the service still exits only once every tree is gone."""
        self.drain()
        if self._forced:
            return
        self._forced = True
        lifecycle("forced", "forced: every call still running is killed now (SIGKILL)")
        if self._grace_scope is not None:
            self._grace_scope.cancel()
        if self._face is not None and self._state == "draining":
            self._face.cancel_all({"kind": "disposed"}, force=True)

    async def wait_stopped(self) -> None:
        """Return once the service stopped (every call settled, every tree gone)."""
        assert self._stopped is not None, "the service is not running"
        await self._stopped.wait()

    async def scale(self, workers: int, provider: str | None) -> dict[str, Any]:
        """Resize a provider (ends its autoscaling); returns once the size holds."""
        pool = self._serving_pool("scale")
        name = self._provider(pool, provider)
        old = pool.providers[name].workers
        lifecycle("scaling", f"scaling {name}: {old} -> {workers} workers", provider=name)
        await pool.resize(name, workers)
        lifecycle("scaled", f"{name} has {workers} workers", provider=name, workers=workers)
        return {"ok": True, "provider": name, "old": old, "workers": workers}

    async def reload(self, provider: str | None) -> dict[str, Any]:
        """Reload one provider's tools, or every provider's one after the other (a rolling
        ``reload_provider``: no call lost, none run twice)."""
        pool = self._serving_pool("reload")
        names = [self._provider(pool, provider)] if provider is not None else list(pool.providers)
        done: dict[str, int] = {}
        for name in names:
            if "reload:" + name in self._busy:
                raise ValueError(f"{name} is being reloaded already")
            self._busy.add("reload:" + name)
            try:
                lifecycle("reloading", f"reloading {name}", provider=name)
                info = await pool.reload_provider(name)
            finally:
                self._busy.discard("reload:" + name)
            done[name] = info.generation
            lifecycle(
                "reloaded",
                f"{name} reloaded: generation {info.generation}",
                provider=name,
                generation=info.generation,
            )
        return {"ok": True, "reloaded": done}

    def _serving_pool(self, op: str) -> Pool:
        if self._state != "serving" or self._pool is None:
            raise ValueError(f"{op}: the service is {self._state}")
        return self._pool

    @staticmethod
    def _provider(pool: Pool, provider: str | None) -> str:
        names = list(pool.providers)
        if provider is None:
            if len(names) != 1:
                raise ValueError(f"say which provider (--provider): {', '.join(names)}")
            return names[0]
        if provider not in pool.providers:
            raise ValueError(f"no provider {provider!r}; there are: {', '.join(names)}")
        return provider

    async def _control(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op == "status":
            return {"ok": True, **self.status()}
        if op == "scale":
            return await self.scale(req["workers"], req.get("provider"))
        if op == "reload":
            return await self.reload(req.get("provider"))
        assert op == "drain"
        lifecycle("drain_requested", "drain requested over the control socket")
        self.drain(req.get("timeout"))
        if req.get("wait"):
            await self.wait_stopped()
        return {"ok": True, "state": self._state}

    # ------------------------------------------------------------------ running

    async def run(self) -> int:
        """Serve until drained; 0 once every call settled and every tree is gone."""
        from ..mcp._http import _bind

        options = self.options
        self._drain_asked = anyio.Event()
        self._stopped = anyio.Event()
        listener = _bind(options.host, options.port)
        self._address = listener.getsockname()[:2]
        control = ControlServer(self.control_path, self._control, refused=_refused)
        await control.open()
        try:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._watch_signals, sigs)
                    tg.start_soon(control.serve)
                    await self._run_pool(listener, tg)
                    with anyio.move_on_after(5):  # (`drain --wait` clients get their answer)
                        await control.answered()
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            failure = _first_failure(group)
            head = str(failure).partition("Traceback (most recent call last):")[0].strip()
            lifecycle("failed", f"{type(failure).__name__}: {head}", level=logging.ERROR)
            raise failure from None
        finally:
            await control.aclose()
            listener.close()
        lifecycle("stopped", "stopped: every call settled, every process gone", exit_status=0)
        return 0

    async def _run_pool(self, listener: socket.socket, tg: anyio.abc.TaskGroup) -> None:
        options = self.options
        asked, stopped = self._drain_asked, self._stopped
        assert asked is not None
        assert stopped is not None
        pool = Pool(
            None,
            cancel_grace=options.cancel_grace,
            term_grace=options.term_grace,
            drain_grace=options.drain_grace,
        )
        self._pool = pool
        self._face = self._face_factory(pool, options)
        mcp_app = None
        if self._face is not None:
            hosts = _hosts(options)
            mcp_app = self._face.asgi_app(
                token=options.token,
                allowed_hosts=hosts,
                allowed_origins=[f"http://{h}" for h in hosts],
            )
        self._metrics = _metrics_registry(pool, self)
        http = _Listener(ServiceApp(self, mcp_app), listener)
        tg.start_soon(http.serve)
        host, port = self._address or ("", 0)
        lifecycle(
            "listening",
            f"listening on http://{_url_host(host)}:{port} (/mcp, /healthz, /readyz, /metrics)",
            host=host,
            port=port,
            control=self.control_path,
            pid=os.getpid(),
        )
        unsubscribe = pool.subscribe(_log_event)
        report = None
        try:
            async with pool:
                if not asked.is_set():
                    await self._add_providers(pool, asked)
                if self._state == "starting":
                    self._state = "serving"
                    lifecycle(
                        "serving",
                        f"serving {len(pool.catalog)} tools from {len(pool.providers)} providers",
                        tools=sorted(pool.catalog),
                        providers=sorted(pool.providers),
                    )
                await asked.wait()
                await self._let_calls_finish(pool)
                if self._face is not None:
                    self._face.cancel_all({"kind": "disposed"}, force=self._forced)
                report = await pool.aclose()
        except BaseException:
            with anyio.CancelScope(shield=True):  # (the listener ends in order, then the error)
                await http.stop()
            raise
        finally:
            unsubscribe()
            if self._face is not None:
                self._face.close()
            self._state = "stopped"
            stopped.set()
        lifecycle(
            "drained",
            "every call settled and every process tree is gone",
            files_pending=[] if report is None else list(report.pending),
        )
        await http.stop()

    async def _add_providers(self, pool: Pool, asked: anyio.Event) -> None:
        for p in self.options.providers:
            await pool.add_provider(
                p.name,
                p.tools,
                workers=p.initial_workers,
                profile=p.profile,
                timeout=p.timeout,
            )
            if p.autoscale is not None:
                await pool.autoscale(p.name, min=p.autoscale[0], max=p.autoscale[1])
            if asked.is_set():
                return

    async def _let_calls_finish(self, pool: Pool) -> None:
        """The drain grace: wait for the running calls, at most that long."""
        with anyio.CancelScope() as scope:
            self._grace_scope = scope
            if self._forced:
                scope.cancel()
            with anyio.move_on_after(self._drain_grace):
                await pool.wait_idle()
        self._grace_scope = None
        left = pool.statistics()
        if left.in_flight or left.queued:
            lifecycle(
                "drain_grace_over",
                f"{left.in_flight} calls still running, {left.queued} queued: cancelling them "
                "(cause disposed)",
                in_flight=left.in_flight,
                queued=left.queued,
            )

    async def _watch_signals(self, signals: Any) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                if self._state != "serving":
                    lifecycle("signal", f"{name}: ignored while {self._state}", signal=name)
                    continue
                lifecycle("signal", f"{name}: reloading every provider", signal=name)
                try:
                    await self.reload(None)
                except (ToolpoolError, ValueError) as exc:
                    lifecycle(
                        "reload_failed",
                        f"reload failed, the old workers serve on: {exc}",
                        level=logging.ERROR,
                    )
                continue
            if self._state in ("draining", "stopped"):
                lifecycle("signal", f"{name} again: forcing", signal=name)
                self.force()
            else:
                lifecycle("signal", f"{name}: draining", signal=name)
                self.drain()


class _Listener:
    """uvicorn on a socket the service bound, without uvicorn's own signal handling (the
    service handles the signals: a SIGTERM drains first)."""

    def __init__(self, app: ServiceApp, sock: socket.socket) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Generator[None, None, None]:
                yield

        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=int(_HTTP_SHUTDOWN_GRACE),
            server_header=False,
        )
        self._server = Server(config)
        self._sock = sock
        self._done = anyio.Event()

    async def serve(self) -> None:
        try:
            await self._server.serve(sockets=[self._sock])
        finally:
            self._done.set()

    async def stop(self) -> None:
        self._server.should_exit = True
        await self._done.wait()


def _first_failure(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error that stopped the service, out of its task group's exception group."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_failure(exc)
        return exc
    return group


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _alive(pid: int) -> bool:
    """Whether ``pid`` (a child of this process) runs: not gone, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _refused(uid: int) -> None:
    lifecycle(
        "control_refused",
        f"control socket: refused a connection from uid {uid}",
        level=logging.WARNING,
        uid=uid,
    )


def _log_event(event: PoolEvent) -> None:
    if isinstance(event, ProviderAdded):
        p = event.provider
        lifecycle(
            "provider_added",
            f"provider {p.name} serves {len(p.tools)} tools with {p.workers} workers "
            f"(profile {p.profile}, generation {p.generation})",
            provider=p.name,
            tools=sorted(p.tools),
            workers=p.workers,
            profile=p.profile,
            generation=p.generation,
            containment=dict(p.containment),
        )
    elif isinstance(event, ProviderRemoved):
        lifecycle(
            "provider_removed",
            f"provider {event.name} removed ({event.reason})",
            provider=event.name,
            reason=event.reason,
        )
    elif isinstance(event, ProviderResized):
        lifecycle(
            "provider_resized",
            f"provider {event.name}: {event.old} -> {event.new} workers ({event.reason})",
            provider=event.name,
            old=event.old,
            new=event.new,
            reason=event.reason,
        )
    elif isinstance(event, WorkerStarted):
        lifecycle(
            "worker_started",
            f"worker {event.pid} of {event.provider} started",
            provider=event.provider,
            worker_pid=event.pid,
        )
    elif isinstance(event, WorkerExited):
        level = logging.INFO if event.why in ("retired",) else logging.WARNING
        lifecycle(
            "worker_exited",
            f"worker {event.pid} of {event.provider} exited ({event.why})",
            level=level,
            provider=event.provider,
            worker_pid=event.pid,
            why=str(event.why),
        )


def _metrics_registry(pool: Pool, service: Service) -> Any:
    """A registry of the pool's metrics and the service's own (``toolpool_service_*``)."""
    from prometheus_client import CollectorRegistry

    from .. import metrics

    registry = CollectorRegistry(auto_describe=True)
    metrics.register(pool, registry)
    registry.register(ServiceCollector(service))
    return registry


class ServiceCollector:
    """The service's own metrics: its state, and how busy its workers are (what an
    autoscaler reads: ``deploy/kubernetes/hpa.yaml``)."""

    def __init__(self, service: Service) -> None:
        self._service = service

    def describe(self) -> list[Any]:
        return self._families()

    def collect(self) -> list[Any]:
        state, busy = self._families()
        service = self._service
        for s in ("starting", "serving", "draining", "stopped"):
            state.add_metric([s], 1.0 if service.state == s else 0.0)
        pool = service._pool
        stats: Mapping[str, int] = pool.statistics().workers if pool is not None else {}
        serving = sum(stats.get(s, 0) for s in _SERVING)
        busy.add_metric([], stats.get("busy", 0) / serving if serving else 0.0)
        return [state, busy]

    @staticmethod
    def _families() -> list[Any]:
        from prometheus_client.core import GaugeMetricFamily

        return [
            GaugeMetricFamily(
                "toolpool_service_state",
                "1 for the state the service is in (starting, serving, draining, stopped)",
                labels=["state"],
            ),
            GaugeMetricFamily(
                "toolpool_service_busy_ratio",
                "busy workers / workers that serve (ready, busy, cleaning), over every "
                "provider; 0 when none serves",
            ),
        ]
