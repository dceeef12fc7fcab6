"""OpenAI-style bodies (`POST /v1/completions`, `POST /v1/chat/completions`) checked into a `JobRequest`
plus how to answer (streamed or not). Field checks are the job API's (job_request.py); the model
name (`BASE`, `BASE:ADAPTER` or an adapter name) is resolved by the job service.

Fields OpenAI defines that lorafleet cannot honour are accepted only at their neutral value (`n` 1,
`echo` false, penalties 0, no logprobs), so a client never silently gets something else than it
asked for. `top_k` and `ignore_eos` are accepted as vLLM accepts them (the client's `extra_body`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.errors import RequestError
from gateway.job_request import boolean, invalid, parse_prompt, parse_sampling
from shared.config import RequestLimits
from shared.errors import ErrorCode
from shared.schema import SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's

_SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos"}
_COMMON_FIELDS = _SAMPLING_FIELDS | {"model", "stream", "stream_options", "user", "n"}
_NEUTRAL: dict[str, tuple[Any, ...]] = {  # field → the values that change nothing
    "n": (1,),
    "echo": (False,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logprobs": (False,),
    "best_of": (1,),
    "top_logprobs": (0,),
}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "presence_penalty", "frequency_penalty", "logprobs", "best_of"}
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
}
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    model: str  # as the client named it: BASE, BASE:ADAPTER or an adapter
    prompt: str | tuple[int, ...] | None  # completions
    messages: tuple[dict[str, str], ...] | None  # chat: role + text content
    sampling: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    fit_context: bool  # no max_tokens given (chat): up to limits.max_output_tokens, lowered to the context's room


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(unknown[0], f"unknown or unsupported field(s): {', '.join(unknown)}")
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and (isinstance(value, bool) != isinstance(neutral[0], bool) or value not in neutral):
            raise invalid(name, f"{name} is not supported (only {neutral[0]!r})")


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "model is required: BASE, BASE:ADAPTER or an adapter name")
    return model


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise invalid("stream_options", "stream_options may only hold include_usage")
    return stream, boolean(options, "include_usage", False)


def _text_content(content: Any, index: int) -> str:
    """A message's content: a string, or a list of `{"type": "text", "text": ...}` parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)
    raise invalid(f"messages[{index}].content", "content must be a string or a list of text parts")


def _messages(body: dict[str, Any], limits: RequestLimits) -> tuple[dict[str, str], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages is required: a non-empty list of {role, content}")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise invalid(f"messages[{index}].role", f"role must be one of {', '.join(sorted(CHAT_ROLES))}")
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise invalid(f"messages[{index}]", f"unsupported message field(s): {', '.join(sorted(extra))}")
        checked.append({"role": message["role"], "content": _text_content(message.get("content"), index)})
    total = sum(len(message["content"]) for message in checked)
    if total > limits.max_prompt_chars:
        raise RequestError(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"messages hold {total} characters, over the limit of {limits.max_prompt_chars}",
            param="messages",
        )
    return tuple(checked)


def parse_completion_request(body: dict[str, Any], limits: RequestLimits) -> OpenAIRequest:
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        body = {**body, "prompt": prompt[0]}  # a batch of one
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        raise invalid("prompt", "only one prompt per request is supported")
    stream, include_usage = _stream(body)
    return OpenAIRequest(
        model=_model(body),
        prompt=parse_prompt(body, limits),
        messages=None,
        sampling=parse_sampling(body, limits, min(COMPLETION_DEFAULT_MAX_TOKENS, limits.max_output_tokens)),
        stream=stream,
        include_usage=include_usage,
        fit_context=False,
    )


def parse_chat_request(body: dict[str, Any], limits: RequestLimits) -> OpenAIRequest:
    _check_fields(body, CHAT_FIELDS)
    if body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            raise invalid("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    stream, include_usage = _stream(body)
    return OpenAIRequest(
        model=_model(body),
        prompt=None,
        messages=_messages(body, limits),
        sampling=parse_sampling(body, limits, limits.max_output_tokens),
        stream=stream,
        include_usage=include_usage,
        fit_context=body.get("max_tokens") is None,
    )
