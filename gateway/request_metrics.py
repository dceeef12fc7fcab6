"""Requests by method, route and status, and their latency: the gateway's per-request metrics, kept as
plain numbers and turned into Prometheus families only when scraped.

prometheus_client's Counter and Histogram children take a lock and go through several Python calls on
every update (three updates a request; their share of a submit: docs/benchmarks.md); a request here costs two
dict lookups, a bisect and three additions. Event-loop use only (not thread-safe): the middleware
records, and `/metrics` collects, on the loop.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

REQUESTS = "lorafleet_gateway_requests"
LATENCY = "lorafleet_gateway_request_seconds"


class RequestMetrics(Collector):
    """`lorafleet_gateway_requests_total{method,route,status}` and the histogram
    `lorafleet_gateway_request_seconds{method,route}` with the given bucket bounds (seconds, ascending)."""

    def __init__(self, buckets_s: Sequence[float]) -> None:
        self._bounds = tuple(buckets_s)
        self._bucket_names = [floatToGoString(bound) for bound in self._bounds] + ["+Inf"]
        self._counts: dict[tuple[str, str, int], int] = {}
        # per (method, route): requests in each bucket (not cumulative; the last is +Inf's own), then the sum
        self._latencies: dict[tuple[str, str], list[float]] = {}

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one request and record how long it took."""
        key = (method, route, status)
        self._counts[key] = self._counts.get(key, 0) + 1
        latency = self._latencies.get((method, route))
        if latency is None:
            latency = self._latencies[method, route] = [0] * (len(self._bounds) + 2)
        latency[bisect_left(self._bounds, seconds)] += 1  # the first bucket whose bound is >= seconds
        latency[-1] += seconds

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(REQUESTS, "HTTP requests served", labels=["method", "route", "status"])
        for (method, route, status), count in self._counts.items():
            requests.add_metric([method, route, str(status)], count)
        latency = HistogramMetricFamily(
            LATENCY,
            "time from request to the end of the response (a stream's whole length)",
            labels=["method", "route"],
        )
        for (method, route), counts in self._latencies.items():
            cumulative, buckets = 0.0, []
            for name, count in zip(self._bucket_names, counts[:-1], strict=True):
                cumulative += count
                buckets.append((name, cumulative))
            latency.add_metric([method, route], buckets, sum_value=counts[-1])
        yield requests
        yield latency
