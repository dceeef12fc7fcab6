"""A tiny Qwen3-MoE with a per-expert PEFT adapter served through the whole stack (gateway, Redis, CPU
worker as real processes): greedy outputs with and without the adapter equal transformers + PEFT's."""

from __future__ import annotations

import asyncio
import copy
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from peft import PeftModel
from tokenizers import Tokenizer

from shared.adapter_registry import register_adapter
from shared.model_info import ModelInfo
from shared.schema import JobStatus
from shared.tenants import create_tenant
from tests.engine.tiny_hf import oracle_greedy
from tests.engine.tiny_moe import MOE_ADAPTERS, save_expert_adapter, save_tiny_moe
from tests.fleet import MODEL, Fleet

pytestmark = pytest.mark.slow

TENANT = "moe-tenant"
ADAPTER = "moe-experts"
NEW_TOKENS = 6


@pytest.fixture
def moe_fleet(redis_url: str, demo_assets: tuple[Path, Path], tmp_path: Path) -> Iterator[tuple[Fleet, PeftModel]]:
    """Gateway and CPU worker serving a tiny Qwen3-MoE (the demo's tokenizer) with one tenant's adapter
    on attention and every expert; and the transformers+PEFT oracle of the same files."""
    demo_model, _ = demo_assets
    model_dir, adapter_root = tmp_path / "moe", tmp_path / "adapters"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model / name, model_dir / name)
    vocab_size = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
    base = save_tiny_moe("qwen3_moe", model_dir, seed=0, vocab_size=vocab_size)
    info = ModelInfo.from_pretrained(MODEL, model_dir)
    save_expert_adapter(info, adapter_root / TENANT / ADAPTER, seed=5, **MOE_ADAPTERS["experts_r8"])
    oracle = PeftModel.from_pretrained(copy.deepcopy(base), adapter_root / TENANT / ADAPTER, adapter_name=ADAPTER)

    async def provision() -> str:
        async with aioredis.Redis.from_url(redis_url) as client:
            key = await create_tenant(client, TENANT)
            await register_adapter(client, name=ADAPTER, tenant=TENANT, model=info, adapter_root=adapter_root,
                                   path=f"{TENANT}/{ADAPTER}", max_rank=64, max_bytes=1 << 30)  # fmt: skip
            return key

    with ExitStack() as stack:
        fleet = Fleet(redis_url, model_dir, adapter_root, tmp_path / "logs", stack)
        (tmp_path / "logs").mkdir()
        fleet.api_keys = {TENANT: asyncio.run(provision())}
        fleet.start_gateway()
        fleet.start_worker("w1")
        yield fleet, oracle.eval()


def test_moe_model_serves_adapter_and_base_jobs_like_hf(moe_fleet: tuple[Fleet, PeftModel]) -> None:
    fleet, oracle = moe_fleet
    prompts = [[5, 17, 99, 4, 250, 31, 8], [42, 7, 7, 300, 12]]
    jobs = [
        {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
        | ({"adapter": ADAPTER} if adapter else {})
        for prompt in prompts
        for adapter in (True, False)
    ]
    records = fleet.wait_finished(fleet.submit_as(TENANT, jobs), timeout_s=120)

    assert [r.status for r in records] == [JobStatus.SUCCEEDED] * len(jobs), records
    for job, record in zip(jobs, records, strict=True):
        expected = oracle_greedy(oracle, job["prompt"], job.get("adapter"), NEW_TOKENS)
        assert list(record.output.token_ids) == expected, job
    assert records[0].output.token_ids != records[1].output.token_ids  # the adapter changes the output
