"""What the job API does, free of HTTP: submit (resolve model and adapter, tokenize, check the
context, queue), read, long-poll and cancel a tenant's jobs. Failures are RequestErrors carrying
error codes; the HTTP layer maps them onto statuses.

Tenancy rule: a job or adapter that belongs to another tenant is reported exactly like one that
does not exist, so a tenant learns nothing about others' ids or adapter names.
"""

from __future__ import annotations

import re
import time
import uuid

import structlog
from redis.asyncio import Redis

from gateway.errors import RequestError
from gateway.job_request import JobRequest
from gateway.tokenization import TokenizerCache
from shared.adapter_registry import get_adapter
from shared.errors import ErrorCode
from shared.jobstore import JobStore
from shared.model_info import ModelInfo
from shared.model_registry import get_model
from shared.schema import AdapterRef, JobMessage, JobRecord, JobStatus
from shared.tenants import Tenant

_JOB_ID = re.compile(r"^job_[0-9a-f]{32}$")

log = structlog.get_logger(__name__)


def new_job_id() -> str:
    """An unguessable job id: `job_` + 122 random bits as hex."""
    return f"job_{uuid.uuid4().hex}"


def _job_not_found() -> RequestError:
    return RequestError(ErrorCode.JOB_NOT_FOUND, "job not found")


class JobService:
    """The gateway's job operations for one authenticated tenant at a time."""

    def __init__(self, redis: Redis, store: JobStore, tokenizers: TokenizerCache) -> None:
        self._redis = redis
        self._store = store
        self._tokenizers = tokenizers

    async def submit(
        self, tenant: Tenant, request: JobRequest, *, request_id: str, idempotency_key: str | None
    ) -> tuple[JobRecord, bool]:
        """Queue a job. Returns (its record, newly created); a repeated idempotency key returns the
        first job's current record and queues nothing."""
        model = await get_model(self._redis, request.model)
        if model is None:
            raise RequestError(ErrorCode.MODEL_NOT_FOUND, f"model {request.model!r} not found", param="model")
        adapter = None if request.adapter is None else await self._adapter(tenant, request.adapter, model)
        prompt_token_ids = await self._prompt_token_ids(model, request)
        created_at = time.time()
        record = JobRecord(
            job_id=new_job_id(),
            status=JobStatus.QUEUED,
            tenant=tenant.tenant_id,
            model=model.name,
            adapter=request.adapter,
            created_ms=int(created_at * 1000),
            prompt_tokens=len(prompt_token_ids),
        )
        message = JobMessage(
            job_id=record.job_id,
            tenant=tenant.tenant_id,
            model=model.name,
            prompt_token_ids=prompt_token_ids,
            sampling=request.sampling,
            adapter=adapter,
            created_at=created_at,
            request_id=request_id,
        )
        job_id, created = await self._store.create(record, message, idempotency_key)
        if created:
            log.info(
                "job_queued",
                job_id=job_id,
                tenant=tenant.tenant_id,
                model=model.name,
                adapter=request.adapter,
                prompt_tokens=record.prompt_tokens,
            )
            return record, True
        return await self.get(tenant, job_id), False

    async def get(self, tenant: Tenant, job_id: str) -> JobRecord:
        """The tenant's job, or JOB_NOT_FOUND (also for another tenant's job)."""
        record = await self._store.get(job_id) if _JOB_ID.match(job_id) else None
        if record is None or record.tenant != tenant.tenant_id:
            raise _job_not_found()
        return record

    async def wait(self, tenant: Tenant, job_id: str, timeout_s: float) -> JobRecord:
        """The tenant's job once it is terminal or `timeout_s` seconds have passed, whichever is first.
        Ownership is checked before blocking, so a wait on another tenant's job fails at once."""
        record = await self.get(tenant, job_id)
        if record.status.is_terminal or timeout_s <= 0:
            return record
        waited = await self._store.wait(job_id, timeout_s)
        if waited is None:  # expired while we waited
            raise _job_not_found()
        return waited

    async def cancel(self, tenant: Tenant, job_id: str) -> JobRecord:
        """Cancel the tenant's queued or running job; a terminal job is left as it is. Returns the
        job's record after the call either way."""
        await self.get(tenant, job_id)
        await self._store.cancel(job_id)
        return await self.get(tenant, job_id)

    async def _adapter(self, tenant: Tenant, name: str, model: ModelInfo) -> AdapterRef:
        """The current version of an adapter the tenant may use with `model`."""
        adapter = await get_adapter(self._redis, name)
        if adapter is None or not adapter.visible_to(tenant.tenant_id):
            raise RequestError(ErrorCode.ADAPTER_NOT_FOUND, f"adapter {name!r} not found", param="adapter")
        if adapter.base_model != model.name:
            raise RequestError(
                ErrorCode.ADAPTER_MODEL_MISMATCH,
                f"adapter {name!r} was trained for model {adapter.base_model!r}, not {model.name!r}",
                param="adapter",
            )
        return adapter.ref()

    async def _prompt_token_ids(self, model: ModelInfo, request: JobRequest) -> tuple[int, ...]:
        """The prompt as token ids, checked against the vocabulary and the model's context length."""
        if isinstance(request.prompt, str):
            token_ids = tuple(await self._tokenizers.encode(model.name, request.prompt))
            if not token_ids:
                raise RequestError(ErrorCode.EMPTY_PROMPT, "prompt encodes to no tokens", param="prompt")
        else:
            token_ids = request.prompt
            bad = next((t for t in token_ids if not 0 <= t < model.vocab_size), None)
            if bad is not None:
                raise RequestError(
                    ErrorCode.INVALID_TOKEN_ID,
                    f"token id {bad} is outside the vocabulary of {model.name!r} [0, {model.vocab_size})",
                    param="prompt",
                )
        total = len(token_ids) + request.sampling.max_tokens
        if total > model.max_context:
            raise RequestError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"prompt ({len(token_ids)} tokens) + max_tokens ({request.sampling.max_tokens}) = {total} tokens, "
                f"over the context length of {model.name!r} ({model.max_context} tokens)",
                param="prompt",
            )
        return token_ids
