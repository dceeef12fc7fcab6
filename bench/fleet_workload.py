"""What the fleet bench asks of a fleet: the demo model, its registered adapters, the jobs' adapter names
(Zipf over one popularity order per fleet) and their submission to the gateway, at once or open loop.

Nothing here knows about processes or measurements: bench/fleet_processes.py starts the fleet that
serves this workload, bench/fleet_phases.py measures it.
"""

from __future__ import annotations

import asyncio
import random
import shutil
from pathlib import Path

import aiohttp

from cli.demo_adapters import DemoAdapter, write_demo_adapter
from cli.demo_model import write_demo_model
from shared.adapter_registry import register_adapter
from shared.model_info import ModelInfo
from shared.redis_client import plain_redis
from shared.tenants import create_tenant

MODEL = "tiny"
ADAPTER_RANK = 4
TENANT = "bench"
SUBMIT_TIMEOUT_S = 60.0


def write_assets(root: Path, count: int) -> tuple[Path, Path]:
    """The demo model and `count` adapters (one small adapter's files, copied: each has its own name)."""
    model_dir, adapter_root = root / "model", root / "adapters"
    model_dir.mkdir()
    write_demo_model(model_dir)
    info = ModelInfo.from_pretrained(MODEL, model_dir)
    first = adapter_root / TENANT / "a0000"
    first.mkdir(parents=True)
    adapter = DemoAdapter(TENANT, "a0000", ADAPTER_RANK, 2 * ADAPTER_RANK, ("q_proj", "v_proj"), seed=1)
    write_demo_adapter(first, adapter, info, model_dir)
    for index in range(1, count):
        shutil.copytree(first, adapter_root / TENANT / f"a{index:04d}")
    return model_dir, adapter_root


async def provision(redis_url: str, model_dir: Path, adapter_root: Path, count: int) -> str:
    info = ModelInfo.from_pretrained(MODEL, model_dir)
    async with plain_redis(redis_url) as client:
        api_key = await create_tenant(client, TENANT)
        for index in range(count):
            name = f"a{index:04d}"
            await register_adapter(
                client, name=name, tenant=TENANT, model=info, adapter_root=adapter_root,
                path=f"{TENANT}/{name}", max_rank=64, max_bytes=1 << 30,
            )  # fmt: skip
    return api_key


def popularity(adapters: int, rng: random.Random) -> list[str]:
    """The adapters' names, most popular first: drawn once per fleet, so its warm-up, burst and arrivals
    share one head (the popular adapters are not the first registered)."""
    order = [f"a{index:04d}" for index in range(adapters)]
    rng.shuffle(order)
    return order


def zipf_names(count: int, ranked: list[str], exponent: float, rng: random.Random) -> list[str]:
    """`count` adapter names drawn by Zipf(`exponent`) over `ranked` (most popular first)."""
    weights = [1 / (rank**exponent) for rank in range(1, len(ranked) + 1)]
    return rng.choices(ranked, weights=weights, k=count)


async def submit(url: str, api_key: str, names: list[str], gaps_s: list[float] | None) -> list[str]:
    """POST one job per adapter name, all at once or after each gap (open loop); returns their ids."""
    headers = {"Authorization": f"Bearer {api_key}"}
    connector = aiohttp.TCPConnector(limit=64)
    # a gateway that stops answering fails the bench in a minute (aiohttp's default waits 5 per request)
    timeout = aiohttp.ClientTimeout(total=SUBMIT_TIMEOUT_S)
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout) as session:

        async def post(name: str) -> str:
            job = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True,
                   "temperature": 0.0, "adapter": name}  # fmt: skip
            async with session.post(f"{url}/v1/jobs", json=job) as response:
                body = await response.json()
                if response.status != 202:
                    raise RuntimeError(f"submit: {response.status} {body}")
                return body["id"]

        if gaps_s is None:
            return list(await asyncio.gather(*(post(name) for name in names)))
        tasks = []
        for name, gap in zip(names, gaps_s, strict=True):
            tasks.append(asyncio.create_task(post(name)))
            await asyncio.sleep(gap)
        return list(await asyncio.gather(*tasks))
