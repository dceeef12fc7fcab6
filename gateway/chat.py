"""Chat messages → prompt text with the model's own chat template (from its tokenizer_config.json).

Templates are Jinja, rendered the way transformers' `apply_chat_template` does: in a sandbox (a
template is data published by a worker, not code the gateway trusts), with `messages`,
`add_generation_prompt`, the special tokens and `raise_exception`. Compiled templates are cached by
their source, so a republished template takes effect at once.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.errors import RequestError
from shared.chat_template import ChatTemplate
from shared.errors import ErrorCode


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRaised(message)


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = _raise_exception
    return environment.from_string(source)


def render_chat(template: ChatTemplate, messages: tuple[dict[str, str], ...]) -> str:
    """The prompt for `messages`, ending with the template's cue for the assistant's turn. A template
    that refuses the messages (e.g. roles out of order) is a 400 invalid_chat_template naming why."""
    try:
        return _compile(template.source).render(
            messages=list(messages),
            add_generation_prompt=True,
            bos_token=template.bos_token,
            eos_token=template.eos_token,
        )
    except _TemplateRaised as exc:
        raise RequestError(
            ErrorCode.INVALID_CHAT_TEMPLATE, f"the model's chat template: {exc}", param="messages"
        ) from None
    except jinja2.TemplateError as exc:
        raise RequestError(
            ErrorCode.INVALID_CHAT_TEMPLATE, f"the model's chat template failed: {exc}", param="messages"
        ) from exc
