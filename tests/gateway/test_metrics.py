"""`GET /metrics`: Prometheus text with requests by route and status, latency, and queue depth per model."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.fleet import submit


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_count_routes_statuses_and_queue_depth(client, fleet):
    job = await submit(client, fleet)
    await submit(client, fleet)
    await client.get(f"/v1/jobs/{job['id']}", headers=fleet.auth("acme"))
    await client.get("/v1/jobs/job_00000000000000000000000000000000", headers=fleet.auth("acme"))
    response = await client.get("/metrics")
    assert response.status == 200 and response.content_type == "text/plain"
    samples = _samples(await response.text())
    route = "/v1/jobs/{job_id}"
    assert (
        samples[
            (
                "lorafleet_gateway_requests_total",
                frozenset({("method", "POST"), ("route", "/v1/jobs"), ("status", "202")}),
            )
        ]
        == 2
    )
    assert (
        samples[
            ("lorafleet_gateway_requests_total", frozenset({("method", "GET"), ("route", route), ("status", "200")}))
        ]
        == 1
    )
    assert (
        samples[
            ("lorafleet_gateway_requests_total", frozenset({("method", "GET"), ("route", route), ("status", "404")}))
        ]
        == 1
    )
    assert (
        samples[("lorafleet_gateway_request_seconds_count", frozenset({("method", "POST"), ("route", "/v1/jobs")}))]
        == 2
    )
    assert samples[("lorafleet_queue_depth", frozenset({("model", "tiny"), ("priority", "interactive")}))] == 2
    assert samples[("lorafleet_queue_depth", frozenset({("model", "tiny"), ("priority", "batch")}))] == 0
    assert samples[("lorafleet_queue_depth", frozenset({("model", "other"), ("priority", "interactive")}))] == 0
    assert samples[("lorafleet_queue_oldest_seconds", frozenset({("model", "tiny"), ("priority", "interactive")}))] >= 0
    assert samples[("lorafleet_queue_oldest_seconds", frozenset({("model", "other"), ("priority", "batch")}))] == 0
