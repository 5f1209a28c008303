"""A pool's state and history as Prometheus metrics (``pip install 'toolpool[metrics]'``).

>>> registry = prometheus_client.CollectorRegistry()  # doctest: +SKIP
>>> toolpool.metrics.register(pool, registry)          # doctest: +SKIP

A :class:`PoolCollector` reads the pool when the registry is scraped, and only then: the pool
keeps plain counters (and, for the two histograms, an array of bucket counts in its core), and
nothing of ``prometheus_client`` runs while calls do. See ``docs/metrics.md`` for the metrics.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Final

try:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry
    from prometheus_client.utils import floatToGoString
except ImportError as exc:  # pragma: no cover (the extra is installed for the tests)
    raise ImportError(
        "toolpool.metrics needs prometheus_client: pip install 'toolpool[metrics]'"
    ) from exc

from .supervisor._results import Histogram, Rung, Statistics, WorkerState

if TYPE_CHECKING:
    from .supervisor import Pool

__all__ = ("DEFAULT_PROVIDER", "PoolCollector", "provider_statistics", "register")

#: The provider label of a pool's workers and calls while a pool has one provider.
DEFAULT_PROVIDER: Final = "default"
#: The worker states reported (each one, 0 included, so that every series always exists).
STATES: Final = tuple(s.value for s in WorkerState if s is not WorkerState.EXITED)
#: The rungs reported (``none`` is no escalation, not counted).
RUNGS: Final = tuple(r.value for r in Rung if r is not Rung.NONE)
_LABEL_NAME: Final = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_OWN_LABELS: Final = frozenset({"provider", "state", "tool", "outcome", "rung", "le"})


def provider_statistics(pool: Pool) -> Mapping[str, Statistics]:
    """The pool's statistics by provider name: the one place the collector learns what the
    providers are: those the pool has, and those it had (their counters stay, never going
    back). Calls no provider took (a tool gone by the time they were queued) are under
    ``""``, reported only when there are some."""
    return pool.provider_statistics()


class PoolCollector(Collector):
    """A Prometheus collector for :class:`toolpool.Pool` objects, read at scrape time.

    ``labels`` are added to every sample of ``pool``; further pools join with :meth:`add`,
    each with other values of the same label names (``{"pool": "search"}``), since a
    registry takes each metric name from one collector only. ``namespace`` begins every
    metric's name. The collector holds its pools weakly: a pool that is gone reports nothing.
    A closed pool reports what it did, and no worker.
    """

    def __init__(
        self,
        pool: Pool,
        *,
        labels: Mapping[str, str] | None = None,
        namespace: str = "toolpool",
    ) -> None:
        if not isinstance(namespace, str) or not _LABEL_NAME.match(namespace):
            raise ValueError(f"not a metric namespace: {namespace!r}")
        checked = _check_labels(labels)
        self._names = tuple(checked)
        self._ns = namespace
        self._pools: list[tuple[weakref.ref[Pool], tuple[str, ...]]] = []
        self.add(pool, labels=checked)

    @property
    def namespace(self) -> str:
        return self._ns

    def add(self, pool: Pool, *, labels: Mapping[str, str] | None = None) -> None:
        """Report ``pool`` too, its samples labelled ``labels``: the same label names as the
        collector's first pool, other values (else ValueError)."""
        checked = _check_labels(labels)
        if tuple(checked) != self._names:
            raise ValueError(
                f"labels {sorted(checked)} are not this collector's {sorted(self._names)}"
            )
        values = tuple(checked.values())
        self._pools = [(ref, v) for ref, v in self._pools if ref() is not None]
        for ref, known in self._pools:
            if ref() is pool or known == values:
                held = dict(zip(self._names, known, strict=True))
                raise ValueError(
                    f"this collector reports a pool with labels {held} already: give each "
                    "pool its own label values"
                )
        self._pools.append((weakref.ref(pool), values))

    def remove(self, pool: Pool) -> None:
        """Report ``pool`` no more."""
        self._pools = [(ref, v) for ref, v in self._pools if ref() not in (None, pool)]

    # ------------------------------------------------------------------ families

    def _families(self) -> dict[str, Metric]:
        ns, own = self._ns, list(self._names)

        def gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{ns}_{name}", doc, labels=[*own, *labels])

        def counter(name: str, doc: str, *labels: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"{ns}_{name}", doc, labels=[*own, *labels])

        def histogram(name: str, doc: str, *labels: str) -> HistogramMetricFamily:
            return HistogramMetricFamily(f"{ns}_{name}", doc, labels=[*own, *labels])

        return {
            "workers": gauge("workers", "Worker processes by state.", "provider", "state"),
            "queued": gauge(
                "queue_depth",
                "Calls not begun yet: in the pool's queue, or queued in a busy worker.",
                "provider",
            ),
            "oldest": gauge(
                "oldest_queued_wait_seconds",
                "How long the oldest call in the pool's queue has waited (0: none queued).",
                "provider",
            ),
            "in_flight": gauge(
                "calls_in_flight", "Calls a worker runs or takes up next.", "provider"
            ),
            "unkillable": gauge(
                "unkillable_processes",
                "Processes of unkillable workers' trees still alive (did not die of SIGKILL).",
                "provider",
            ),
            "submitted": counter("calls_submitted", "Calls submitted.", "provider"),
            "settled": counter(
                "calls_settled", "Calls settled, by outcome.", "provider", "tool", "outcome"
            ),
            "escalations": counter(
                "escalations",
                "Settled calls by the highest rung their escalation reached.",
                "provider",
                "rung",
            ),
            "started": counter("workers_started", "Worker processes started.", "provider"),
            "replaced": counter(
                "workers_replaced", "Workers replaced after a death or kill.", "provider"
            ),
            "unkillable_workers": counter(
                "workers_unkillable",
                "Workers whose tree did not go within unkillable_after of its SIGKILL.",
                "provider",
            ),
            "latency": histogram(
                "settle_latency_seconds", "Seconds from submission to settlement.", "provider"
            ),
            "kill": histogram(
                "kill_to_reaped_seconds",
                "Seconds from the SIGKILL of a worker's tree to its whole tree gone.",
                "provider",
            ),
        }

    def describe(self) -> Iterable[Metric]:
        """The metric families, without samples (what ``registry.register`` checks)."""
        return list(self._families().values())

    def collect(self) -> Iterable[Metric]:
        """The metrics, read from the pools now."""
        families = self._families()
        for ref, values in self._pools:
            pool = ref()
            if pool is None:
                continue
            for provider, stats in provider_statistics(pool).items():
                self._add(families, values, provider, stats)
        return list(families.values())

    def _add(
        self, f: Mapping[str, Metric], values: tuple[str, ...], provider: str, stats: Statistics
    ) -> None:
        at = [*values, provider]
        workers = f["workers"]
        assert isinstance(workers, GaugeMetricFamily)
        for state in (*STATES, *sorted(set(stats.workers) - set(STATES))):
            workers.add_metric([*at, state], stats.workers.get(state, 0))
        _gauge(f["queued"]).add_metric(at, stats.queued)
        _gauge(f["oldest"]).add_metric(at, stats.oldest_queued_wait or 0.0)
        _gauge(f["in_flight"]).add_metric(at, stats.in_flight)
        _gauge(f["unkillable"]).add_metric(at, len(stats.unkillable))
        _counter(f["submitted"]).add_metric(at, stats.submitted)
        settled = _counter(f["settled"])
        for tool, outcomes in sorted(stats.settled_by_tool.items()):
            for outcome, n in sorted(outcomes.items()):
                settled.add_metric([*at, tool, outcome], n)
        escalations = _counter(f["escalations"])
        for rung in RUNGS:
            escalations.add_metric([*at, rung], stats.escalations.get(rung, 0))
        _counter(f["started"]).add_metric(at, stats.workers_started)
        _counter(f["replaced"]).add_metric(at, stats.workers_replaced)
        _counter(f["unkillable_workers"]).add_metric(at, stats.workers_unkillable)
        for key, hist in (("latency", stats.settle_latency), ("kill", stats.kill_to_reaped)):
            if hist is not None:
                family = f[key]
                assert isinstance(family, HistogramMetricFamily)
                family.add_metric(at, buckets=list(_buckets(hist)), sum_value=hist.sum)


