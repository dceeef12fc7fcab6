"""OpenAI-compatible endpoints: `/v1/completions`, `/v1/chat/completions` (both with `stream`) and
`/v1/models`. Each completion is one job through the same queue as `/v1/jobs`; its id is the job's,
so `GET /v1/jobs/{id}` shows it too. Errors use the gateway's `{"error": {code, message, param}}`
shape, which OpenAI clients read."""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from gateway.auth import request_tenant
from gateway.errors import error_body
from gateway.job_service import EndEvent, Idle, TokenEvent
from gateway.json_body import parse_json_object
from gateway.json_response import json_response
from gateway.openai_completion import completion_body, job_failure, openai_job_request, usage
from gateway.openai_request import OpenAIRequest, parse_chat_request, parse_completion_request
from gateway.sse import open_event_stream, send_event, send_keepalive
from gateway.state import CONFIG, JOBS, QUEUED_JOB, REDIS, REQUEST_ID
from shared.adapter_aliases import list_aliases
from shared.adapter_registry import list_adapters
from shared.errors import ErrorCode
from shared.model_registry import adapter_limits, list_models
from shared.schema import JobRecord, JobStatus
from shared.tenants import Tenant

_OWNER = "lorafleet"


async def completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/completions`: a text (or token-id) prompt, OpenAI's text_completion objects."""
    tenant = await request_tenant(request)
    parsed = parse_completion_request(parse_json_object(await request.read()), request.app[CONFIG].limits)
    return await _serve(request, tenant, parsed, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/chat/completions`: messages rendered with the model's chat template."""
    tenant = await request_tenant(request)
    parsed = parse_chat_request(parse_json_object(await request.read()), request.app[CONFIG].limits)
    return await _serve(request, tenant, parsed, chat=True)


async def models(request: web.Request) -> web.Response:
    """`GET /v1/models`: the base models (with how they are quantized), then the adapters and adapter
    aliases this tenant may use (with their base as parent; an alias's weights are the operator's, not
    shown). A base model's `max_lora_rank` is the highest adapter rank every live worker serving it
    takes: 0 when one runs without LoRA (--max-loras 0), null when no worker serves it now."""
    tenant = await request_tenant(request)
    redis = request.app[REDIS]
    since_ms = time.time() * 1000 - request.app[CONFIG].model_unserved_after_s * 1000
    data: list[dict[str, Any]] = []
    for info in await list_models(redis):
        limits = await adapter_limits(redis, info.name, since_ms=since_ms)
        data.append(
            {
                "id": info.name,
                "object": "model",
                "created": 0,
                "owned_by": _OWNER,
                "max_model_len": info.max_context,
                "max_lora_rank": None if limits is None else limits.max_rank,
                # how its workers serve it: weights "none" (the checkpoint's dtype), "fp8", or 4-bit "int4"
                # (quantized at load), "awq", "gptq", "nf4" (bitsandbytes', or quantized at load) or "fp4";
                # KV "auto" or "fp8"; the projections a mixed-precision checkpoint leaves in its dtype
                "quantization": info.quantization,
                "unquantized_projections": info.unquantized_summary(),
                "kv_cache_dtype": info.kv_cache_dtype,
            }
        )
    data += [
        {
            "id": adapter.name,
            "object": "model",
            "created": adapter.created_ms // 1000,
            "owned_by": adapter.tenant,
            "root": adapter.name,
            "parent": adapter.base_model,
        }
        for adapter in await list_adapters(redis, visible_to=tenant.tenant_id)
    ]
    data += [
        {
            "id": alias.name,
            "object": "model",
            "created": alias.updated_ms // 1000,
            "owned_by": alias.tenant,
            "root": alias.name,
            "parent": alias.base_model,
        }
        for alias in await list_aliases(redis)
        if alias.visible_to(tenant.tenant_id)
    ]
    return json_response({"object": "list", "data": data})


async def _serve(request: web.Request, tenant: Tenant, parsed: OpenAIRequest, *, chat: bool) -> web.StreamResponse:
    jobs = request.app[JOBS]
    job_request = await openai_job_request(jobs, tenant, parsed, chat=chat)
    record, _ = await jobs.submit(tenant, job_request, request_id=request[REQUEST_ID], idempotency_key=None)
    request[QUEUED_JOB] = record
    created = record.created_ms // 1000
    if parsed.stream:
        return await _stream(request, parsed, record, created, chat=chat)
    limits = request.app[CONFIG].limits
    done = await jobs.wait_until_done(tenant, record.job_id, limits.max_completion_s, limits.max_wait_s)
    failure = job_failure(done)
    if failure is not None:
        code, message = failure
        return json_response(error_body(code, message), status=500 if done.status is JobStatus.FAILED else 409)
    return json_response(completion_body(done, parsed.model, chat=chat))


async def _stream(
    request: web.Request, parsed: OpenAIRequest, job: JobRecord, created: int, *, chat: bool
) -> web.StreamResponse:
    """Stream the job as OpenAI chunks. Token events give text deltas in order; at the end, whatever the
    events did not carry (held-back text, a gap in a trimmed stream) comes from the final record, so
    the chunks always add up to the job's output text."""
    job_id = job.job_id
    response = await open_event_stream(request)
    envelope = {
        "id": job_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": parsed.model,
    }

    async def chunk(text: str | None, finish_reason: str | None = None, role: bool = False) -> None:
        if chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        body = {**envelope, "choices": [choice]}
        if parsed.include_usage:
            body["usage"] = None
        await send_event(response, json.dumps(body))

    if chat:
        await chunk("", role=True)
    streamed = 0  # characters of the output sent so far
    final: EndEvent | None = None
    try:
        async for event in request.app[JOBS].events(job):
            if isinstance(event, Idle):
                await send_keepalive(response)
            elif isinstance(event, TokenEvent):
                if event.text and event.offset == streamed:
                    await chunk(event.text)
                    streamed += len(event.text)
            else:
                final = event
    except BaseException:
        await request.app[JOBS].cancel_abandoned(job_id)  # the client left (or we failed): stop the job
        raise
    record = final.record if final is not None else None
    failure = (ErrorCode.JOB_NOT_FOUND.value, "the job expired") if record is None else job_failure(record)
    if failure is not None:
        await send_event(response, json.dumps(error_body(*failure)))
    else:
        rest = record.output.text[streamed:]
        if rest:
            await chunk(rest)
        await chunk(None, record.output.finish_reason.value)
        if parsed.include_usage:
            await send_event(response, json.dumps({**envelope, "choices": [], "usage": usage(record)}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
