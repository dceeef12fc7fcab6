"""One OpenAI completion as a job and back: the job request a parsed `/v1/completions` or
`/v1/chat/completions` body makes, and the completion object a finished job answers with. Shared by
the OpenAI endpoints and the batch driver, so a batch line's output is what the endpoint returns."""

from __future__ import annotations

from typing import Any

from gateway.job_request import JobRequest
from gateway.job_service import JobService
from gateway.openai_request import OpenAIRequest
from shared.errors import ErrorCode
from shared.schema import JobRecord, JobStatus, Priority
from shared.tenants import Tenant


async def openai_job_request(
    jobs: JobService, tenant: Tenant, parsed: OpenAIRequest, *, chat: bool, priority: Priority = Priority.INTERACTIVE
) -> JobRequest:
    """The job a parsed OpenAI request asks for: its model name resolved to (base, adapter), chat
    messages rendered with the base model's template."""
    base, adapter = await jobs.resolve_model(tenant, parsed.model)
    if chat:
        prompt: str | tuple[int, ...] = await jobs.chat_prompt(base, parsed.messages or ())
    else:
        prompt = parsed.prompt
    return JobRequest(
        model=base,
        adapter=adapter,
        prompt=prompt,
        sampling=parsed.sampling,
        add_special_tokens=not chat,
        fit_context=parsed.fit_context,
        stream=parsed.stream,
        priority=priority,
    )


def completion_body(done: JobRecord, model: str, *, chat: bool) -> dict[str, Any]:
    """The `chat.completion` or `text_completion` object of a succeeded job, under the model name asked for."""
    output = done.output
    assert output is not None, "a succeeded job has an output"
    finish_reason = output.finish_reason.value
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": output.text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
    else:
        choice = {"index": 0, "text": output.text, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": done.job_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": done.created_ms // 1000,
        "model": model,
        "choices": [choice],
        "usage": usage(done),
    }


def job_failure(record: JobRecord) -> tuple[str, str] | None:
    """(code, message) of a job that did not succeed, else None."""
    if record.status is JobStatus.SUCCEEDED:
        return None
    if record.error is not None:
        return record.error.code, record.error.message
    return ErrorCode.INTERNAL_ERROR.value, f"the job ended {record.status.value}"


def usage(record: JobRecord) -> dict[str, int]:
    return {
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "total_tokens": record.prompt_tokens + record.completion_tokens,
    }
