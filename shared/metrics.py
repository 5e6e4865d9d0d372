"""Prometheus metrics plumbing every service shares.

Each service object owns its own CollectorRegistry (never prometheus_client's global one),
so tests and several instances in one process never collide. Counters and histograms are
updated where things happen; gauges that mirror state (queues, pools, indexes) are read at
scrape time by a `ScrapeCollector`, so there is no second copy of the bookkeeping to drift.

The gateway serves /metrics on its API port. Services without an HTTP API (conductor,
kvmanager, prefill, decode) serve it on `metrics_port` (a BaseSettings field: 0 = off).
Names follow Prometheus conventions: `halfmoon_` prefix, base units (`_seconds`, `_bytes`),
`_total` on counters.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Awaitable, Callable, Iterable, Sequence, TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

log = logging.getLogger(__name__)
F = TypeVar("F", GaugeMetricFamily, CounterMetricFamily)

# `_created` series double the output and no dashboard here reads them.
disable_created_metrics()

# Request-scale latencies on a loaded CPU box reach minutes (TTFT under a queue, e2e).
LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
)
# Per-token and per-step times: milliseconds to a few seconds.
FAST_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
)
# Control-plane decisions: tens of microseconds up.
DECISION_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


class ScrapeCollector:
    """Metric families computed at scrape time by `fn` from a service's own state."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self.fn = fn

    def collect(self) -> Iterable[Metric]:
        return list(self.fn())

    def describe(self) -> list[Metric]:
        return []  # names are only known at scrape time; nothing to pre-register


def _family(
    cls: type[F],
    name: str,
    doc: str,
    value: float | None,
    labels: Sequence[str],
    samples: Iterable[tuple[Sequence[str], float]],
) -> F:
    fam = cls(name, doc, value=value, labels=labels if value is None else None)
    for label_values, v in samples:
        fam.add_metric(list(label_values), v)
    return fam


def gauge(
    name: str,
    doc: str,
    value: float | None = None,
    labels: Sequence[str] = (),
    samples: Iterable[tuple[Sequence[str], float]] = (),
) -> GaugeMetricFamily:
    return _family(GaugeMetricFamily, name, doc, value, labels, samples)


def counter(
    name: str,
    doc: str,
    value: float | None = None,
    labels: Sequence[str] = (),
    samples: Iterable[tuple[Sequence[str], float]] = (),
) -> CounterMetricFamily:
    """A counter whose running total lives elsewhere (the engine, an index)."""
    return _family(CounterMetricFamily, name, doc, value, labels, samples)


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def metrics_handler(
    registry: CollectorRegistry,
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.Response:
        # Our names are all legacy-valid, so this is the 0.0.4 text format every Prometheus
        # reads (the library's "latest" label, 1.0.0, trips older scrapers).
        return web.Response(
            body=exposition(registry), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4}
        )

    return handle


async def start_metrics_server(
    registry: CollectorRegistry, host: str, port: int
) -> web.AppRunner | None:
    """Serve GET /metrics on host:port; None when port is 0 or cannot be bound.

    A port that is taken only costs the metrics (logged), never the service itself:
    serving requests matters more than being observed.
    """
    if not port:
        return None
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(registry))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        log.warning("metrics not served: cannot listen on %s:%d (%s)", host, port, exc)
        await runner.cleanup()
        return None
    log.info("metrics on http://%s:%d/metrics", host, port)
    return runner


async def serve_metrics(
    stack: contextlib.AsyncExitStack, registry: CollectorRegistry, host: str, port: int
) -> web.AppRunner | None:
    """`start_metrics_server`, stopped when `stack` closes."""
    runner = await start_metrics_server(registry, host, port)
    if runner is not None:
        stack.push_async_callback(runner.cleanup)
    return runner
