"""What the job API does, free of HTTP: submit (resolve model and adapter, tokenize, check the
context, queue), read, long-poll and cancel a tenant's jobs. Failures are RequestErrors carrying
error codes; the HTTP layer maps them onto statuses.

Tenancy rule: a job or adapter that belongs to another tenant is reported exactly like one that
does not exist, so a tenant learns nothing about others' ids or adapter names.

Admission (shared/rate_limits.py) runs last, once the job's token cost is known, so a request that
is refused for its content never spends the tenant's budget; it runs inside the job store's create
script, so a submit costs one Redis round trip once the tenant and the model are cached (model
records for MODEL_CACHE_TTL_S: a republished model's new limits apply within that).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prometheus_client import Counter
from redis.asyncio import Redis

from gateway.chat import render_chat
from gateway.errors import RequestError
from gateway.job_checks import admission_refusal, checked_sampling
from gateway.job_events import JobEventReader
from gateway.job_ids import JOB_ID, new_job_id
from gateway.job_request import JobRequest
from gateway.routing import FleetView
from gateway.tokenization import TokenizerCache
from gateway.ttl_cache import TtlCache
from shared.adapter_aliases import get_alias
from shared.adapter_registry import get_adapter, track_adapter_job
from shared.errors import ErrorCode
from shared.job_events import end_record
from shared.jobstore import JobStore
from shared.model_info import ModelInfo
from shared.model_registry import AdapterLimits, adapter_limits, get_chat_template, get_model, served_ms
from shared.rate_limits import Admission, AdmissionDenied
from shared.schema import AdapterRef, JobMessage, JobRecord, JobStatus, Priority
from shared.tenants import Tenant

MODEL_CACHE_TTL_S = 5.0


def _job_not_found() -> RequestError:
    return RequestError(ErrorCode.JOB_NOT_FOUND, "job not found")


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Output text from character `offset` on (possibly empty) and the token(s) that produced it."""

    event_id: str
    text: str
    token_ids: tuple[int, ...]
    offset: int


@dataclass(frozen=True, slots=True)
class EndEvent:
    """The job reached a terminal status (or its record expired: `record` None)."""

    event_id: str
    record: JobRecord | None


@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing happened for a while: a streamer's cue to send a keep-alive."""


