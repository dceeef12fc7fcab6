"""`POST /v1/jobs` bodies, checked field by field into a `JobRequest` (no I/O here).

Checks that need the model (token ids against its vocabulary, prompt + output against its
context) happen in the job service, once the model is known. A field given as JSON `null` takes
its default; `model` and `prompt` are required.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gateway.errors import RequestError
from gateway.webhook_policy import check_webhook_url
from shared.config import RequestLimits, WebhookConfig
from shared.errors import ErrorCode
from shared.schema import PRIORITIES, Priority, SamplingParams

FIELDS = frozenset(
    {
        "model",
        "adapter",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "ignore_eos",
        "deadline_s",
        "stream",
        "webhook",
        "priority",
    }
)
_DEFAULTS = SamplingParams()
_MAX_SEED = 2**64 - 1
_MAX_TOP_K = 2**31 - 1  # fits the samplers' index types; any k over the vocabulary size filters nothing


@dataclass(frozen=True, slots=True)
class JobRequest:
    """A syntactically valid job: text prompts are tokenized later, token-id prompts are used as given.

    `add_special_tokens`: encode a text prompt with the model's special tokens (False for a rendered
    chat template, which writes its own). `fit_context`: lower max_tokens to the room the prompt
    leaves in the context instead of refusing (for requests that gave no max_tokens). `stream`: the
    worker publishes each token to the job's event stream (`GET /v1/jobs/{id}/events`, OpenAI
    `stream: true`); otherwise the events are the end only.
    """

    model: str
    adapter: str | None
    prompt: str | tuple[int, ...]
    sampling: SamplingParams
    add_special_tokens: bool = True
    fit_context: bool = False
    deadline_s: float | None = None  # seconds after submission; a job not finished by then expires
    stream: bool = False
    webhook: str | None = None  # an allowed URL, called once with the finished job
    priority: Priority = Priority.INTERACTIVE


def invalid(param: str, message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_REQUEST, message, param=param)


def _integer(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"{name} must be an integer")
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(name, f"{name} must be a finite number")
    try:
        number = float(value)
    except OverflowError:  # an integer literal too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise invalid(name, f"{name} must be a finite number")
    return number


def boolean(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"{name} must be true or false")
    return value


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "model is required: the name of a base model")
    return model


def _adapter(body: dict[str, Any]) -> str | None:
    adapter = body.get("adapter")
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise invalid("adapter", "adapter must be a non-empty string or null")
    return adapter


def parse_prompt(body: dict[str, Any], limits: RequestLimits) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if len(prompt) > limits.max_prompt_chars:
            raise RequestError(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"prompt has {len(prompt)} characters, over the limit of {limits.max_prompt_chars}",
                param="prompt",
            )
        if not prompt:
            raise RequestError(ErrorCode.EMPTY_PROMPT, "prompt must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise RequestError(ErrorCode.EMPTY_PROMPT, "prompt must not be empty", param="prompt")
        if any(isinstance(token, bool) or not isinstance(token, int) for token in prompt):
            raise invalid("prompt", "a token-id prompt must be a list of integers")
        return tuple(prompt)
    raise invalid("prompt", "prompt is required: a string or a list of token ids")


def _stop(body: dict[str, Any], limits: RequestLimits) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return _DEFAULTS.stop
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        raise invalid("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(strings) > limits.max_stop_strings:
        raise invalid("stop", f"stop has {len(strings)} strings, over the limit of {limits.max_stop_strings}")
    if any(len(s) > limits.max_stop_chars for s in strings):
        raise invalid("stop", f"each stop string must be at most {limits.max_stop_chars} characters")
    return tuple(strings)


def parse_sampling(
    body: dict[str, Any], limits: RequestLimits, default_max_tokens: int = _DEFAULTS.max_tokens
) -> SamplingParams:
    """The sampling fields of a request body (shared by the job API and the OpenAI endpoints)."""
    max_tokens = _integer(body, "max_tokens", default_max_tokens)
    if not 1 <= max_tokens <= limits.max_output_tokens:
        raise invalid("max_tokens", f"max_tokens must be between 1 and {limits.max_output_tokens}")
    temperature = _number(body, "temperature", _DEFAULTS.temperature)
    if temperature < 0:
        raise invalid("temperature", "temperature must be >= 0")
    top_p = _number(body, "top_p", _DEFAULTS.top_p)
    if not 0 < top_p <= 1:
        raise invalid("top_p", "top_p must be in (0, 1]")
    top_k = _integer(body, "top_k", _DEFAULTS.top_k)
    if not 0 <= top_k <= _MAX_TOP_K:
        raise invalid("top_k", f"top_k must be between 0 (off) and {_MAX_TOP_K}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED):
        raise invalid("seed", "seed must be null or an integer in [0, 2**64 - 1]")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=_stop(body, limits),
        ignore_eos=boolean(body, "ignore_eos", _DEFAULTS.ignore_eos),
    )


def parse_job_request(body: dict[str, Any], limits: RequestLimits, webhooks: WebhookConfig) -> JobRequest:
    """Check a decoded `POST /v1/jobs` body against the API, `limits` and the webhook policy; raise
    RequestError naming the field."""
    if not FIELDS.issuperset(body):
        unknown = sorted(set(body) - FIELDS)
        raise invalid(unknown[0], f"unknown field(s): {', '.join(unknown)}")
    return JobRequest(
        model=_model(body),
        adapter=_adapter(body),
        prompt=parse_prompt(body, limits),
        sampling=parse_sampling(body, limits),
        deadline_s=_deadline(body, limits),
        stream=boolean(body, "stream", False),
        webhook=None if body.get("webhook") is None else check_webhook_url(body["webhook"], webhooks),
        priority=_priority(body),
    )


def _priority(body: dict[str, Any]) -> Priority:
    value = body.get("priority")
    if value is None:
        return Priority.INTERACTIVE
    if value not in PRIORITIES:  # a StrEnum member equals its string
        raise invalid("priority", f"priority must be one of {', '.join(PRIORITIES)}")
    return Priority(value)


def _deadline(body: dict[str, Any], limits: RequestLimits) -> float | None:
    if body.get("deadline_s") is None:
        return None
    deadline_s = _number(body, "deadline_s", 0.0)
    if not 0 < deadline_s <= limits.max_deadline_s:
        raise invalid("deadline_s", f"deadline_s must be in (0, {limits.max_deadline_s:g}] seconds")
    return deadline_s
