"""`--preload-adapters`: the named adapters read into their model's host cache at start, before the
worker serves, so the first requests after a restart copy them from host memory instead of waiting
on the disk. Each is looked up in the registry (its current version), and read by its resident
model's adapter pool (worker/adapter_pool/pool.py `preload`), with a log line per adapter."""

from __future__ import annotations

import asyncio

import structlog
from redis.asyncio import Redis

from shared.adapter_registry import get_adapter
from shared.schema import AdapterRef
from worker.engine.engine import LLMEngine
from worker.redis_retry import retrying

log = structlog.get_logger(__name__)


async def preload_adapters(redis: Redis, names: tuple[str, ...], engines: dict[str, LLMEngine]) -> dict[str, int]:
    """Read the adapters `names` into the host tier of their base model's engine (call before the engine
    thread starts). A name not registered, or for a model not resident here, is logged and skipped.
    Returns, per model, how many of its adapters are on the host."""
    refs: dict[str, list[AdapterRef]] = {}
    for name in names:
        record = await retrying("preload adapters", lambda name=name: get_adapter(redis, name))
        if record is None or record.base_model not in engines:
            reason = "not registered" if record is None else f"its base model {record.base_model!r} is not resident"
            log.warning("adapter_preload_skipped", adapter=name, reason=reason)
            continue
        refs.setdefault(record.base_model, []).append(record.ref())
    preloaded = {}
    for model, model_refs in refs.items():
        log.info("adapter_preload", model=model, adapters=len(model_refs))
        preloaded[model] = await asyncio.to_thread(engines[model].adapter_pool.preload, model_refs)
    return preloaded
