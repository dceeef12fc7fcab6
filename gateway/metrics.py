"""The Prometheus metrics of one gateway process: requests by route and status, request latency, and at
scrape time the queue depth of each served model (entries in its stream: queued + running).

Each application gets its own registry, so several apps in one process (tests) never collide. The
middleware that records requests is in middleware.py; `/metrics` is views/metrics.py.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # each label set's child, looked up once: prometheus_client's labels() checks the values and
        # takes a lock on every call, and a request records two
        self._request_counts: dict[tuple[str, str, int], Counter] = {}
        self._request_latencies: dict[tuple[str, str], Histogram] = {}
        self.requests = Counter(
            "lorafleet_gateway_requests", "HTTP requests served", ["method", "route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "lorafleet_gateway_request_seconds",
            "time from request to the end of the response (a stream's whole length)",
            ["method", "route"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.webhook_calls = Counter(
            "lorafleet_gateway_webhooks",
            "webhook deliveries by outcome: delivered, failed (retried later), abandoned, expired (job gone)",
            ["outcome"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "lorafleet_queue_depth",
            "entries in a model's queue stream (queued + running)",
            ["model"],
            registry=self.registry,
        )

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one request by method, route pattern and status, and record how long it took."""
        count = self._request_counts.get((method, route, status))
        if count is None:
            count = self._request_counts[method, route, status] = self.requests.labels(method, route, str(status))
        count.inc()
        latency = self._request_latencies.get((method, route))
        if latency is None:
            latency = self._request_latencies[method, route] = self.latency.labels(method, route)
        latency.observe(seconds)