class JobService:
    """The gateway's job operations for one authenticated tenant at a time."""

    def __init__(
        self,
        redis: Redis,
        store: JobStore,
        events: JobEventReader,
        tokenizers: TokenizerCache,
        admission: Admission,
        *,
        events_idle_s: float,
        model_unserved_after_s: float,
        fleet: FleetView | None = None,
        alias_jobs: Counter | None = None,
    ) -> None:
        """`fleet`: where adapter jobs are routed from (gateway/routing.py); None: every job on its model's
        shared stream. `alias_jobs`: the counter of jobs by alias and the adapter drawn."""
        self._redis = redis
        self._store = store
        self._events = events
        self._tokenizers = tokenizers
        self._admission = admission
        self._fleet = fleet
        self._alias_jobs = alias_jobs
        self._rng = random.Random()
        self._events_idle_s = events_idle_s  # an event stream yields Idle after this long without events
        self._unserved_after_ms = model_unserved_after_s * 1000
        # when a worker last advertised each model (unix ms): stamps are refreshed every heartbeat, so a
        # few seconds' cache keeps the check off the submit's Redis round trip
        self._served: TtlCache[str, int] = TtlCache(MODEL_CACHE_TTL_S, max_entries=1024)
        self._models: TtlCache[str, ModelInfo] = TtlCache(MODEL_CACHE_TTL_S, max_entries=1024)
        # what each model's live workers can serve of adapters (one tuple: "none published" is cached too)
        self._limits: TtlCache[str, tuple[AdapterLimits | None]] = TtlCache(MODEL_CACHE_TTL_S, max_entries=1024)

    async def submit(
        self,
        tenant: Tenant,
        request: JobRequest,
        *,
        request_id: str,
        idempotency_key: str | None,
        admit: bool = True,
    ) -> tuple[JobRecord, bool]:
        """Queue a job. Returns (its record, newly created); a repeated idempotency key returns the
        first job's current record and queues nothing. `admit=False` skips the tenant's rate and
        concurrency limits: a batch's lines, which its driver paces itself (gateway/batch_driver.py)."""
        model = self._models.get(request.model) or await self._model(request.model)
        if model is None:
            raise RequestError(ErrorCode.MODEL_NOT_FOUND, f"model {request.model!r} not found", param="model")
        if not self._served_recently(model.name):
            await self._check_served(model.name)
        adapter, alias = (
            (None, None) if request.adapter is None else await self._adapter(tenant, request.adapter, model)
        )
        if isinstance(request.prompt, str):  # awaited here, not in a helper coroutine: one frame fewer to resume
            encoded = await self._tokenizers.encode(
                model.name, request.prompt, add_special_tokens=request.add_special_tokens
            )
            prompt_token_ids = tuple(encoded)
        else:
            prompt_token_ids = request.prompt
        sampling = checked_sampling(model, request, prompt_token_ids)
        job_id = new_job_id()
        created_at = time.time()
        record = JobRecord(
            job_id=job_id,
            status=JobStatus.QUEUED,
            tenant=tenant.tenant_id,
            model=model.name,
            adapter=None if adapter is None else adapter.name,
            created_ms=int(created_at * 1000),
            prompt_tokens=len(prompt_token_ids),
            webhook=request.webhook,
            priority=request.priority,
            adapter_version=0 if adapter is None else adapter.version,
            alias=alias,
        )
        message = JobMessage(
            job_id=record.job_id,
            tenant=tenant.tenant_id,
            model=model.name,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            adapter=adapter,
            created_at=created_at,
            deadline=None if request.deadline_s is None else created_at + request.deadline_s,
            request_id=request_id,
            stream=request.stream,
            priority=request.priority,
        )
        if adapter is not None and not await track_adapter_job(self._redis, adapter.name, job_id):
            raise RequestError(ErrorCode.ADAPTER_NOT_FOUND, f"adapter {adapter.name!r} not found", param="adapter")
        cost_tokens = len(prompt_token_ids) + sampling.max_tokens
        admission = None
        if admit:
            admission = self._admission.check(
                tenant.tenant_id, tenant.key_lookup, job_id, model.name, request.priority, cost_tokens
            )
        queue = None
        if self._fleet is not None and request.priority is Priority.INTERACTIVE:
            # batch jobs wait on the model's shared batch stream: routing places interactive jobs only
            queue = (await self._fleet.route(model.name, None if adapter is None else adapter.uid)).queue
        try:
            job_id, created = await self._store.create(record, message, idempotency_key, admission, queue)
        except AdmissionDenied as denied:
            raise admission_refusal(denied.denial, model, cost_tokens) from None
        if created:
            if alias is not None and self._alias_jobs is not None:
                self._alias_jobs.labels(alias, record.adapter).inc()
            return record, True
        return await self.get(tenant, job_id), False

    async def get(self, tenant: Tenant, job_id: str) -> JobRecord:
        """The tenant's job, or JOB_NOT_FOUND (also for another tenant's job)."""
        record = await self._store.get(job_id) if JOB_ID.match(job_id) else None
        if record is None or record.tenant != tenant.tenant_id:
            raise _job_not_found()
        return record

    async def wait(self, tenant: Tenant, job_id: str, timeout_s: float) -> JobRecord:
        """The tenant's job once it is terminal or `timeout_s` seconds have passed, whichever is first.
        Ownership is checked before blocking, so a wait on another tenant's job fails at once."""
        record = await self.get(tenant, job_id)
        if record.status.is_terminal or timeout_s <= 0:
            return record
        deadline = time.monotonic() + timeout_s
        # from the stream's start: an end event written since the record was read is still seen
        ended = None
        async with self._events.subscribe(job_id) as events:
            while (remaining := deadline - time.monotonic()) > 0:
                entries = await events.next(remaining)
                ended = next((fields for _, fields in entries if fields.get(b"type") == b"end"), None)
                if not entries or ended is not None:
                    break
        waited = (end_record(ended) if ended is not None else None) or await self._store.get(job_id)
        if waited is None:  # expired while we waited
            raise _job_not_found()
        return waited

    async def cancel(self, tenant: Tenant, job_id: str) -> JobRecord:
        """Cancel the tenant's queued or running job; a terminal job is left as it is. Returns the
        job's record after the call either way."""
        await self.get(tenant, job_id)
        await self._store.cancel(job_id)
        return await self.get(tenant, job_id)

    async def resolve_model(self, tenant: Tenant, name: str) -> tuple[str, str | None]:
        """An OpenAI-style model name as (base model, adapter): `BASE`, `BASE:ADAPTER`, or an adapter's
        name (as vLLM serves adapters). An adapter the tenant may not use is MODEL_NOT_FOUND."""
        if await self._model(name) is not None:
            return name, None
        base, sep, adapter_name = name.partition(":")
        if sep:
            return base, adapter_name
        adapter = await get_adapter(self._redis, name) or await get_alias(self._redis, name)
        if adapter is None or not adapter.visible_to(tenant.tenant_id):
            raise RequestError(ErrorCode.MODEL_NOT_FOUND, f"model {name!r} not found", param="model")
        return adapter.base_model, name

    async def chat_prompt(self, model: str, messages: tuple[dict[str, str], ...]) -> str:
        """`messages` rendered with the model's chat template; NO_CHAT_TEMPLATE when it has none."""
        template = await get_chat_template(self._redis, model)
        if template is None:
            if await self._model(model) is None:
                raise RequestError(ErrorCode.MODEL_NOT_FOUND, f"model {model!r} not found", param="model")
            raise RequestError(
                ErrorCode.NO_CHAT_TEMPLATE,
                f"model {model!r} has no chat template (its tokenizer_config.json has no chat_template): "
                "use /v1/completions with a prompt",
                param="model",
            )
        return render_chat(template, messages)

    async def wait_until_done(self, tenant: Tenant, job_id: str, timeout_s: float, poll_s: float) -> JobRecord:
        """The job once terminal; after `timeout_s` it is canceled and COMPLETION_TIMEOUT raised. If
        the caller goes away (the handler is cancelled), the job is canceled too: nobody will read it."""
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                record = await self.wait(tenant, job_id, max(0.0, min(poll_s, remaining)))
                if record.status.is_terminal:
                    return record
                if remaining <= 0:
                    await self._store.cancel(job_id)
                    raise RequestError(
                        ErrorCode.COMPLETION_TIMEOUT, f"the job did not finish within {timeout_s:g} s and was canceled"
                    )
        except asyncio.CancelledError:
            await self.cancel_abandoned(job_id)
            raise

    async def cancel_abandoned(self, job_id: str) -> None:
        """Cancel a job whose only reader went away (shielded: it runs while its handler is being cancelled)."""
        await asyncio.shield(self._store.cancel(job_id))

    async def events(self, job: JobRecord, *, after: str = "0-0") -> AsyncIterator[TokenEvent | EndEvent | Idle]:
        """The events of a job the caller read for its tenant (`get`, or `submit`'s record: its ownership is
        checked) from stream entry `after` on: token events, then one EndEvent carrying the final record;
        Idle whenever nothing happens for a while."""
        job_id = job.job_id
        async with self._events.subscribe(job_id, after) as events:
            while True:
                entries = await events.next(self._events_idle_s)
                if not entries:
                    if await self._store.get(job_id) is None:  # expired while idle
                        yield EndEvent(after, None)
                        return
                    yield Idle()
                    continue
                for entry_id, fields in entries:
                    after = entry_id.decode()
                    if fields.get(b"type") == b"end":
                        yield EndEvent(after, end_record(fields) or await self._store.get(job_id))
                        return
                    yield TokenEvent(
                        after,
                        fields[b"text"].decode(),
                        tuple(json.loads(fields[b"token_ids"])),
                        int(fields[b"offset"]),
                    )

    async def _model(self, name: str) -> ModelInfo | None:
        """The model's record, from this process's cache when it is fresh (models that are not found are
        looked up again every time)."""
        return await self._models.get_or_load(name, lambda: get_model(self._redis, name))

    def _served_recently(self, model: str) -> bool:
        """Whether this process's cached stamp already shows a worker advertised `model` recently."""
        last = self._served.get(model)
        return last is not None and time.time() * 1000 - last <= self._unserved_after_ms

    async def _check_served(self, model: str) -> None:
        """MODEL_UNAVAILABLE unless a live worker advertised `model` recently: a job for a model no
        worker serves would wait in its queue forever."""
        now = time.time() * 1000
        last = await self._served.get_or_load(model, lambda: served_ms(self._redis, model))
        if last is not None and now - last > self._unserved_after_ms:  # the cached stamp may be behind Redis's
            last = await served_ms(self._redis, model)
            if last is not None:
                self._served.put(model, last)
        if last is None or now - last > self._unserved_after_ms:
            raise RequestError(
                ErrorCode.MODEL_UNAVAILABLE,
                f"no worker serves model {model!r} at present; retry later",
                param="model",
            )

    async def _adapter(self, tenant: Tenant, name: str, model: ModelInfo) -> tuple[AdapterRef, str | None]:
        """The current version of an adapter the tenant may use with `model`, and the alias it was drawn from:
        a name that is no adapter but an alias the tenant may use draws one of the alias's adapters by its
        weights as they are now (None: the name was the adapter's)."""
        adapter = await get_adapter(self._redis, name)
        alias = None
        if adapter is None:  # one namespace: an adapter's name is no alias's
            aliased = await get_alias(self._redis, name)
            if aliased is not None and aliased.visible_to(tenant.tenant_id):
                alias, name = name, aliased.draw(self._rng)
                adapter = await get_adapter(self._redis, name)
        if adapter is None or not adapter.visible_to(tenant.tenant_id):
            raise RequestError(ErrorCode.ADAPTER_NOT_FOUND, f"adapter {name!r} not found", param="adapter")
        if adapter.base_model != model.name:
            raise RequestError(
                ErrorCode.ADAPTER_MODEL_MISMATCH,
                f"adapter {name!r} was trained for model {adapter.base_model!r}, not {model.name!r}",
                param="adapter",
            )
        cached = self._limits.get(model.name)  # no coroutine for the common case, as for models
        (limits,) = cached or await self._limits.get_or_load(model.name, lambda: self._live_limits(model.name))
        refusal = None if limits is None else adapter.refusal(limits)
        if refusal is not None:
            raise RequestError(ErrorCode.ADAPTER_EXCEEDS_MODEL_LIMITS, f"adapter {name!r} {refusal}", param="adapter")
        return adapter.ref(), alias

    async def _live_limits(self, model: str) -> tuple[AdapterLimits | None]:
        return (await adapter_limits(self._redis, model, since_ms=time.time() * 1000 - self._unserved_after_ms),)
