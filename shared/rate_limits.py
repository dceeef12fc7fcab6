"""Per-tenant admission, atomic in Redis: requests/min and tokens/min token buckets, a cap on the
tenant's concurrent (queued + running) jobs, and a cap on the model's queue. One Lua function checks
everything and, only when all pass, debits the buckets and records the job as active; the job
store's create script runs it first, so admitting and queueing a job is one script.

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
from shared.schema import Priority

# fields on lf:tenant:{id} that override the gateway's defaults for one tenant
LIMIT_FIELDS = {
    "requests_per_min": "limit_rpm",
    "tokens_per_min": "limit_tpm",
    "max_concurrent_jobs": "limit_concurrent",
}

# A Lua function, not a script: the job store's create script calls it (shared/job_scripts.py), so a
# submit is admitted and queued in one script and one round trip, and a refused job is never queued.
# It re-checks the API key (still this tenant's) and that the tenant is enabled, so a gateway may cache
# authentication without letting a rotated key or a disabled tenant submit.
ADMIT_LUA = """
-- k: rate hash, active set, tenant hash, model queue, api-key lookup, the model's worker queues (a set)
-- a: job id, cost (tokens), default rpm, default tpm, default max jobs, max queue, job key prefix, tenant id,
--    '1' when the class's jobs may be routed (interactive: the worker streams hold its jobs too)
-- the class's queued and running jobs of the model: its shared stream, and every worker stream if routed
local function model_queue_length(shared, worker_queues, routed)
  local length = redis.call('XLEN', shared)
  if routed ~= '1' then return length end
  for _, stream in ipairs(redis.call('SMEMBERS', worker_queues)) do length = length + redis.call('XLEN', stream) end
  return length
end
local function admit(k, a)
  if redis.call('GET', k[5]) ~= a[8] then return {'invalid_api_key', 0, 0} end
  local own = redis.call('HMGET', k[3], 'limit_rpm', 'limit_tpm', 'limit_concurrent', 'disabled')
  if own[4] == '1' then return {'tenant_disabled', 0, 0} end
  local rpm = tonumber(own[1]) or tonumber(a[3])
  local tpm = tonumber(own[2]) or tonumber(a[4])
  local max_jobs = tonumber(own[3]) or tonumber(a[5])
  local cost = tonumber(a[2])
  if cost > tpm then return {'tokens_per_request', 0, tpm} end
  if model_queue_length(k[4], k[6], a[9]) >= tonumber(a[6]) then return {'queue', 1000, tonumber(a[6])} end
  if redis.call('ZCARD', k[2]) >= max_jobs then
    for _, id in ipairs(redis.call('ZRANGE', k[2], 0, -1)) do
      local status = redis.call('HGET', a[7] .. id, 'status')
      if status ~= 'queued' and status ~= 'running' then redis.call('ZREM', k[2], id) end
    end
    if redis.call('ZCARD', k[2]) >= max_jobs then return {'concurrent_jobs', 1000, max_jobs} end
  end
  local time = redis.call('TIME')
  local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  local state = redis.call('HMGET', k[1], 'req', 'tok', 'ts')
  local elapsed = math.max(0, now - (tonumber(state[3]) or now))
  local req = math.min(rpm, (tonumber(state[1]) or rpm) + elapsed * rpm / 60000)
  local tok = math.min(tpm, (tonumber(state[2]) or tpm) + elapsed * tpm / 60000)
  if req < 1 then return {'requests_per_min', math.ceil((1 - req) * 60000 / rpm), rpm} end
  if tok < cost then return {'tokens_per_min', math.ceil((cost - tok) * 60000 / tpm), tpm} end
  redis.call('HSET', k[1], 'req', tostring(req - 1), 'tok', tostring(tok - cost), 'ts', now)
  redis.call('PEXPIRE', k[1], 120000)
  redis.call('ZADD', k[2], now, a[1])
  return {'ok', 0, 0}
end
"""


@dataclass(frozen=True, slots=True)
class Denial:
    """Why a job was not admitted: `limit` names it ("requests_per_min", "tokens_per_min",
    "concurrent_jobs", "queue", "tokens_per_request" for a job larger than a minute's tokens), or
    the credentials it came with no longer hold ("invalid_api_key", "tenant_disabled")."""

    limit: str
    value: int  # the limit's value
    retry_after_s: int  # 0 when waiting does not help


@dataclass(frozen=True, slots=True)
class AdmissionCheck:
    """The keys and arguments of one `admit` call, for a script that embeds ADMIT_LUA."""

    keys: tuple[str, ...]
    args: tuple[str | int, ...]


class AdmissionDenied(Exception):
    def __init__(self, denial: Denial) -> None:
        super().__init__(denial.limit)
        self.denial = denial


class Admission:
    """The gateway's default limits, and the admission check of each job."""

    def __init__(self, defaults: TenantLimits) -> None:
        self._defaults = defaults

    def check(
        self, tenant_id: str, key_lookup: str, job_id: str, model: str, priority: Priority, cost_tokens: int
    ) -> AdmissionCheck:
        """Admit job `job_id` of `cost_tokens` (prompt + max_tokens), a job of `model` in class `priority`, for
        the tenant whose API key has lookup id `key_lookup`. The queue cap counts the class's streams of the
        model: interactive jobs may wait on a worker's routed stream, batch jobs only on the shared one."""
        defaults = self._defaults
        return AdmissionCheck(
            keys=(
                keys.rate(tenant_id),
                keys.active_jobs(tenant_id),
                keys.tenant(tenant_id),
                keys.queue(model, priority),
                keys.api_key(key_lookup),
                keys.worker_queues(model),
            ),
            args=(
                job_id,
                cost_tokens,
                defaults.requests_per_min,
                defaults.tokens_per_min,
                defaults.max_concurrent_jobs,
                defaults.max_queue_per_model,
                keys.job(""),
                tenant_id,
                "1" if priority is Priority.INTERACTIVE else "0",
            ),
        )


def denial(verdict: bytes, retry_ms: int, value: int) -> Denial | None:
    """The admit function's answer as a Denial; None when the job was admitted."""
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
