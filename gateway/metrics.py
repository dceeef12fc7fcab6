"""The Prometheus metrics of one gateway process: requests by route and status, request latency, and at
scrape time the queue depth of each served model (entries in its streams: queued + running), and
where routing placed jobs (gateway/routing.py).

Each application gets its own registry, so several apps in one process (tests) never collide. The
middleware that records requests is in middleware.py (the numbers are request_metrics.py's);
`/metrics` is views/metrics.py.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.request_metrics import RequestMetrics

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests = RequestMetrics(_LATENCY_BUCKETS_S)
        self.registry.register(self._requests)
        self.webhook_calls = Counter(
            "lorafleet_gateway_webhooks",
            "webhook deliveries by outcome: delivered, failed (retried later), abandoned, expired (job gone)",
            ["outcome"],
            registry=self.registry,
        )
        self.jobs_placed = Counter(
            "lorafleet_gateway_jobs_placed",
            "jobs queued, by where routing put them: shared (any worker), gpu / host (a worker holding the "
            "adapter in that tier), home (the adapter's consistent-hash worker), spill (its home had no room), "
            "backlog (no worker had room: the first preferred worker within the bounded load)",
            ["model", "placement"],
            registry=self.registry,
        )
        self.jobs_placed_away = Counter(
            "lorafleet_gateway_jobs_placed_away",
            "of lorafleet_gateway_jobs_placed, the jobs put on a worker other than their adapter's home, by "
            "placement (a copy of the adapter on another worker: what keeps routing below its hit-rate ceiling)",
            ["model", "placement"],
            registry=self.registry,
        )
        self.alias_jobs = Counter(
            "lorafleet_gateway_alias_jobs",
            "jobs queued through an adapter alias, by alias and the adapter its weights drew (a canary's share)",
            ["alias", "adapter"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "lorafleet_queue_depth",
            "entries in a model's streams of one priority class, shared and routed (queued + running)",
            ["model", "priority"],
            registry=self.registry,
        )
        self.queue_wait = Gauge(
            "lorafleet_queue_oldest_seconds",
            "age of the oldest entry in a model's streams of one priority class, shared and routed (0 when empty)",
            ["model", "priority"],
            registry=self.registry,
        )

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one request by method, route pattern and status, and record how long it took."""
        self._requests.observe(method, route, status, seconds)
