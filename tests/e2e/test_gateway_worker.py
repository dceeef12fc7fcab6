"""Gateway and worker as real processes over a real Redis: jobs of several tenants and adapters go
through HTTP → Redis stream → worker engine → Redis → HTTP, and their outputs equal the engine's
run in-process on the same model and adapters."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import redis
import redis.asyncio as aioredis
from tokenizers import Tokenizer

from cli.demo_adapters import DEMO_ADAPTERS, write_demo_adapter
from cli.demo_model import write_demo_model
from cli.redis_server import free_port
from shared import keys
from shared.adapter_registry import get_adapter, register_adapter
from shared.config import EngineConfig, ModelSpec
from shared.model_info import ModelInfo
from shared.schema import AdapterRef, SamplingParams
from shared.tenants import create_tenant
from tests.e2e.processes import lorafleet_process, wait_until
from worker.engine.engine import EngineRequest, LLMEngine

pytestmark = pytest.mark.slow

MODEL = "demo"
PROMPTS = ["Once upon a time", "The quick brown fox", "In the beginning"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The demo model and its three tenants' adapters, written as `lorafleet up` writes them."""
    root = tmp_path_factory.mktemp("assets")
    model_dir, adapter_root = root / "model", root / "adapters"
    model_dir.mkdir()
    write_demo_model(model_dir)
    info = ModelInfo.from_pretrained(MODEL, model_dir)
    for adapter in DEMO_ADAPTERS:
        (adapter_root / adapter.path).mkdir(parents=True)
        write_demo_adapter(adapter_root / adapter.path, adapter, info, model_dir)
    return model_dir, adapter_root


@pytest.fixture
def stack(assets, redis_url: str, tmp_path: Path):
    """Tenants and adapters registered, then a gateway and a CPU worker running. Yields (url, keys)."""
    model_dir, adapter_root = assets
    info = ModelInfo.from_pretrained(MODEL, model_dir)

    async def provision() -> dict[str, str]:
        client = aioredis.Redis.from_url(redis_url)
        api_keys = {}
        for adapter in DEMO_ADAPTERS:
            api_keys[adapter.tenant] = await create_tenant(client, adapter.tenant)
            await register_adapter(
                client,
                name=adapter.name,
                tenant=adapter.tenant,
                model=info,
                adapter_root=adapter_root,
                path=adapter.path,
                max_rank=64,
                max_bytes=1 << 30,
            )
        await client.aclose()
        return api_keys

    api_keys = asyncio.run(provision())
    port = free_port()
    gateway_log, worker_log = tmp_path / "gateway.log", tmp_path / "worker.log"
    gateway_args = ["gateway", "--redis-url", redis_url, "--port", str(port)]
    worker_args = ["worker", "--redis-url", redis_url, "--model", f"{MODEL}={model_dir}"]
    worker_args += ["--adapter-root", str(adapter_root), "--device", "cpu", "--max-loras", "2"]
    with lorafleet_process(gateway_args, gateway_log), lorafleet_process(worker_args, worker_log) as worker:
        sync = redis.Redis.from_url(redis_url)

        def ready() -> bool:
            if worker.poll() is not None:
                raise AssertionError(f"worker exited:\n{worker_log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as response:
                    gateway_ok = response.status == 200
            except OSError:
                return False
            return gateway_ok and sync.exists(keys.model(MODEL)) and sync.scard(keys.WORKERS) > 0

        wait_until(ready, timeout_s=90, what="gateway and worker", logs=[gateway_log, worker_log])
        yield f"http://127.0.0.1:{port}", api_keys, worker
        sync.close()


def engine_outputs(model_dir: Path, adapter_root: Path, jobs: list[dict], redis_url: str) -> list[tuple[int, ...]]:
    """The same jobs run by an in-process engine (greedy), for comparison."""
    engine = LLMEngine.from_spec(ModelSpec(MODEL, model_dir), EngineConfig(device="cpu"), adapter_root)
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


def test_jobs_of_several_tenants_and_adapters_match_the_engine(stack, assets, redis_url):
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
    expected = engine_outputs(*assets, [job for _, job in jobs], redis_url)
    for body, tokens in zip(finished, expected, strict=True):
        assert tuple(body["output"]["token_ids"]) == tokens
        assert body["usage"]["completion_tokens"] == len(tokens)
        assert body["timings"]["total_ms"] >= body["timings"]["ttft_ms"] >= 0
    # adapters change the output: the same prompt differs with and without the tenant's adapter
    for index in range(0, len(finished), 2):
        assert finished[index]["output"]["token_ids"] != finished[index + 1]["output"]["token_ids"]


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
