"""The job store's errors: a new job no replica confirmed, and Redis errors that mean a job's keys are no job's."""

from __future__ import annotations

from typing import Any

from redis.exceptions import ResponseError

from shared.config import ReplicaWait
from shared.errors import ErrorCode, LorafleetError
from shared.schema import SchemaError


class ReplicaUnavailable(LorafleetError):
    """No replica confirmed a new job within the wait: it was withdrawn, and is not queued."""

    def __init__(self, job_id: str, confirmed: int, wait: ReplicaWait) -> None:
        message = f"{confirmed} of {wait.replicas} Redis replicas confirmed the job within {wait.timeout_ms} ms"
        super().__init__(ErrorCode.REPLICA_UNAVAILABLE, f"{message}; it was not queued, submit it again")
        self.job_id = job_id


def raise_on_error(replies: list[Any], what: str) -> None:
    """Raise the first error among a pipeline's replies: SchemaError when it says `what` cannot be written."""
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise_if_unreadable(what, reply)
            raise reply


def raise_if_unreadable(what: str, exc: ResponseError) -> None:
    """Raise SchemaError when a command failed because the job's record is not one (another Redis
    type, a field that is no integer or would overflow one); other server errors are the caller's to
    re-raise."""
    message = str(exc)
    if "WRONGTYPE" in message or "not an integer" in message or "would overflow" in message:
        raise SchemaError(f"{what} cannot be read ({message[:120]})") from exc
