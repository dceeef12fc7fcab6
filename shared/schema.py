"""The wire schema: what a gateway puts on a model's queue and what a worker writes back.

Queue messages are msgpack maps carrying a schema version `v`; a worker refuses a message whose
version it does not know rather than guessing. The job record lives in a Redis hash whose fields
are plain strings (so Lua scripts can read them) plus msgpack blobs for nested values.

Versioning rules for queue messages (gateways and workers of two releases meet during a rolling
upgrade):
- A new field whose absence means exactly what the old code did keeps the version: decoders read
  it with `.get(name, <the old behaviour>)`, and older decoders ignore it. (`stream`: messages from
  before it existed were all streamed, so its absence decodes as True; `priority`: absent, the job
  is interactive, as every job was before the classes.)
- Removing a field, making one required, or changing what a value means bumps SCHEMA_VERSION; a
  worker then refuses the other version's messages (dead-lettered), never misreads them.

Decoding checks every field's type and range at the boundary (`decode_job`, `JobRecord.from_hash`,
`decode_status`, through shared/wire_fields.py): whatever is wrong, the one error is SchemaError,
naming the field, so a reader can refuse an entry without knowing how it went wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import msgpack

from shared.adapter_digest import DIGEST_CHARS
from shared.wire_fields import Fields, SchemaError

SCHEMA_VERSION = 2  # 2: an adapter is named by its piece digest (`digest`), no longer a plain `sha256`
_MAX_TOKEN_ID = 2**31 - 1
_MAX_PROMPT_TOKENS = 1 << 20
_MAX_COUNT = 2**31 - 1  # max_tokens, top_k
_MAX_SEED = 2**64 - 1
_MAX_STOP_STRINGS, _MAX_STOP_CHARS = 64, 4096
_MAX_NAME_CHARS = 1024  # ids, names, paths of the message


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELED, JobStatus.EXPIRED})


class Priority(StrEnum):
    """A job's class: interactive work is admitted first; batch work fills what is left of each step
    and gives up its KV blocks when interactive work needs them (worker/engine/scheduler.py)."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


PRIORITIES = (Priority.INTERACTIVE, Priority.BATCH)  # in the order they are served


