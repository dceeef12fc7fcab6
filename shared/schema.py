"""The wire schema: what a gateway puts on a model's queue and what a worker writes back.

Queue messages are msgpack maps carrying a schema version `v`; a worker refuses a message whose
version it does not know rather than guessing. The job record lives in a Redis hash whose fields
are plain strings (so Lua scripts can read them) plus msgpack blobs for nested values.

Versioning rules for queue messages (gateways and workers of two releases meet during a rolling
upgrade):
- A new field whose absence means exactly what the old code did keeps the version: decoders read
  it with `.get(name, <the old behaviour>)`, and older decoders ignore it. (`stream`: messages from
  before it existed were all streamed, so its absence decodes as True.)
- Removing a field, making one required, or changing what a value means bumps SCHEMA_VERSION; a
  worker then refuses the other version's messages (dead-lettered), never misreads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import msgpack

SCHEMA_VERSION = 1


class SchemaError(ValueError):
    """A message that does not decode into the schema this process speaks."""


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
    sha256: str

    @property
    def uid(self) -> str:
        """Identity of these exact weights: a re-registered name gets a new uid, so a worker never
        serves a cached copy of an older version under the new one."""
        return f"{self.name}@{self.version}:{self.sha256[:16]}"


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
            else {"name": adapter.name, "version": adapter.version, "path": adapter.path, "sha256": adapter.sha256},
            "created_at": message.created_at,
            "deadline": message.deadline,
            "request_id": message.request_id,
            "stream": message.stream,
        }
    )


def decode_job(payload: bytes) -> JobMessage:
    try:
        data = msgpack.unpackb(payload)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise SchemaError(f"not a msgpack job message: {exc}") from exc
    if not isinstance(data, dict) or data.get("v") != SCHEMA_VERSION:
        raise SchemaError(f"unsupported job schema version: {data.get('v') if isinstance(data, dict) else None!r}")
    try:
        sampling = data["sampling"]
        adapter = data["adapter"]
        return JobMessage(
            job_id=data["job_id"],
            tenant=data["tenant"],
            model=data["model"],
            prompt_token_ids=tuple(data["prompt_token_ids"]),
            sampling=SamplingParams(
                max_tokens=sampling["max_tokens"],
                temperature=sampling["temperature"],
                top_p=sampling["top_p"],
                top_k=sampling["top_k"],
                seed=sampling["seed"],
                stop=tuple(sampling["stop"]),
                ignore_eos=sampling["ignore_eos"],
            ),
            adapter=None if adapter is None else AdapterRef(**adapter),
            created_at=data["created_at"],
            deadline=data["deadline"],
            request_id=data["request_id"],
            stream=bool(data.get("stream", True)),  # see the versioning rules above
        )
    except (KeyError, TypeError) as exc:
        raise SchemaError(f"malformed job message: {exc!r}") from exc


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
        ]  # fmt: skip
        if self.webhook:
            fields += ["webhook", self.webhook]
        return fields

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> JobRecord:
        fields = {k.decode(): v for k, v in raw.items()}

        def text(name: str) -> str:
            return fields[name].decode() if name in fields else ""

        def number(name: str) -> int:
            return int(fields[name]) if name in fields else 0

        output = None
        if "output" in fields:
            blob = msgpack.unpackb(fields["output"])
            output = JobOutput(blob["text"], tuple(blob["token_ids"]), FinishReason(blob["finish_reason"]))
        error = JobError(text("error_code"), text("error_message")) if "error_code" in fields else None
        return cls(
            job_id=text("job_id"),
            status=JobStatus(text("status")),
            tenant=text("tenant"),
            model=text("model"),
            adapter=text("adapter") or None,
            created_ms=number("created_ms"),
            started_ms=number("started_ms"),
            first_token_ms=number("first_token_ms"),
            finished_ms=number("finished_ms"),
            prompt_tokens=number("prompt_tokens"),
            completion_tokens=number("completion_tokens"),
            attempts=number("attempts"),
            worker=text("worker"),
            output=output,
            error=error,
            webhook=text("webhook") or None,
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


def encode_output(output: JobOutput) -> bytes:
    return msgpack.packb(
        {"text": output.text, "token_ids": list(output.token_ids), "finish_reason": output.finish_reason.value}
    )
