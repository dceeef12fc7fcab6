"""What refuses a job at submit, as RequestErrors: its prompt against the model (vocabulary, context
length) and the admission script's denial (shared/rate_limits.py)."""

from __future__ import annotations

from dataclasses import replace

from gateway.errors import RequestError
from gateway.job_request import JobRequest
from shared.errors import ErrorCode
from shared.model_info import ModelInfo
from shared.rate_limits import Denial
from shared.schema import SamplingParams


def admission_refusal(denial: Denial, model: ModelInfo, cost_tokens: int) -> RequestError:
    """The error for a job the submit script did not admit."""
    if denial.limit == "invalid_api_key":  # rotated since this gateway cached the key
        return RequestError(ErrorCode.INVALID_API_KEY, "the API key is not valid")
    if denial.limit == "tenant_disabled":
        return RequestError(ErrorCode.TENANT_DISABLED, "this tenant is disabled")
    if denial.limit == "tokens_per_request":
        return RequestError(
            ErrorCode.INVALID_REQUEST,
            f"prompt + max_tokens ({cost_tokens} tokens) exceeds your tokens-per-minute limit ({denial.value})",
            param="max_tokens",
        )
    if denial.limit == "queue":
        return RequestError(
            ErrorCode.QUEUE_FULL,
            f"model {model.name!r} has {denial.value} jobs queued or running, its limit; retry later",
            retry_after_s=denial.retry_after_s,
        )
    return RequestError(
        ErrorCode.RATE_LIMITED,
        f"over your {denial.limit.replace('_', ' ')} limit ({denial.value}); retry after {denial.retry_after_s} s",
        retry_after_s=denial.retry_after_s,
    )


def checked_sampling(model: ModelInfo, request: JobRequest, token_ids: tuple[int, ...]) -> SamplingParams:
    """The request's sampling parameters once its prompt's token ids are checked against the vocabulary
    (ids the client gave) and the model's context length, max_tokens lowered to the context's room when
    the request allows."""
    sampling = request.sampling
    if not token_ids:
        raise RequestError(ErrorCode.EMPTY_PROMPT, "prompt encodes to no tokens", param="prompt")
    if not isinstance(request.prompt, str):
        bad = next((t for t in token_ids if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise RequestError(
                ErrorCode.INVALID_TOKEN_ID,
                f"token id {bad} is outside the vocabulary of {model.name!r} [0, {model.vocab_size})",
                param="prompt",
            )
    room = model.max_context - len(token_ids)
    if request.fit_context and 1 <= room < sampling.max_tokens:
        sampling = replace(sampling, max_tokens=room)
    total = len(token_ids) + sampling.max_tokens
    if total > model.max_context:
        raise RequestError(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"prompt ({len(token_ids)} tokens) + max_tokens ({sampling.max_tokens}) = {total} tokens, "
            f"over the context length of {model.name!r} ({model.max_context} tokens)",
            param="prompt",
        )
    return sampling
