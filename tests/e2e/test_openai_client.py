"""The official `openai` client against real gateway and worker processes (the demo model, whose
tokenizer_config.json carries a simple chat template): completions and chats, streamed and not,
with the base model and with a tenant's adapter named as the model."""

from __future__ import annotations

import openai
import pytest

from cli.demo_adapters import DEMO_ADAPTERS
from tests.fleet import MODEL, Fleet

pytestmark = pytest.mark.slow

ADAPTER = DEMO_ADAPTERS[0]


@pytest.fixture
def stack(fleet: Fleet) -> Fleet:
    """A gateway and a CPU worker serving the demo model and its tenants' adapters."""
    fleet.start_gateway()
    fleet.start_worker("w1")
    return fleet


def _client(stack: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.api_keys[ADAPTER.tenant], max_retries=0, timeout=60)


def test_openai_client_completions_streamed_equal_unstreamed(stack):
    client = _client(stack)
    for model in (MODEL, ADAPTER.name, f"{MODEL}:{ADAPTER.name}"):
        whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0)
        assert whole.choices[0].finish_reason in ("stop", "length") and whole.usage.completion_tokens >= 1
        chunks = list(
            client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True)
        )
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        assert len(chunks) > 3  # token by token, not one piece at the end
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    adapted = client.completions.create(model=ADAPTER.name, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert base.choices[0].text != adapted.choices[0].text


def test_openai_client_chat_streamed_equal_unstreamed(stack):
    client = _client(stack)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(model=ADAPTER.name, messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=ADAPTER.name,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_openai_client_models_and_errors(stack):
    client = _client(stack)
    ids = {model.id for model in client.models.list()}
    assert MODEL in ids and ADAPTER.name in ids
    assert not {a.name for a in DEMO_ADAPTERS if a.tenant != ADAPTER.tenant} & ids
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model=DEMO_ADAPTERS[1].name, prompt="hi")
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", n=2)
