"""The shell's side of providers: their options, their containment, the public calls that
add, remove, reload and resize them, and the events consumers mirror (``_events.py``).

The decisions are the core's (``machine/_fleet.py``); this turns its provider actions into
events for the listeners and waits, for the caller, until what it asked for holds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal

from ..core import (
    ConfigurationError,
    Graces,
    PoolClosedError,
    ToolConflictError,
    WorkerStartError,
    check_seconds,
)
from ..sandbox import Profile, parse_size
from ..sandbox._cgroups import CgroupSet
from ._containment import containment_report, supervisor_layers
from ._events import (
    Listener,
    Listeners,
    PoolEvent,
    ProviderAdded,
    ProviderInfo,
    ProviderRemoved,
    ProviderResized,
    ToolsChanged,
    WorkerExited,
    WorkerStarted,
    frozen_catalog,
)
from ._results import ContainmentReport
from .machine import (
    Autoscale,
    CoreConfig,
    Machine,
    ProviderDown,
    ProviderRecord,
    ProviderSpec,
    ProviderUp,
    Resized,
    Unkillable,
    WorkerDown,
    WorkerUp,
)

__all__ = (
    "DEFAULT_PREFETCH",
    "Hosting",
    "PoolOptions",
    "ProviderOptions",
    "StartMethod",
    "WorkerOutput",
    "checked_profile",
    "provider_options",
)

WorkerOutput = Literal["discard", "inherit"]
StartMethod = Literal["fork", "spawn"]

#: Calls a busy worker may hold queued (``Pool(prefetch=None)``), but see there. 16 (with 16
#: results held back and 32 ledger slots of 32 KiB) took no-op throughput from 19.5k to 23k
#: calls/s against prefetch 8 (docs/performance.md, "What each change bought", aaf8352).
DEFAULT_PREFETCH: Final = 16


@dataclass(slots=True, kw_only=True)
class ProviderOptions:
    """What the shell needs to start a provider's workers (the core has its ``spec``)."""

    name: str
    tools: str
    workers: int
    profile: Profile
    env: dict[str, str] | None
    allow_background: bool
    capture_output: int | None
    warm_spares: int
    prefetch: int
    timeout: float | None
    max_calls: int | None = None
    layers: dict[str, tuple[bool, str]] | None = None  # the supervisor's side, once prepared
    cgroups: CgroupSet | None = None

    def spec(self) -> ProviderSpec:
        return ProviderSpec(
            tools_spec=self.tools,
            size=self.workers,
            warm_spares=self.warm_spares,
            prefetch=self.prefetch,
            allow_background=self.allow_background,
            memory_cap=self.profile.memory,
            max_calls=self.max_calls,
        )


def default_workers() -> int:
    """The default worker count: the CPUs this process may run on (its affinity mask, and
    on Python 3.13+ ``PYTHON_CPU_COUNT`` / ``-X cpu_count`` too), at least 1."""
    counter = getattr(os, "process_cpu_count", None)  # Python 3.13+
    if counter is not None:
        count = counter()
    else:
        try:
            count = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # (no affinity on this platform)
            count = os.cpu_count()
    return max(1, count or 1)


