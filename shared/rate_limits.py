"""Per-tenant admission, atomic in Redis: requests/min and tokens/min token buckets, a cap on the
tenant's concurrent (queued + running) jobs, and a cap on the model's queue. One Lua script checks
everything and, only when all pass, debits the buckets and records the job as active.

Buckets hold at most one minute's worth and refill continuously by Redis's clock (one clock for all
gateways). The active set needs no release step: finished jobs are swept from it, by their status,
when the tenant reaches its cap, so a job whose worker died never holds a slot beyond its record.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from shared import keys
from shared.config import TenantLimits
from shared.errors import ErrorCode, LorafleetError

# fields on lf:tenant:{id} that override the gateway's defaults for one tenant
LIMIT_FIELDS = {
    "requests_per_min": "limit_rpm",
    "tokens_per_min": "limit_tpm",
    "max_concurrent_jobs": "limit_concurrent",
}

_ADMIT = """
-- KEYS: rate hash, active set, tenant hash, model queue
-- ARGV: job id, cost (tokens), default rpm, default tpm, default max jobs, max queue, job key prefix
local own = redis.call('HMGET', KEYS[3], 'limit_rpm', 'limit_tpm', 'limit_concurrent')
local rpm = tonumber(own[1]) or tonumber(ARGV[3])
local tpm = tonumber(own[2]) or tonumber(ARGV[4])
local max_jobs = tonumber(own[3]) or tonumber(ARGV[5])
local cost = tonumber(ARGV[2])
if cost > tpm then return {'tokens_per_request', 0, tpm} end
if redis.call('XLEN', KEYS[4]) >= tonumber(ARGV[6]) then return {'queue', 1000, tonumber(ARGV[6])} end
if redis.call('ZCARD', KEYS[2]) >= max_jobs then
  for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    local status = redis.call('HGET', ARGV[7] .. id, 'status')
    if status ~= 'queued' and status ~= 'running' then redis.call('ZREM', KEYS[2], id) end
  end
  if redis.call('ZCARD', KEYS[2]) >= max_jobs then return {'concurrent_jobs', 1000, max_jobs} end
end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local state = redis.call('HMGET', KEYS[1], 'req', 'tok', 'ts')
local elapsed = math.max(0, now - (tonumber(state[3]) or now))
local req = math.min(rpm, (tonumber(state[1]) or rpm) + elapsed * rpm / 60000)
local tok = math.min(tpm, (tonumber(state[2]) or tpm) + elapsed * tpm / 60000)
if req < 1 then return {'requests_per_min', math.ceil((1 - req) * 60000 / rpm), rpm} end
if tok < cost then return {'tokens_per_min', math.ceil((cost - tok) * 60000 / tpm), tpm} end
redis.call('HSET', KEYS[1], 'req', tostring(req - 1), 'tok', tostring(tok - cost), 'ts', now)
redis.call('PEXPIRE', KEYS[1], 120000)
redis.call('ZADD', KEYS[2], now, ARGV[1])
return {'ok', 0, 0}
"""


@dataclass(frozen=True, slots=True)
class Denial:
    """Why a job was not admitted: `limit` names it ("requests_per_min", "tokens_per_min",
    "concurrent_jobs", "queue", or "tokens_per_request" for a job larger than a minute's tokens)."""

    limit: str
    value: int  # the limit's value
    retry_after_s: int  # 0 for tokens_per_request: waiting does not help


class Admission:
    def __init__(self, redis: Redis, defaults: TenantLimits) -> None:
        self._redis = redis
        self._defaults = defaults
        self._admit = redis.register_script(_ADMIT)

    async def admit(self, tenant_id: str, job_id: str, model: str, cost_tokens: int) -> Denial | None:
        """Admit job `job_id` of `cost_tokens` (prompt + max_tokens) for the tenant, or say why not."""
        defaults = self._defaults
        verdict, retry_ms, value = await self._admit(
            keys=[keys.rate(tenant_id), keys.active_jobs(tenant_id), keys.tenant(tenant_id), keys.queue(model)],
            args=[
                job_id,
                cost_tokens,
                defaults.requests_per_min,
                defaults.tokens_per_min,
                defaults.max_concurrent_jobs,
                defaults.max_queue_per_model,
                keys.job(""),
            ],
        )
        if verdict == b"ok":
            return None
        return Denial(verdict.decode(), int(value), max(1, -(-int(retry_ms) // 1000)) if retry_ms else 0)


async def set_tenant_limits(redis: Redis, tenant_id: str, limits: dict[str, int | None]) -> None:
    """Override (an int >= 1) or reset to the default (None) some of a tenant's limits, named as in LIMIT_FIELDS."""
    unknown = set(limits) - set(LIMIT_FIELDS)
    if unknown:
        raise LorafleetError(ErrorCode.INVALID_REQUEST, f"unknown limit(s): {', '.join(sorted(unknown))}")
    async with redis.pipeline(transaction=True) as pipe:
        for name, value in limits.items():
            if value is None:
                pipe.hdel(keys.tenant(tenant_id), LIMIT_FIELDS[name])
            else:
                pipe.hset(keys.tenant(tenant_id), LIMIT_FIELDS[name], value)
        await pipe.execute()


async def get_tenant_limits(redis: Redis, tenant_id: str) -> dict[str, int | None]:
    """The tenant's own limits (None: the gateway's default applies)."""
    raw = await redis.hmget(keys.tenant(tenant_id), list(LIMIT_FIELDS.values()))
    return {name: None if value is None else int(value) for name, value in zip(LIMIT_FIELDS, raw, strict=True)}
