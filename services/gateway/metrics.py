"""Prometheus metrics of the gateway, the client's view: latencies as the client sees them
(from the request's arrival), request outcomes, tokens. Served on GET /metrics."""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import Counter, Gauge, Histogram

from services.gateway.life import RequestLife
from shared import errors
from shared.db.schema import TERMINAL_STATUSES, RequestStatus
from shared.metrics import FAST_BUCKETS, LATENCY_BUCKETS, new_registry

# Reasons seen often enough to show as 0 before the first one happens.
KNOWN_REJECTIONS = ("slo_unattainable", "rejected", "unavailable")
RETRY_REASONS = ("no_conductor", "placement_timeout", "stream_lost")


class GatewayMetrics:
    def __init__(self, in_flight: Callable[[], float] | None = None) -> None:
        self.registry = r = new_registry()
        self.ttft = Histogram(
            "halfmoon_ttft_seconds",
            "Time to first token, from the request's arrival",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "halfmoon_itl_seconds",
            "Inter-token latency: gap between two consecutive token events of a request",
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "halfmoon_e2e_seconds",
            "End-to-end latency of completed requests, arrival until the response is complete",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "halfmoon_requests",
            "Accepted requests (chat and text completions) by final status",
            ["status"],
            registry=r,
        )
        for status in TERMINAL_STATUSES:
            self.requests.labels(status.value)
        self.rejections = Counter(
            "halfmoon_rejections",
            "Requests refused before any compute (HTTP 429/503), by error code",
            ["reason"],
            registry=r,
        )
        for reason in KNOWN_REJECTIONS:
            self.rejections.labels(reason)
        self.retries = Counter(
            "halfmoon_gateway_retries",
            "Requests the gateway placed again after a fault, by why: no_conductor (no "
            "leader for a moment: asked again), placement_timeout (a new attempt), "
            "stream_lost (its instance died or went quiet: placed on another)",
            ["reason"],
            registry=r,
        )
        for reason in RETRY_REASONS:
            self.retries.labels(reason)
        self.prompt_tokens = Counter(
            "halfmoon_prompt_tokens", "Prompt tokens of accepted requests", registry=r
        )
        self.generation_tokens = Counter(
            "halfmoon_generation_tokens", "Tokens generated", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "halfmoon_cached_prompt_tokens", "Prompt tokens served from a KV cache", registry=r
        )
        self.in_flight = Gauge(
            "halfmoon_requests_in_flight", "Requests being served now", registry=r
        )
        if in_flight is not None:
            self.in_flight.set_function(in_flight)

    def token_event(self, arrival: float, previous: float | None, now: float) -> None:
        """A token event arrived at `now`; `previous` is the request's last one (None: first)."""
        if previous is None:
            self.ttft.observe(now - arrival)
        else:
            self.itl.observe(now - previous)

    def rejected(self, exc: errors.HalfmoonError) -> None:
        if exc.status in (429, 503):
            self.rejections.labels(exc.code).inc()

    def finished(self, life: RequestLife, prompt_tokens: int) -> None:
        self.finished_request(
            life.status,
            life.arrival,
            prompt_tokens,
            life.num_tokens,
            life.usage.cached_tokens if life.usage else 0,
        )

    def finished_request(
        self, status: RequestStatus, arrival: float, prompt_tokens: int, generated: int, cached: int
    ) -> None:
        """One client request ended (all its choices, when it has several)."""
        self.requests.labels(status.value).inc()
        if status == RequestStatus.COMPLETED:
            self.e2e.observe(time.time() - arrival)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.cached_prompt_tokens.inc(cached)
