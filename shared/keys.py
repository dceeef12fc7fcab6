"""Every Redis key lorafleet uses, in one place.

| key                           | type   | what                                                      |
| ----------------------------- | ------ | --------------------------------------------------------- |
| lf:q:{model}                  | stream | queued jobs for one base model, any worker (group `workers`) |
| lf:wq:{model}:{worker}        | stream | jobs routed to one worker of the model (group `workers`)  |
| lf:wqs:{model}                | set    | the model's worker streams (routing; stealing; re-claim)  |
| lf:aliases / lf:alias:{name}  | set / hash | adapter aliases: owner, weighted adapter versions     |
| lf:job:{id}                   | hash   | job record (status, tenant, timings, result); TTL         |
| lf:out:{id}                   | stream | job events (tokens, final) for long-poll / streaming; TTL |
| lf:dlq                        | stream | jobs that failed delivery too many times (capped)         |
| lf:models / lf:model:{name}   | set / hash | base models: ModelInfo, tokenizer.json, served_ms    |
| lf:adapters / lf:adapter:{n}  | set / hash | adapter registry records                              |
| lf:adapter-jobs:{n}           | zset   | job ids queued or running on adapter n (unregister: 409)  |
| lf:workers / lf:worker:{id}   | set / hash | worker heartbeats; the hash has a TTL                 |
| lf:tenants / lf:tenant:{id}   | set / hash | tenants (name, salted key hash, disabled)             |
| lf:apikey:{lookup}            | string | API-key lookup id → tenant id                             |
| lf:idem:{tenant}:{key}        | string | Idempotency-Key → job id; TTL                             |
| lf:rate:{tenant}              | hash   | the tenant's request and token buckets; TTL               |
| lf:active:{tenant}            | zset   | the tenant's admitted job ids (queued or running)         |
| lf:webhooks                   | stream | finished jobs' webhooks to call (group `webhooks`: gateways) |
| lf:gw-wake:{process}          | stream | wakes one gateway process's event reader; TTL             |
"""

PREFIX = "lf"
WORKER_GROUP = "workers"
WEBHOOKS = f"{PREFIX}:webhooks"
WEBHOOK_GROUP = "webhooks"
DEAD_LETTER = f"{PREFIX}:dlq"
MODELS = f"{PREFIX}:models"
ADAPTERS = f"{PREFIX}:adapters"
WORKERS = f"{PREFIX}:workers"
TENANTS = f"{PREFIX}:tenants"
ALIASES = f"{PREFIX}:aliases"


def queue(model: str) -> str:
    return f"{PREFIX}:q:{model}"


# routing (gateway/routing.py, worker/stealing.py): a job for an adapter goes to one worker's stream
def worker_queue(model: str, worker_id: str) -> str:
    return f"{PREFIX}:wq:{model}:{worker_id}"


def worker_queues(model: str) -> str:
    return f"{PREFIX}:wqs:{model}"


def alias(name: str) -> str:
    return f"{PREFIX}:alias:{name}"


def job(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}"


def job_events(job_id: str) -> str:
    return f"{PREFIX}:out:{job_id}"


def gateway_wake(process_id: str) -> str:
    return f"{PREFIX}:gw-wake:{process_id}"


def model(name: str) -> str:
    return f"{PREFIX}:model:{name}"


def adapter(name: str) -> str:
    return f"{PREFIX}:adapter:{name}"


def adapter_jobs(name: str) -> str:
    return f"{PREFIX}:adapter-jobs:{name}"


def worker(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def tenant(tenant_id: str) -> str:
    return f"{PREFIX}:tenant:{tenant_id}"


def api_key(lookup_id: str) -> str:
    return f"{PREFIX}:apikey:{lookup_id}"


def idempotency(tenant_id: str, key: str) -> str:
    return f"{PREFIX}:idem:{tenant_id}:{key}"


def rate(tenant_id: str) -> str:
    return f"{PREFIX}:rate:{tenant_id}"


def active_jobs(tenant_id: str) -> str:
    return f"{PREFIX}:active:{tenant_id}"
