"""Every route the gateway serves, in one place."""

from __future__ import annotations

from aiohttp import web

from gateway.views import admin, batches, files, health, jobs, lora, metrics, openai, webhooks


def setup_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", health.healthz)
    app.router.add_get("/readyz", health.readyz)
    app.router.add_get("/metrics", metrics.metrics_view)
    # job API v1
    app.router.add_post("/v1/jobs", jobs.submit_job)
    app.router.add_get("/v1/jobs/{job_id}", jobs.get_job)
    app.router.add_post("/v1/jobs/{job_id}/cancel", jobs.cancel_job)
    app.router.add_get("/v1/jobs/{job_id}/events", jobs.job_events)
    app.router.add_get("/v1/webhooks/key", webhooks.webhook_key)
    # OpenAI-compatible
    app.router.add_post("/v1/completions", openai.completions)
    app.router.add_post("/v1/chat/completions", openai.chat_completions)
    app.router.add_get("/v1/models", openai.models)
    app.router.add_post("/v1/files", files.upload_file)
    app.router.add_get("/v1/files", files.list_files)
    app.router.add_get("/v1/files/{file_id}", files.get_file)
    app.router.add_delete("/v1/files/{file_id}", files.delete_file)
    app.router.add_get("/v1/files/{file_id}/content", files.file_content)
    app.router.add_post("/v1/batches", batches.create_batch)
    app.router.add_get("/v1/batches", batches.list_batches)
    app.router.add_get("/v1/batches/{batch_id}", batches.get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", batches.cancel_batch)
    # vLLM-compatible adapter loading (the caller's tenant)
    app.router.add_post("/v1/load_lora_adapter", lora.load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", lora.unload_lora_adapter)
    # admin (admin key)
    app.router.add_post("/v1/admin/tenants", admin.create_tenant_view)
    app.router.add_get("/v1/admin/tenants", admin.list_tenants_view)
    app.router.add_patch("/v1/admin/tenants/{tenant}", admin.update_tenant_view)
    app.router.add_post("/v1/admin/tenants/{tenant}/rotate-key", admin.rotate_key_view)
    app.router.add_post("/v1/admin/adapters", admin.register_adapter_view)
    app.router.add_get("/v1/admin/adapters", admin.list_adapters_view)
    app.router.add_delete("/v1/admin/adapters/{name}", admin.unregister_adapter_view)
    app.router.add_put("/v1/admin/aliases/{name}", admin.set_alias_view)
    app.router.add_get("/v1/admin/aliases", admin.list_aliases_view)
    app.router.add_delete("/v1/admin/aliases/{name}", admin.delete_alias_view)
