"""The base models the fleet serves, as workers advertise them: `lf:models` + `lf:model:{name}`.

The tokenizer travels with the record, so a gateway on another host can count prompt tokens and
check context limits without the model's files.
"""

from __future__ import annotations

from redis.asyncio import Redis

from shared import keys
from shared.model_info import ModelInfo


async def publish_model(redis: Redis, info: ModelInfo, tokenizer_json: bytes) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.model(info.name), mapping={"info": info.to_json(), "tokenizer": tokenizer_json})
        pipe.sadd(keys.MODELS, info.name)
        await pipe.execute()


async def get_model(redis: Redis, name: str) -> ModelInfo | None:
    raw = await redis.hget(keys.model(name), "info")
    return None if raw is None else ModelInfo.from_json(raw)


async def get_tokenizer_json(redis: Redis, name: str) -> bytes | None:
    return await redis.hget(keys.model(name), "tokenizer")


async def list_models(redis: Redis) -> list[ModelInfo]:
    names = sorted(name.decode() for name in await redis.smembers(keys.MODELS))
    infos = [await get_model(redis, name) for name in names]
    return [info for info in infos if info is not None]
