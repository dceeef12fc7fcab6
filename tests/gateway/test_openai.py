"""The OpenAI-compatible endpoints against the fleet fixture, with the test playing the worker."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from aiohttp.test_utils import TestClient

from shared.chat_template import ChatTemplate
from shared.model_registry import publish_model
from shared.schema import FinishReason
from tests.gateway.fleet import BOS_ID, WORDS, Fleet, next_queued_job, play_worker

TEMPLATE = ChatTemplate("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}quick", "<s>", "</s>")


async def _post(client: TestClient, fleet: Fleet, path: str, body: dict[str, Any], tenant: str = "acme"):
    return await client.post(path, json=body, headers=fleet.auth(tenant))


async def test_completion_runs_as_a_job_and_answers_in_openai_shape(client, fleet):
    request = asyncio.create_task(
        _post(client, fleet, "/v1/completions", {"model": "tiny", "prompt": "hello world", "max_tokens": 5})
    )
    message = await next_queued_job(fleet.redis)
    assert message.prompt_token_ids == (BOS_ID, WORDS.index("hello"), WORDS.index("world"))
    assert message.sampling.max_tokens == 5 and message.adapter is None
    assert not message.stream, "nobody reads a non-streamed completion's token events"
    await play_worker(fleet.redis, message, ["the", " fox"], "the fox", finish=FinishReason.LENGTH)
    response = await request
    assert response.status == 200, await response.text()
    body = await response.json()
    assert body["id"] == message.job_id and body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"] == [{"index": 0, "text": "the fox", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    job = await (await client.get(f"/v1/jobs/{message.job_id}", headers=fleet.auth("acme"))).json()
    assert job["status"] == "succeeded"


async def test_completion_default_max_tokens_is_openais_16(client, fleet):
    request = asyncio.create_task(_post(client, fleet, "/v1/completions", {"model": "tiny", "prompt": "hello"}))
    message = await next_queued_job(fleet.redis)
    assert message.sampling.max_tokens == 16
    await play_worker(fleet.redis, message, [], "")
    assert (await request).status == 200


async def test_model_names_base_colon_adapter_and_bare_adapter(client, fleet):
    for model, adapter in (
        ("tiny:acme-support", "acme-support"),
        ("acme-support", "acme-support"),
        ("shared-chat", "shared-chat"),
    ):
        request = asyncio.create_task(_post(client, fleet, "/v1/completions", {"model": model, "prompt": "hello"}))
        message = await next_queued_job(fleet.redis)
        assert message.model == "tiny" and message.adapter.name == adapter
        await play_worker(fleet.redis, message, [], "x")
        body = await (await request).json()
        assert body["model"] == model


async def test_another_tenants_adapter_is_not_a_model_for_you(client, fleet):
    response = await _post(client, fleet, "/v1/completions", {"model": "globex-legal", "prompt": "hello"})
    assert response.status == 404
    assert (await response.json())["error"] == {
        "code": "model_not_found",
        "message": "model 'globex-legal' not found",
        "param": "model",
    }
    response = await _post(client, fleet, "/v1/completions", {"model": "tiny:globex-legal", "prompt": "hello"})
    assert response.status == 404 and (await response.json())["error"]["code"] == "adapter_not_found"


async def test_streamed_completion_adds_up_to_the_final_text(client, fleet):
    body = {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = asyncio.create_task(_post(client, fleet, "/v1/completions", body))
    message = await next_queued_job(fleet.redis)
    assert message.stream
    # the last piece was held back by the worker (a possible stop string): the end supplies it
    await play_worker(fleet.redis, message, ["the", " quick"], "the quick fox")
    response = await request
    assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
    lines = [line for line in (await response.text()).split("\n") if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == "the quick fox"
    assert texts[:2] == ["the", " quick"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


async def test_chat_renders_the_models_template_without_adding_special_tokens(client, fleet):
    await publish_model(fleet.redis, fleet.models["tiny"], fleet.tokenizer.to_str().encode(), TEMPLATE)
    body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello world"}]}]}
    request = asyncio.create_task(_post(client, fleet, "/v1/chat/completions", body))
    message = await next_queued_job(fleet.redis)
    # "user hello world quick": 'user' is not in the vocabulary (<unk>), and no BOS is added
    assert message.prompt_token_ids == tuple(WORDS.index(w) for w in ("<unk>", "hello", "world", "quick"))
    # no max_tokens: as much as the context leaves, up to limits.max_output_tokens
    assert message.sampling.max_tokens == 32
    await play_worker(fleet.redis, message, ["fox"], "fox")
    answer = await (await request).json()
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "fox"}


async def test_streamed_chat_sends_role_then_content_deltas(client, fleet):
    await publish_model(fleet.redis, fleet.models["tiny"], fleet.tokenizer.to_str().encode(), TEMPLATE)
    body = {"model": "acme-support", "messages": [{"role": "user", "content": "hello"}], "stream": True}
    request = asyncio.create_task(_post(client, fleet, "/v1/chat/completions", body))
    message = await next_queued_job(fleet.redis)
    await play_worker(fleet.redis, message, ["the", " dog"], "the dog")
    lines = [line for line in (await (await request).text()).split("\n") if line]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "the dog"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["object"] == "chat.completion.chunk"


async def test_chat_on_a_model_without_template_is_a_clear_400(client, fleet):
    response = await _post(
        client, fleet, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status == 400
    assert (await response.json())["error"]["code"] == "chat_template_missing"


async def test_a_failed_job_is_an_error_response(client, fleet):
    from shared.jobstore import JobStore
    from shared.schema import JobError, JobStatus

    request = asyncio.create_task(_post(client, fleet, "/v1/completions", {"model": "tiny", "prompt": "hello"}))
    message = await next_queued_job(fleet.redis)
    await JobStore(fleet.redis, 60).finish(message.job_id, JobStatus.FAILED, error=JobError("numerical_error", "nan"))
    response = await request
    assert response.status == 500
    assert (await response.json())["error"] == {"code": "numerical_error", "message": "nan"}


async def test_models_lists_bases_and_only_the_callers_adapters(client, fleet):
    body = await (await client.get("/v1/models", headers=fleet.auth("acme"))).json()
    ids = {m["id"]: m for m in body["data"]}
    assert set(ids) == {"tiny", "other", "acme-support", "acme-other", "shared-chat"}
    assert ids["acme-support"]["parent"] == "tiny" and ids["acme-other"]["parent"] == "other"
    assert (ids["tiny"]["quantization"], ids["tiny"]["kv_cache_dtype"]) == ("none", "auto")
    assert (await client.get("/v1/models")).status == 401


async def test_models_says_how_a_base_model_is_quantized(client, fleet):
    kept = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj")
    served = dataclasses.replace(fleet.models["other"], quantization="fp8", kv_cache_dtype="fp8", unquantized=kept)
    await publish_model(fleet.redis, served, fleet.tokenizer.to_str().encode())
    body = await (await client.get("/v1/models", headers=fleet.auth("acme"))).json()
    models = {model["id"]: model for model in body["data"]}
    assert (models["other"]["quantization"], models["other"]["kv_cache_dtype"]) == ("fp8", "fp8")
    # its one layer keeps q/k/v in the checkpoint's dtype: they are so in every layer
    pattern = ["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.k_proj", "model.layers.*.self_attn.v_proj"]
    assert models["other"]["unquantized_projections"] == pattern
    assert models["tiny"]["unquantized_projections"] == []


async def test_bad_openai_input_is_a_400_naming_the_field(client, fleet):
    cases = [
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 2}, "n"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {}}, "logit_bias"),
        ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, "prompt"),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ("/v1/completions", {"prompt": "hi"}, "model"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": 3}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 1,
                "max_completion_tokens": 1,
            },
            "max_completion_tokens",
        ),
    ]
    for path, body, param in cases:
        response = await _post(client, fleet, path, body)
        assert response.status == 400, (body, await response.text())
        assert (await response.json())["error"]["param"] == param, body
