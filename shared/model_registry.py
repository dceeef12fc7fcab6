"""The base models the fleet serves, as workers advertise them: `lf:models` + `lf:model:{name}`.

The tokenizer (and the chat template, when the model has one) travels with the record, so a gateway
on another host can count prompt tokens, check context limits and render chats without the model's
files. `served_ms` is when a live worker last said it serves the model (on publishing, then every
heartbeat, resident or not): a model nobody has served for a while is unavailable, not unknown.

Each worker also puts the adapters it can serve in the record, `adapter_limits:{worker id}` (its
LoRA slots' rank and the projections they cover), refreshed every heartbeat and removed when it
stops. A model's jobs go to whichever of its workers reads them first, so the gateway holds an
adapter to the strictest limits of the workers that served the model lately.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from shared import keys
from shared.chat_template import ChatTemplate
from shared.model_info import ModelInfo

SERVED_MS = "served_ms"
ADAPTER_LIMITS = "adapter_limits:"  # + a worker id: that worker's AdapterLimits, as JSON with its updated_ms


@dataclass(frozen=True, slots=True)
class AdapterLimits:
    """What a worker serving a model can serve of an adapter: a slot rank up to `max_rank` (its
    --max-lora-rank; an adapter's slot rank is its rank, or a fused expert gate_up LoRA's 2r), LoRA
    on `target_modules` (named as adapter manifests name them: q_proj …, experts.gate_proj …).
    A worker without LoRA (--max-loras 0) serves none: max_rank 0."""

    max_rank: int
    target_modules: tuple[str, ...]

    def refusal(self, *, rank: int, target_modules: Sequence[str]) -> str | None:
        """Why an adapter of slot rank `rank` on `target_modules` cannot be served, or None."""
        if self.max_rank == 0:
            return "cannot be served: a worker serving the model runs without LoRA (--max-loras 0)"
        if rank > self.max_rank:
            return f"needs LoRA slots of rank {rank}; the model's workers have rank {self.max_rank} (--max-lora-rank)"
        unserved = [target for target in target_modules if target not in self.target_modules]
        if unserved:
            return f"targets {', '.join(unserved)}, for which the model's workers have no LoRA slots"
        return None

    @classmethod
    def strictest(cls, limits: Iterable[AdapterLimits]) -> AdapterLimits | None:
        """What every one of `limits` allows; None if there are none."""
        limits = list(limits)
        if not limits:
            return None
        shared = set.intersection(*(set(each.target_modules) for each in limits))
        targets = tuple(target for target in limits[0].target_modules if target in shared)
        return cls(min(each.max_rank for each in limits), targets)


async def publish_model(
    redis: Redis,
    info: ModelInfo,
    tokenizer_json: bytes,
    chat_template: ChatTemplate | None = None,
    *,
    worker_id: str = "",
    limits: AdapterLimits | None = None,
) -> None:
    """Publish `info` as served; with `limits`, also what worker `worker_id` can serve of adapters."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.model(info.name), mapping={"info": info.to_json(), "tokenizer": tokenizer_json})
        if chat_template is None:
            pipe.hdel(keys.model(info.name), "chat_template")
        else:
            pipe.hset(keys.model(info.name), "chat_template", chat_template.to_json())
        pipe.sadd(keys.MODELS, info.name)
        mark_served(pipe, info.name, int(time.time() * 1000), worker_id=worker_id, limits=limits)
        await pipe.execute()


def mark_served(
    pipe: Pipeline, name: str, now_ms: int, *, worker_id: str = "", limits: AdapterLimits | None = None
) -> None:
    """Queue, in a worker's heartbeat pipeline, that a live worker serves `name` at `now_ms` (and,
    with `limits`, what worker `worker_id` can serve of adapters)."""
    pipe.hset(keys.model(name), SERVED_MS, now_ms)
    if limits is not None:
        record = {"max_rank": limits.max_rank, "target_modules": list(limits.target_modules), "updated_ms": now_ms}
        pipe.hset(keys.model(name), ADAPTER_LIMITS + worker_id, json.dumps(record))


def forget_worker(pipe: Pipeline, name: str, worker_id: str) -> None:
    """Queue, as a worker stops, the removal of its adapter limits from `name`'s record."""
    pipe.hdel(keys.model(name), ADAPTER_LIMITS + worker_id)


async def adapter_limits(redis: Redis, name: str, *, since_ms: float) -> AdapterLimits | None:
    """The strictest adapter limits among the workers that said they serve `name` since `since_ms`
    (unix ms); None if none did (a model with no live worker gets no jobs anyway)."""
    live = []
    async for _, raw in redis.hscan_iter(keys.model(name), match=ADAPTER_LIMITS + "*"):
        record = json.loads(raw)
        if record["updated_ms"] >= since_ms:
            live.append(AdapterLimits(record["max_rank"], tuple(record["target_modules"])))
    return AdapterLimits.strictest(live)


async def served_ms(redis: Redis, name: str) -> int | None:
    """When a worker last advertised `name` (unix ms); None if none ever did."""
    raw = await redis.hget(keys.model(name), SERVED_MS)
    return None if raw is None else int(raw)


async def get_model(redis: Redis, name: str) -> ModelInfo | None:
    raw = await redis.hget(keys.model(name), "info")
    return None if raw is None else ModelInfo.from_json(raw)


async def get_tokenizer_json(redis: Redis, name: str) -> bytes | None:
    return await redis.hget(keys.model(name), "tokenizer")


async def get_chat_template(redis: Redis, name: str) -> ChatTemplate | None:
    raw = await redis.hget(keys.model(name), "chat_template")
    return None if raw is None else ChatTemplate.from_json(raw)


async def list_models(redis: Redis) -> list[ModelInfo]:
    names = sorted(name.decode() for name in await redis.smembers(keys.MODELS))
    infos = [await get_model(redis, name) for name in names]
    return [info for info in infos if info is not None]
