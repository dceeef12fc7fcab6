"""Every Redis key lorafleet uses, in one place.

| key                           | type   | what                                                      |
| ----------------------------- | ------ | --------------------------------------------------------- |
| lf:q:{model}                  | stream | queued interactive jobs for one base model, any worker (group `workers`) |
| lf:qb:{model}                 | stream | queued batch jobs for one base model, any worker (group `workers`) |
| lf:wq:{model}:{worker}        | stream | interactive jobs routed to one worker of the model (group `workers`) |
| lf:wqs:{model}                | set    | the model's worker streams (routing; stealing; re-claim)  |
| lf:job:{id}                   | hash   | job record (status, tenant, timings, result); TTL         |
| lf:out:{id}                   | stream | job events (tokens, final) for long-poll / streaming; TTL |
| lf:dlq                        | stream | jobs that failed delivery too many times (capped)         |
| lf:models / lf:model:{name}   | set / hash | base models: ModelInfo, tokenizer.json, served_ms    |
| lf:adapters / lf:adapter:{n}  | set / hash | adapter registry records                              |
| lf:adapter-jobs:{n}           | zset   | job ids queued or running on adapter n (unregister: 409)  |
| lf:aliases / lf:alias:{name}  | set / hash | adapter aliases: owner, base model, weighted adapters  |
| lf:adapter-aliases:{n}        | set    | the aliases naming adapter n (unregister: 409)            |
| lf:workers / lf:worker:{id}   | set / hash | worker heartbeats; the hash has a TTL                 |
| lf:tenants / lf:tenant:{id}   | set / hash | tenants (name, salted key hash, disabled)             |
| lf:apikey:{lookup}            | string | API-key lookup id → tenant id                             |
| lf:idem:{tenant}:{key}        | string | Idempotency-Key → job id; TTL                             |
| lf:rate:{tenant}              | hash   | the tenant's request and token buckets; TTL               |
| lf:active:{tenant}            | zset   | the tenant's admitted job ids (queued or running)         |
| lf:webhooks                   | stream | finished jobs' webhooks to call (group `webhooks`: gateways) |
| lf:gw-wake:{process}          | stream | wakes one gateway process's event reader; TTL             |
| lf:file:{id}                  | hash   | an uploaded or batch-made file's metadata (tenant, bytes…) |
| lf:file-lines:{id}            | list   | the file's content, one JSONL line per element             |
| lf:files:{tenant}             | zset   | the tenant's file ids by creation time (ms)                |
| lf:file-expiry                | zset   | every file id by its expiry time (ms): the janitor's list   |
| lf:batch:{id}                 | hash   | a batch: status, request counts, cursor, file ids         |
| lf:batch-jobs:{id}            | hash   | lines in flight: job id → JSON [line index, custom_id, model] |
| lf:batch-out:{id} / -err:{id} | list   | output / error lines so far (become the batch's files)     |
| lf:batches:{tenant}           | zset   | the tenant's batch ids by creation time (ms)               |
| lf:batches-active             | set    | batches not yet finished: every gateway's driver scans it  |
| lf:batch-lease:{id}           | string | the gateway driving a batch now; TTL                       |
| lf:batch-expiry               | zset   | every batch id by when its record is removed (ms)          |
"""

from shared.schema import Priority

PREFIX = "lf"
_QUEUE_PREFIX = {Priority.INTERACTIVE: "q", Priority.BATCH: "qb"}
WORKER_GROUP = "workers"
WEBHOOKS = f"{PREFIX}:webhooks"
WEBHOOK_GROUP = "webhooks"
DEAD_LETTER = f"{PREFIX}:dlq"
MODELS = f"{PREFIX}:models"
ADAPTERS = f"{PREFIX}:adapters"
WORKERS = f"{PREFIX}:workers"
TENANTS = f"{PREFIX}:tenants"
ALIASES = f"{PREFIX}:aliases"


def queue(model: str, priority: Priority = Priority.INTERACTIVE) -> str:
    """The stream of `model`'s jobs of one priority class: a worker reads the interactive one first."""
    return f"{PREFIX}:{_QUEUE_PREFIX[priority]}:{model}"


# routing (gateway/routing.py, worker/routed_streams.py): an interactive job for an adapter goes to one worker's stream
def worker_queue(model: str, worker_id: str) -> str:
    return f"{PREFIX}:wq:{model}:{worker_id}"


def worker_queues(model: str) -> str:
    return f"{PREFIX}:wqs:{model}"


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


def alias(name: str) -> str:
    return f"{PREFIX}:alias:{name}"


def adapter_aliases(adapter_name: str) -> str:
    return f"{PREFIX}:adapter-aliases:{adapter_name}"


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


FILE_EXPIRY = f"{PREFIX}:file-expiry"
BATCHES_ACTIVE = f"{PREFIX}:batches-active"
BATCH_EXPIRY = f"{PREFIX}:batch-expiry"


def file(file_id: str) -> str:
    return f"{PREFIX}:file:{file_id}"


def file_lines(file_id: str) -> str:
    return f"{PREFIX}:file-lines:{file_id}"


def tenant_files(tenant_id: str) -> str:
    return f"{PREFIX}:files:{tenant_id}"


def batch(batch_id: str) -> str:
    return f"{PREFIX}:batch:{batch_id}"


def batch_jobs(batch_id: str) -> str:
    return f"{PREFIX}:batch-jobs:{batch_id}"


def batch_output(batch_id: str) -> str:
    return f"{PREFIX}:batch-out:{batch_id}"


def batch_errors(batch_id: str) -> str:
    return f"{PREFIX}:batch-err:{batch_id}"


def tenant_batches(tenant_id: str) -> str:
    return f"{PREFIX}:batches:{tenant_id}"


def batch_lease(batch_id: str) -> str:
    return f"{PREFIX}:batch-lease:{batch_id}"