#: The collector ``register`` made for each registry (and namespace).
_REGISTERED: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, PoolCollector]] = (
    weakref.WeakKeyDictionary()
)


def register(
    pool: Pool,
    registry: CollectorRegistry | None = None,
    *,
    labels: Mapping[str, str] | None = None,
    namespace: str = "toolpool",
) -> PoolCollector:
    """Expose ``pool`` on ``registry`` (default: ``prometheus_client.REGISTRY``, what
    ``prometheus_client.start_http_server`` serves); return its collector.

    The pools registered on one registry share one collector (a registry takes each metric
    name from one collector only): give each its own ``labels`` values, with the same label
    names (``{"pool": "search"}``, ``{"pool": "ops"}``). ``collector.remove(pool)`` stops
    reporting one; ``registry.unregister(collector)`` all of them."""
    registry = REGISTRY if registry is None else registry
    mine = _REGISTERED.setdefault(registry, {})
    collector = mine.get(namespace)
    if collector is not None and _still_registered(registry, collector):
        collector.add(pool, labels=labels)
        return collector
    collector = PoolCollector(pool, labels=labels, namespace=namespace)
    registry.register(collector)
    mine[namespace] = collector
    return collector


def _still_registered(registry: CollectorRegistry, collector: Collector) -> bool:
    """Whether ``collector`` was not unregistered since (the registry keeps its collectors
    in a private mapping: where it is not found, assume it was not)."""
    found = getattr(registry, "_collector_to_names", None)
    return True if not isinstance(found, dict) else collector in found


def _check_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    checked = dict(labels or {})
    for name, value in checked.items():
        if not isinstance(name, str) or not _LABEL_NAME.match(name) or name in _OWN_LABELS:
            raise ValueError(f"not a label name this collector can add: {name!r}")
        if not isinstance(value, str):
            raise TypeError(f"label {name!r}: a str value, not {type(value).__name__}")
    return checked


def _gauge(family: Metric) -> GaugeMetricFamily:
    assert isinstance(family, GaugeMetricFamily)
    return family


def _counter(family: Metric) -> CounterMetricFamily:
    assert isinstance(family, CounterMetricFamily)
    return family


def _buckets(hist: Histogram) -> Iterator[tuple[str, float]]:
    for bound, total in hist.cumulative():
        yield ("+Inf" if math.isinf(bound) else _go_float(bound)), total


def _go_float(value: float) -> str:
    """A bucket bound as prometheus_client writes ``le`` (``floatToGoString``, untyped)."""
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]
    return text