def check_count(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive" if minimum == 1 else "a non-negative"
        raise ValueError(f"{name} must be {what} integer, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolOptions:
    """The options that are the pool's own, not a provider's (``Pool(...)``'s arguments of
    those names): :meth:`check` them, then hand the machine its :meth:`core_config`."""

    cancel_grace: float
    term_grace: float
    drain_grace: float
    unkillable_after: float
    start_timeout: float
    max_frame: int
    max_start_failures: int
    worker_output: WorkerOutput
    start_method: StartMethod
    heartbeat: float | None

    def check(self) -> None:
        """Raise a clear error for the first bad option."""
        check_count("max_start_failures", self.max_start_failures, minimum=1)
        heartbeat = self.heartbeat
        seconds = {
            "cancel_grace": self.cancel_grace,
            "term_grace": self.term_grace,
            "start_timeout": self.start_timeout,
            "drain_grace": self.drain_grace,
            "unkillable_after": self.unkillable_after,
            "heartbeat": 1.0 if heartbeat is None else heartbeat,
        }
        for name, value in seconds.items():
            check_seconds(name, value)
        if self.worker_output not in ("discard", "inherit"):
            raise ValueError("worker_output must be 'discard' or 'inherit'")
        max_frame = self.max_frame
        if isinstance(max_frame, bool) or not isinstance(max_frame, int) or max_frame < 1024:
            raise ValueError("max_frame must be an integer of at least 1024 bytes")
        if self.start_method not in ("fork", "spawn"):
            raise ValueError(f"start_method must be 'fork' or 'spawn', got {self.start_method!r}")
        if not self.unkillable_after > 0:
            raise ValueError("unkillable_after must be a positive number of seconds")
        if heartbeat is not None and not heartbeat > 0:
            raise ValueError("heartbeat must be a positive number of seconds, or None")

    @property
    def graces(self) -> Graces:
        return Graces(
            cancel=self.cancel_grace,
            term=self.term_grace,
            drain=self.drain_grace,
            unkillable_after=self.unkillable_after,
        )

    def core_config(self) -> CoreConfig:
        """What the machine's decisions need of them."""
        return CoreConfig(
            graces=self.graces,
            start_timeout=float(self.start_timeout),
            max_frame=self.max_frame,
            max_start_failures=self.max_start_failures,
            heartbeat=None if self.heartbeat is None else float(self.heartbeat),
        )


def checked_profile(profile: object) -> Profile:
    """A profile, or its name (``"default"``, ``"untrusted"``), as a :class:`Profile`."""
    if isinstance(profile, str):
        profile = Profile.named(profile)
    if not isinstance(profile, Profile):
        raise TypeError(f"profile must be a toolpool.Profile or a name, not {profile!r}")
    return profile


def provider_options(
    name: str,
    tools: object,
    *,
    workers: int | None,
    profile: Profile | str,
    env: Mapping[str, str] | None,
    allow_background: bool,
    capture_output: int | str | None,
    warm_spares: int,
    prefetch: int | None,
    timeout: float | None,
    max_frame: int,
    max_calls_per_worker: int | None = None,
) -> ProviderOptions:
    """Check a provider's options; raise a clear error for each bad one."""
    if not isinstance(name, str) or not name or not name.isprintable():
        raise ValueError(f"a provider's name is a non-empty printable str, not {name!r}")
    if not isinstance(tools, str) or ":" not in tools:
        raise ConfigurationError(f"tools must be 'module:attribute', got {tools!r}")
    if workers is None:
        workers = default_workers()
    check_count("workers", workers, minimum=1)
    check_count("warm_spares", warm_spares, minimum=0)
    profile = checked_profile(profile)
    if prefetch is None:
        prefetch = 0 if profile.user is not None else DEFAULT_PREFETCH
    check_count("prefetch", prefetch, minimum=0)
    captured = parse_size(capture_output)
    if captured is not None and captured > max_frame // 2:
        raise ValueError("capture_output must be at most half of max_frame")
    if timeout is not None:
        check_seconds("timeout", timeout, positive=True)
    if max_calls_per_worker is not None:
        check_count("max_calls_per_worker", max_calls_per_worker, minimum=1)
    return ProviderOptions(
        name=name,
        tools=tools,
        workers=workers,
        profile=profile,
        env=dict(env) if env is not None else None,
        allow_background=bool(allow_background),
        capture_output=captured,
        warm_spares=warm_spares,
        prefetch=prefetch,
        timeout=None if timeout is None else float(timeout),
        max_calls=max_calls_per_worker,
    )


def runs_in(report: ContainmentReport, profile: Profile, timeout: float | None) -> dict[str, Any]:
    """Where a provider's tools really run, from the layers its workers applied (never from
    its name): for a consumer describing a tool to a model."""
    fs = "read-write"
    if report.active("readonly_fs") or report.active("landlock"):
        fs = "read-only"
        if report.active("scratch_dir"):
            fs += ", writable scratch directory"
    elif report.active("scratch_dir"):
        fs = "read-write, private scratch directory as working directory"
    return {
        "network": "none" if report.active("netns") else "host",
        "filesystem": fs,
        "memory_cap": profile.memory if report.active("cgroup_memory") else None,
        "cpu_limit_s": profile.cpu_time if report.active("rlimits") else None,
        "timeout_s": timeout,
        "profile": profile.name,
    }


class Hosting:
    """The part of :class:`toolpool.Pool` that adds, removes, reloads and resizes providers."""

    # (the pool's, set in Pool.__init__ and Pool.start)
    max_frame: int
    start_timeout: float
    _core: Machine
    _options: dict[str, ProviderOptions]
    _listeners: Listeners
    _rollbacks: dict[int, tuple[BaseException, list[Listener]]]
    _infos: dict[int, ProviderInfo]

    def _check_open(self) -> None:
        raise NotImplementedError

    def _pump(self) -> None:
        raise NotImplementedError

    async def _wait_changed(self) -> None:
        raise NotImplementedError

    def _prepare(self, options: ProviderOptions) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ public API

    async def add_provider(
        self,
        name: str,
        tools: str,
        *,
        workers: int | None = None,
        profile: Profile | str = "default",
        env: Mapping[str, str] | None = None,
        allow_background: bool = False,
        capture_output: int | str | None = None,
        warm_spares: int = 0,
        prefetch: int | None = None,
        timeout: float | None = None,
        max_calls_per_worker: int | None = None,
    ) -> ProviderInfo:
        """Start a provider: ``workers`` processes running the tools of ``tools``
        (``"module:attribute"``), under ``profile``; ``workers=None`` (default): one per CPU
        this process may use. Returns once every one of them is ready
        and its tools resolve, after the listeners saw :class:`toolpool.ProviderAdded`.

        ``timeout``: the default timeout of its calls (``submit`` may give another). The other
        options mean what :class:`toolpool.Pool`'s do.

        Raises :class:`toolpool.ToolConflictError` if another provider has a tool of the same
        name (nothing changes), :class:`toolpool.WorkerStartError` if its workers cannot
        start, and whatever an add listener raised (the add is then rolled back).
        """
        self._check_open()
        core = self._core
        if name in core.providers or name in core.pending:
            raise ValueError(f"a provider named {name!r} exists")
        options = provider_options(
            name,
            tools,
            workers=workers,
            profile=profile,
            env=env,
            allow_background=allow_background,
            capture_output=capture_output,
            warm_spares=warm_spares,
            prefetch=prefetch,
            timeout=timeout,
            max_frame=self.max_frame,
            max_calls_per_worker=max_calls_per_worker,
        )
        self._prepare(options)
        self._options[name] = options
        p = core.add_provider(name, options.spec(), time.monotonic())
        self._pump()
        try:
            return await self._until_active(p)
        except BaseException:
            if self._options.get(name) is options and name not in core.providers:
                self._drop_options(options)
            raise

    async def reload_provider(self, name: str) -> ProviderInfo:
        """Start provider ``name``'s workers afresh (a fresh import of its tools) and swap
        them in, in one turn of the event loop, once every new worker is ready: no submit
        meanwhile finds its tools missing. Listeners see :class:`toolpool.ProviderRemoved`
        (reason ``"reloaded"``) then :class:`toolpool.ProviderAdded`; the old workers drain
        as on removal; returns once they are gone. If the new workers cannot start, the old
        ones serve on and :class:`toolpool.WorkerStartError` is raised."""
        self._check_open()
        self._known(name)
        old = self._core.providers[name]
        p = self._core.reload_provider(name, time.monotonic())
        self._pump()
        info = await self._until_active(p)
        await self._until_gone([old])
        return info

    async def remove_provider(self, name: str) -> None:
        """Take provider ``name`` out. Its tools resolve no more at once
        (:class:`toolpool.UnknownToolError`); its queued calls settle
        ``aborted_before_dispatch`` (cause ``disposed``); its running calls get the pool's
        ``drain_grace`` seconds to finish, then a cooperative cancel (cause ``disposed``) and
        the ladder. Returns when every worker of it is gone."""
        self._check_open()
        self._known(name)
        core = self._core
        records = [core.providers.get(name), core.pending.get(name)]
        core.remove_provider(name, "removed", time.monotonic())
        self._pump()
        await self._until_gone([p for p in records if p is not None])
        options = self._options.get(name)
        if options is not None and name not in core.providers and name not in core.pending:
            self._drop_options(options)

    async def resize(self, name: str, workers: int, *, force: bool = False) -> None:
        """Grow or shrink provider ``name`` to ``workers`` processes (its warm spares come on
        top). Growing returns when the new workers are ready. Shrinking retires idle workers
        first, then drains busy ones (their call finishes, then they exit) and returns when
        they are gone; ``force=True`` cancels their calls instead (cause ``disposed``,
        escalating like any cancel). No call is lost or run twice."""
        self._check_open()
        self._known(name)
        check_count("workers", workers, minimum=1)
        core = self._core
        p = core.providers.get(name) or core.pending[name]
        self._options[name].workers = workers
        core.resize(name, workers, time.monotonic(), force=force)  # (ends autoscaling)
        self._pump()
        want = workers + p.spec.warm_spares
        while not self._closing_now() and p.live:
            mine = [w for w in core.workers.values() if w.provider is p]
            serving = [w for w in mine if core.fleet.serves(w)]
            ready = [w for w in serving if w.start_method is not None and w.answered]
            if len(mine) <= want and len(ready) >= want:
                break
            if p.broken is not None:
                raise p.broken
            await self._wait_changed()

    async def autoscale(
        self,
        name: str,
        *,
        min: int,  # (the spelling: pool.autoscale(name, min=, max=))
        max: int,
        grow_after: float = 0.05,
        idle_after: float = 30.0,
    ) -> None:
        """Let the pool size provider ``name`` between ``min`` and ``max`` workers: every
        0.1 s it adds one worker if a call has waited ``grow_after`` seconds for one (in the
        queue, or queued in a busy worker behind another call), and takes one idle worker
        out if nothing waits and a worker has been idle ``idle_after`` seconds. Each decision
        is a :class:`toolpool.ProviderResized` event saying why. A later :meth:`resize`
        ends it. Returns at once (a size outside the bounds is corrected now)."""
        self._check_open()
        self._known(name)
        check_count("min", min, minimum=1)
        check_count("max", max, minimum=1)
        if max < min:
            raise ValueError(f"max ({max}) must be at least min ({min})")
        check_seconds("grow_after", grow_after)
        check_seconds("idle_after", idle_after)
        policy = Autoscale(minimum=min, maximum=max, grow_after=grow_after, idle_after=idle_after)
        self._core.autoscale(name, policy, time.monotonic())
        self._pump()

    @property
    def providers(self) -> Mapping[str, ProviderInfo]:
        """The active providers by name (frozen :class:`toolpool.ProviderInfo`)."""
        return MappingProxyType({name: self._info(p) for name, p in self._core.providers.items()})

    def subscribe(self, listener: Listener, *, replay: bool = False) -> Callable[[], None]:
        """Call ``listener(event)`` (synchronously, in the pool's event loop) for every
        lifecycle event (:data:`toolpool.PoolEvent`). ``replay=True`` first hands it the
        providers there are as :class:`toolpool.ProviderAdded` and the catalog as
        :class:`toolpool.ToolsChanged`, so that it mirrors the pool whatever started
        first. Returns a function that unsubscribes it.

        A listener that raises on :class:`toolpool.ProviderAdded` rolls that add back (and
        ``add_provider`` raises its error); on any other event it is logged and ignored."""
        events: list[PoolEvent] = []
        if replay:
            events = [ProviderAdded(info) for info in self.providers.values()]
            events.append(ToolsChanged(frozen_catalog(self._catalog_now())))
        return self._listeners.subscribe(listener, events)

    # ------------------------------------------------------------------ helpers

    def _closing_now(self) -> bool:
        return self._core.closing

    def _known(self, name: str) -> None:
        if name not in self._core.providers and name not in self._core.pending:
            known = sorted(self._core.providers)
            raise LookupError(f"no provider named {name!r}; there are: {known}")

    async def _until_active(self, p: ProviderRecord) -> ProviderInfo:
        core = self._core
        while p.state == "starting" and not core.closing:
            await self._wait_changed()
        rollback = self._rollbacks.pop(p.id, None)
        if rollback is not None:
            await self._until_gone([p])
            raise rollback[0]
        if p.state == "failed":
            await self._until_gone([p])
            if isinstance(p.error, ToolConflictError):
                raise ToolConflictError(str(p.error))
            raise p.broken or WorkerStartError(f"provider {p.name!r} did not start")
        if core.closing:
            raise PoolClosedError("the pool closed while the provider started")
        return self._info(p)

    async def _until_gone(self, records: list[ProviderRecord]) -> None:
        core = self._core
        while any(w.provider in records for w in core.workers.values()):
            await self._wait_changed()

    def _drop_options(self, options: ProviderOptions) -> None:
        if self._options.get(options.name) is options:
            del self._options[options.name]
        if options.cgroups is not None:
            options.cgroups.remove()
            options.cgroups = None

    def _info(self, p: ProviderRecord) -> ProviderInfo:
        info = self._infos.get(p.id)
        if info is None or info.workers != p.spec.size:
            options = self._options[p.name]
            report = self._report(options, p)
            facts = MappingProxyType(runs_in(report, options.profile, options.timeout))
            tools = {
                tool: MappingProxyType({**desc, "provider": p.name, "runs_in": facts})
                for tool, desc in p.catalog.items()
            }
            info = ProviderInfo(
                name=p.name,
                tools_spec=p.spec.tools_spec,
                profile=options.profile.name,
                workers=p.spec.size,
                generation=p.generation,
                tools=MappingProxyType(tools),
                containment=MappingProxyType({la.name: la.active for la in report.layers}),
            )
            self._infos[p.id] = info
        return info

    def _report(self, options: ProviderOptions, p: ProviderRecord | None) -> ContainmentReport:
        return containment_report(
            options.profile, options.layers or {}, p.worker_layers if p is not None else None
        )

    def _catalog_now(self) -> dict[str, Mapping[str, Any]]:
        out: dict[str, Mapping[str, Any]] = {}
        for p in self._core.providers.values():
            out.update(self._info(p).tools)
        return out

    # ------------------------------------------------------------------ the core's actions

    def _on_provider_action(
        self, action: ProviderUp | ProviderDown | Resized | WorkerUp | WorkerDown | Unkillable
    ) -> None:
        listeners = self._listeners
        if isinstance(action, Unkillable):
            w = self._core.workers.get(action.wid)
            if w is not None:  # out of service now (its end, much later, is not told again)
                listeners.emit(WorkerExited(w.pid, w.provider.name, "unkillable"))
        elif isinstance(action, Resized):
            options = self._options.get(action.provider.name)
            if options is not None:
                options.workers = action.new
            listeners.emit(
                ProviderResized(action.provider.name, action.old, action.new, action.reason)
            )
        elif isinstance(action, WorkerUp):
            listeners.emit(WorkerStarted(action.pid, action.provider))
        elif isinstance(action, WorkerDown):
            why: Any = action.why
            listeners.emit(WorkerExited(action.pid, action.provider, why))
        elif isinstance(action, ProviderUp):
            p = action.provider
            if action.replaced is not None:
                listeners.emit(ProviderRemoved(p.name, "reloaded"))
                self._infos.pop(action.replaced.id, None)
            error, seen = listeners.emit_added(ProviderAdded(self._info(p)))
            if error is not None:
                self._rollbacks[p.id] = (error, seen)
                self._core.remove_provider(p.name, "rolled back", time.monotonic())
                return
            listeners.emit(ToolsChanged(frozen_catalog(self._catalog_now())))
        elif isinstance(action, ProviderDown):
            p = action.provider
            self._infos.pop(p.id, None)
            rollback = self._rollbacks.get(p.id)
            if action.reason == "rolled back" and rollback is not None:
                listeners.emit_to(rollback[1], ProviderRemoved(p.name, action.reason))
            else:
                listeners.emit(ProviderRemoved(p.name, action.reason))
                listeners.emit(ToolsChanged(frozen_catalog(self._catalog_now())))


def cgroup_name(pool: object, provider: str) -> str:
    """A cgroup set's name, unique per pool and provider."""
    base = f"toolpool-{os.getpid()}-{id(pool):x}"
    if provider == "default":
        return base
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in provider)[:40]
    return f"{base}-{safe}"


def prepare_layers(options: ProviderOptions, pool: object, *, subreaper: bool) -> None:
    """The supervisor's side of a provider's containment (its cgroups): raise if the profile
    requires a layer this machine lacks."""
    options.layers, options.cgroups = supervisor_layers(
        options.profile, subreaper=subreaper, cgroup_name=cgroup_name(pool, options.name)
    )