class FinishReason(StrEnum):
    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens or the model's context limit


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; top_k 0 and top_p 1 switch those filters off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise SchemaError("max_tokens must be >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SchemaError("temperature must be a finite number >= 0")
        if not (0.0 < self.top_p <= 1.0):
            raise SchemaError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise SchemaError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """Which adapter version a job runs with. `path` is relative to the worker's adapter root."""

    name: str
    version: int
    path: str
    digest: str  # of the weights file, with its scheme: `sha256-pieces-8MiB:<hex>` (shared/adapter_digest.py)

    @property
    def uid(self) -> str:
        """Identity of these exact weights: a re-registered name gets a new uid, so a worker never
        serves a cached copy of an older version under the new one."""
        return f"{self.name}@{self.version}:{self.digest.rpartition(':')[2][:16]}"


@dataclass(frozen=True, slots=True)
class JobMessage:
    """Everything a worker needs to run one job, with no other lookup than the adapter's files."""

    job_id: str
    tenant: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    adapter: AdapterRef | None = None
    created_at: float = 0.0  # unix seconds
    deadline: float | None = None  # unix seconds; a job not finished by then expires
    request_id: str = ""
    # publish each token to the job's event stream (an SSE reader waits for them); otherwise only the end
    stream: bool = False
    priority: Priority = Priority.INTERACTIVE


def encode_job(message: JobMessage) -> bytes:
    sampling = message.sampling
    adapter = message.adapter
    return msgpack.packb(
        {
            "v": SCHEMA_VERSION,
            "job_id": message.job_id,
            "tenant": message.tenant,
            "model": message.model,
            "prompt_token_ids": list(message.prompt_token_ids),
            "sampling": {
                "max_tokens": sampling.max_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "seed": sampling.seed,
                "stop": list(sampling.stop),
                "ignore_eos": sampling.ignore_eos,
            },
            "adapter": None
            if adapter is None
            else {"name": adapter.name, "version": adapter.version, "path": adapter.path, "digest": adapter.digest},
            "created_at": message.created_at,
            "deadline": message.deadline,
            "request_id": message.request_id,
            "stream": message.stream,
            "priority": message.priority.value,
        }
    )


def decode_job(payload: bytes) -> JobMessage:
    """A queue message's bytes → JobMessage, every field's type and range checked; SchemaError otherwise."""
    try:
        data = msgpack.unpackb(payload)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise SchemaError(f"not a msgpack job message: {exc}") from exc
    if not isinstance(data, dict) or data.get("v") != SCHEMA_VERSION:
        version = data.get("v") if isinstance(data, dict) else None
        raise SchemaError(f"unsupported job schema version: {version!r:.40}")
    fields = Fields(data)
    sampling = fields.nested("sampling")
    adapter = fields.nested("adapter", optional=True)
    return JobMessage(
        job_id=fields.text("job_id", _MAX_NAME_CHARS, min_chars=1),
        tenant=fields.text("tenant", _MAX_NAME_CHARS, min_chars=1),
        model=fields.text("model", _MAX_NAME_CHARS, min_chars=1),
        prompt_token_ids=fields.integers(
            "prompt_token_ids", 0, _MAX_TOKEN_ID, min_items=1, max_items=_MAX_PROMPT_TOKENS
        ),
        sampling=SamplingParams(
            max_tokens=sampling.integer("max_tokens", 1, _MAX_COUNT),
            temperature=sampling.number("temperature", 0.0, math.inf),
            top_p=sampling.number("top_p", math.ulp(0.0), 1.0),
            top_k=sampling.integer("top_k", 0, _MAX_COUNT),
            seed=sampling.integer("seed", 0, _MAX_SEED, default=None),
            stop=sampling.texts("stop", _MAX_STOP_CHARS, max_items=_MAX_STOP_STRINGS),
            ignore_eos=sampling.flag("ignore_eos"),
        ),
        adapter=None
        if adapter is None
        else AdapterRef(
            name=adapter.text("name", _MAX_NAME_CHARS, min_chars=1),
            version=adapter.integer("version", 1, 2**63 - 1),
            path=adapter.text("path", _MAX_NAME_CHARS, min_chars=1),
            digest=adapter.text("digest", DIGEST_CHARS, min_chars=1),  # a scheme the worker lacks fails that load
        ),
        created_at=fields.number("created_at", 0.0, math.inf),
        deadline=fields.number("deadline", 0.0, math.inf, default=None),
        request_id=fields.text("request_id", _MAX_NAME_CHARS),
        stream=fields.flag("stream", default=True),  # see the versioning rules above
        priority=decode_priority(fields.text("priority", 16, default=Priority.INTERACTIVE.value)),
    )


def decode_priority(value: str) -> Priority:
    """A priority class as written on the wire (a message lacking one predates the classes: interactive)."""
    try:
        return Priority(value)
    except ValueError as exc:
        raise SchemaError(f"priority {value!r:.40} is not one of {', '.join(PRIORITIES)}") from exc


def decode_status(value: str) -> JobStatus:
    """A job status as stored (a job hash's `status`, a script's reply); SchemaError for any other string."""
    try:
        return JobStatus(value)
    except ValueError as exc:
        raise SchemaError(f"status {value!r:.40} is not a job status") from exc


@dataclass(frozen=True, slots=True)
class JobOutput:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason


@dataclass(frozen=True, slots=True)
class JobError:
    code: str
    message: str


@dataclass(slots=True)
class JobRecord:
    """The job hash `lf:job:{id}`, decoded. Times are unix milliseconds (0 = not yet)."""

    job_id: str
    status: JobStatus
    tenant: str
    model: str
    adapter: str | None
    created_ms: int
    started_ms: int = 0
    first_token_ms: int = 0
    finished_ms: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    attempts: int = 0
    worker: str = ""
    output: JobOutput | None = None
    error: JobError | None = None
    webhook: str | None = None  # URL called once with the finished job
    priority: Priority = Priority.INTERACTIVE
    adapter_version: int = 0  # the version of `adapter` the job was submitted with (0: no adapter)
    alias: str | None = None  # the adapter alias the job named, which drew `adapter` (shared/adapter_aliases.py)

    def hset_fields(self) -> list[str | int | bytes]:
        """A fresh job's hash as HSET's arguments, `[field, value, ...]` (output and error are written by the
        worker's finish); a flat list built at once, not a dict flattened afterwards, since every submit
        makes one. `webhook` is present only when set: the job store's terminal scripts look for it."""
        fields: list[str | int | bytes] = [
            "job_id", self.job_id,
            "status", self.status.value,
            "tenant", self.tenant,
            "model", self.model,
            "adapter", self.adapter or "",
            "created_ms", self.created_ms,
            "prompt_tokens", self.prompt_tokens,
            "attempts", 0,
            "priority", self.priority.value,
        ]  # fmt: skip
        if self.adapter_version:
            fields += ["adapter_version", self.adapter_version]
        if self.alias:
            fields += ["alias", self.alias]
        if self.webhook:
            fields += ["webhook", self.webhook]
        return fields

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> JobRecord:
        """The record from HGETALL's reply; SchemaError naming the field when one cannot be read
        (a status that is not a JobStatus, a count that is not a non-negative integer, …)."""
        fields = raw  # byte-string names and values, as redis-py returns them

        def text(name: bytes) -> str:
            value = fields.get(name)
            if value is None:
                return ""
            try:
                return value.decode()
            except (AttributeError, UnicodeDecodeError) as exc:
                raise SchemaError(f"job record field {name.decode()} is not UTF-8 text") from exc

        def number(name: bytes) -> int:
            value = fields.get(name)
            if value is None:
                return 0
            try:
                count = int(value)
            except (TypeError, ValueError) as exc:
                raise SchemaError(f"job record field {name.decode()} must be an integer, not {value!r:.40}") from exc
            if count < 0:
                raise SchemaError(f"job record field {name.decode()} must not be negative")
            return count

        output = decode_output(fields[b"output"]) if b"output" in fields else None
        error = JobError(text(b"error_code"), text(b"error_message")) if b"error_code" in fields else None
        return cls(
            job_id=text(b"job_id"),
            status=decode_status(text(b"status")),
            tenant=text(b"tenant"),
            model=text(b"model"),
            adapter=text(b"adapter") or None,
            created_ms=number(b"created_ms"),
            started_ms=number(b"started_ms"),
            first_token_ms=number(b"first_token_ms"),
            finished_ms=number(b"finished_ms"),
            prompt_tokens=number(b"prompt_tokens"),
            completion_tokens=number(b"completion_tokens"),
            attempts=number(b"attempts"),
            worker=text(b"worker"),
            output=output,
            error=error,
            webhook=text(b"webhook") or None,
            priority=decode_priority(text(b"priority") or Priority.INTERACTIVE.value),
            adapter_version=number(b"adapter_version"),
            alias=text(b"alias") or None,
        )


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """One running job's progress in one engine step, published to `lf:out:{id}` for streaming: its
    new token and the output text that became final with it (`text` is the output's characters from
    `offset` on; it may be empty while a multi-byte character or a possible stop string is pending)."""

    job_id: str
    token_id: int
    text: str
    offset: int


@dataclass(frozen=True, slots=True)
class JobTrace:
    """When a job passed each point of its way through a worker, unix microseconds, written into its record
    with its result (the fields `trace_<point>_us`): what an operator reads of one slow job, and what
    bench/e2e splits the stack's latency by. Stamped by the gateway (`created`), the worker's I/O loop
    (`read`, `started`, `out`) and its engine thread (`engine`, `first_token`, `last_token`); 0: not reached."""

    created: int  # the gateway made the job (the message's created_at): its record and queue entry follow
    read: int  # the worker read its queue entry
    started: int  # the worker's start script returned: the job is this worker's
    engine: int  # the engine thread took it into the engine
    first_token: int  # the engine read its first token from a step
    last_token: int  # the engine ended it (its last token's step)
    out: int  # the worker's I/O loop took its result, to store it

    FIELDS = ("created", "read", "started", "engine", "first_token", "last_token", "out")

    def hset_fields(self) -> list[str | int]:
        return [item for point in self.FIELDS for item in (f"trace_{point}_us", getattr(self, point))]

    @classmethod
    def field_names(cls) -> list[str]:
        """The record's field names, in FIELDS order (for HMGET)."""
        return [f"trace_{point}_us" for point in cls.FIELDS]


def encode_output(output: JobOutput) -> bytes:
    return msgpack.packb(
        {"text": output.text, "token_ids": list(output.token_ids), "finish_reason": output.finish_reason.value}
    )


def decode_output(blob: bytes) -> JobOutput:
    """A job record's `output` field; SchemaError naming the field when it is not one."""
    try:
        data = msgpack.unpackb(blob)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise SchemaError(f"output is not msgpack: {exc}") from exc
    fields = Fields(data, "output")
    finish_reason = fields.text("finish_reason", 16)
    try:
        reason = FinishReason(finish_reason)
    except ValueError as exc:
        raise SchemaError(f"output.finish_reason {finish_reason!r} is not a finish reason") from exc
    return JobOutput(
        fields.text("text", 1 << 30),
        fields.integers("token_ids", 0, _MAX_TOKEN_ID, min_items=0, max_items=1 << 30),
        reason,
    )
