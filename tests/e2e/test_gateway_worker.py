"""Gateway and worker as real processes over a real Redis: jobs of several tenants and adapters go
through HTTP → Redis stream → worker engine → Redis → HTTP, and their outputs equal the engine's
run in-process on the same model and adapters."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
from tokenizers import Tokenizer

from cli.demo_adapters import DEMO_ADAPTERS
from shared import keys
from shared.adapter_registry import get_adapter
from shared.schema import AdapterRef, SamplingParams
from tests.e2e.processes import wait_until
from tests.engine.engines import load_engine
from tests.fleet import MODEL, Fleet
from worker.engine.engine_request import EngineRequest

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The quick brown fox", "In the beginning"]


@pytest.fixture
def stack(fleet: Fleet):
    """A gateway and a CPU worker whose LoRA pool is one rank-32 adapter's memory: two pages of 16 ranks,
    so two of the three tenants' adapters (ranks 8, 16, 4: a page each) fit and pages get evicted."""
    fleet.start_gateway()
    worker = fleet.start_worker("w1", "--max-loras", "1", "--max-lora-rank", "32")
    yield fleet.url, fleet.api_keys, worker


def engine_outputs(model_dir: Path, adapter_root: Path, jobs: list[dict], redis_url: str) -> list[tuple[int, ...]]:
    """The same jobs run by an in-process engine (greedy), for comparison."""
    engine = load_engine(model_dir, adapter_root, name=MODEL, device="cpu")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    async def adapter_refs() -> dict[str, AdapterRef]:
        client = aioredis.Redis.from_url(redis_url)
        refs = {a.name: (await get_adapter(client, a.name)).ref() for a in DEMO_ADAPTERS}
        await client.aclose()
        return refs

    refs = asyncio.run(adapter_refs())
    for index, job in enumerate(jobs):
        engine.add(
            EngineRequest(
                job_id=str(index),
                prompt_token_ids=tuple(tokenizer.encode(job["prompt"]).ids),
                sampling=SamplingParams(max_tokens=job["max_tokens"], temperature=0.0),
                adapter=refs.get(job.get("adapter")),
            )
        )
    results = {}
    while engine.num_unfinished:
        results.update((r.job_id, r) for r in engine.step())
    return [results[str(i)].output.token_ids for i in range(len(jobs))]


async def submit_and_wait(session: aiohttp.ClientSession, url: str, api_key: str, job: dict) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"}
    async with session.post(f"{url}/v1/jobs", json=job, headers=headers) as response:
        assert response.status == 202, await response.text()
        job_id = (await response.json())["id"]
    for _ in range(60):
        async with session.get(f"{url}/v1/jobs/{job_id}", params={"wait": "5"}, headers=headers) as response:
            body = await response.json()
        if body["status"] not in ("queued", "running"):
            return body
    raise AssertionError(f"job {job_id} did not finish: {body}")


def test_jobs_of_several_tenants_and_adapters_match_the_engine(stack, fleet, demo_assets, redis_url):
    url, api_keys, _ = stack
    jobs: list[tuple[str, dict]] = []
    for adapter, prompt in zip(DEMO_ADAPTERS, PROMPTS, strict=True):
        for name in (adapter.name, None):  # each tenant: its adapter, and the base model
            job = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0.0}
            if name:
                job["adapter"] = name
            jobs.append((adapter.tenant, job))

    async def run_all() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(submit_and_wait(session, url, api_keys[t], job) for t, job in jobs))

    finished = asyncio.run(run_all())
    assert [body["status"] for body in finished] == ["succeeded"] * len(jobs), finished
    expected = engine_outputs(*demo_assets, [job for _, job in jobs], redis_url)
    for body, tokens in zip(finished, expected, strict=True):
        assert tuple(body["output"]["token_ids"]) == tokens
        assert body["usage"]["completion_tokens"] == len(tokens)
        assert body["timings"]["total_ms"] >= body["timings"]["ttft_ms"] >= 0
    # adapters change the output: the same prompt differs with and without the tenant's adapter
    for index in range(0, len(finished), 2):
        assert finished[index]["output"]["token_ids"] != finished[index + 1]["output"]["token_ids"]

    # the heartbeat lists the adapter pool's tiers: two adapters in the two device pages, all three on the host
    def resident() -> dict[str, list[str]]:
        with fleet.redis() as client:
            raw = client.hget(keys.worker("w1"), "adapters")
        return json.loads(raw).get(MODEL, {}) if raw else {}

    wait_until(lambda: len(resident().get("gpu", [])) == 2, timeout_s=10, what="adapters in the heartbeat")
    tiers = resident()
    assert len(tiers["cpu"]) == 3 and set(tiers["gpu"]) <= set(tiers["cpu"])
    assert {uid.partition("@")[0] for uid in tiers["cpu"]} == {a.name for a in DEMO_ADAPTERS}


def test_a_tenant_cannot_use_another_tenants_adapter(stack):
    url, api_keys, _ = stack

    async def attempt() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session:
            job = {"model": MODEL, "adapter": DEMO_ADAPTERS[1].name, "prompt": "hi"}
            headers = {"Authorization": f"Bearer {api_keys[DEMO_ADAPTERS[0].tenant]}"}
            async with session.post(f"{url}/v1/jobs", json=job, headers=headers) as response:
                return response.status, await response.json()

    status, body = asyncio.run(attempt())
    assert status == 404 and body["error"]["code"] == "adapter_not_found"


def test_canceled_running_job_stops_and_others_finish(stack):
    url, api_keys, worker = stack
    tenant = DEMO_ADAPTERS[0].tenant
    headers = {"Authorization": f"Bearer {api_keys[tenant]}"}

    async def scenario() -> tuple[dict, dict]:
        async with aiohttp.ClientSession(headers=headers) as session:
            long_job = {"model": MODEL, "prompt": "tell a long story", "max_tokens": 1500, "ignore_eos": True}
            async with session.post(f"{url}/v1/jobs", json=long_job) as response:
                job_id = (await response.json())["id"]
            for _ in range(100):
                async with session.get(f"{url}/v1/jobs/{job_id}") as response:
                    if (await response.json())["status"] == "running":
                        break
                await asyncio.sleep(0.05)
            async with session.post(f"{url}/v1/jobs/{job_id}/cancel") as response:
                assert response.status in (200, 202), await response.text()
            short = await submit_and_wait(
                session, url, api_keys[tenant], {"model": MODEL, "prompt": "hi", "max_tokens": 4}
            )
            async with session.get(f"{url}/v1/jobs/{job_id}") as response:
                return await response.json(), short

    canceled, short = asyncio.run(scenario())
    assert canceled["status"] == "canceled"
    assert short["status"] == "succeeded"
    assert worker.poll() is None
