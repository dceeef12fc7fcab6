"""The base models the fleet serves, as workers advertise them: `lf:models` + `lf:model:{name}`.

The tokenizer (and the chat template, when the model has one) travels with the record, so a gateway
on another host can count prompt tokens, check context limits and render chats without the model's
files. `served_ms` is when a live worker last said it serves the model (on publishing, then every
heartbeat, resident or not): a model nobody has served for a while is unavailable, not unknown.
"""

from __future__ import annotations

import time

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from shared import keys
from shared.chat_template import ChatTemplate
from shared.model_info import ModelInfo

SERVED_MS = "served_ms"


async def publish_model(
    redis: Redis, info: ModelInfo, tokenizer_json: bytes, chat_template: ChatTemplate | None = None
) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.model(info.name), mapping={"info": info.to_json(), "tokenizer": tokenizer_json})
        if chat_template is None:
            pipe.hdel(keys.model(info.name), "chat_template")
        else:
            pipe.hset(keys.model(info.name), "chat_template", chat_template.to_json())
        pipe.sadd(keys.MODELS, info.name)
        mark_served(pipe, info.name, int(time.time() * 1000))
        await pipe.execute()


def mark_served(pipe: Pipeline, name: str, now_ms: int) -> None:
    """Queue, in a worker's heartbeat pipeline, that a live worker serves `name` at `now_ms`."""
    pipe.hset(keys.model(name), SERVED_MS, now_ms)


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
