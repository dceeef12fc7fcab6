"""Every route the gateway serves, in one place."""

from __future__ import annotations

from aiohttp import web

from gateway.views import health, jobs


def setup_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", health.healthz)
    app.router.add_get("/readyz", health.readyz)
    app.router.add_post("/v1/jobs", jobs.submit_job)
    app.router.add_get("/v1/jobs/{job_id}", jobs.get_job, name=jobs.JOB_ROUTE)
    app.router.add_post("/v1/jobs/{job_id}/cancel", jobs.cancel_job, name=jobs.CANCEL_ROUTE)
