"""Building blocks of the gateway tests: a tiny tokenizer and model, PEFT adapter files, the registered fleet."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp.test_utils import TestClient
from redis.asyncio import Redis
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from shared import keys
from shared.adapter_registry import AdapterRecord, register_adapter
from shared.config import RequestLimits
from shared.jobstore import JobStore
from shared.model_info import ModelInfo
from shared.schema import FinishReason, JobMessage, JobOutput, JobStatus, Priority, TokenDelta, decode_job

WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]
BOS_ID = WORDS.index("<s>")
MAX_CONTEXT = 64  # tokens
LIMITS = RequestLimits(
    max_body_bytes=64 * 1024,
    max_prompt_chars=2000,
    max_output_tokens=32,
    max_stop_strings=4,
    max_stop_chars=16,
    max_wait_s=1.0,
)

ADMIN_KEY = "admin-secret-for-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def build_tokenizer() -> Tokenizer:
    """A word-level tokenizer over WORDS that prepends <s>, like Llama's."""
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    return tokenizer


def tiny_model(name: str) -> ModelInfo:
    return ModelInfo(
        name=name,
        architecture="LlamaForCausalLM",
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=4,
        vocab_size=len(WORDS),
        max_context=MAX_CONTEXT,
        rope_theta=10000.0,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=BOS_ID,
        eos_token_ids=(WORDS.index("</s>"),),
        torch_dtype="float32",
    )


def write_adapter(root: Path, directory: str, model: ModelInfo, *, seed: int = 0, rank: int = 2) -> str:
    """A PEFT LoRA directory for `model` targeting q_proj of layer 0; returns its path under `root`."""
    rng = np.random.default_rng(seed)
    in_features, out_features = model.projection_shape("q_proj")
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    adapter_dir = root / directory
    adapter_dir.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}
    (adapter_dir / "adapter_config.json").write_text(json.dumps(config))
    tensors = {
        f"{prefix}.lora_A.weight": rng.standard_normal((rank, in_features), dtype=np.float32),
        f"{prefix}.lora_B.weight": rng.standard_normal((out_features, rank), dtype=np.float32),
    }
    save_file(tensors, str(adapter_dir / "adapter_model.safetensors"))
    return directory


@dataclass
class Fleet:
    """What the fixture registered: API keys by tenant, the models, adapters by name."""

    redis: Redis
    adapter_root: Path
    api_keys: dict[str, str]
    models: dict[str, ModelInfo]
    adapters: dict[str, AdapterRecord]
    tokenizer: Tokenizer

    def auth(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_keys[tenant]}"}

    async def add_adapter(self, name: str, tenant: str, model: str, *, seed: int = 0) -> AdapterRecord:
        path = write_adapter(self.adapter_root, f"{tenant}/{name}-{seed}", self.models[model], seed=seed)
        record = await register_adapter(
            self.redis,
            name=name,
            tenant=tenant,
            model=self.models[model],
            adapter_root=self.adapter_root,
            path=path,
            max_rank=8,
            max_bytes=1 << 20,
        )
        self.adapters[name] = record
        return record


async def submit(client: TestClient, fleet: Fleet, tenant: str = "acme", **body: Any) -> dict[str, Any]:
    """POST a valid job (prompt "hello world" on tiny unless overridden); assert 202; return the body."""
    response = await client.post(
        "/v1/jobs", json={"model": "tiny", "prompt": "hello world", **body}, headers=fleet.auth(tenant)
    )
    assert response.status == 202, await response.text()
    return await response.json()


async def next_queued_job(
    redis: Redis, model: str = "tiny", timeout_s: float = 5.0, priority: Priority = Priority.INTERACTIVE
) -> JobMessage:
    """Wait for the next job on the model's queue of `priority` (as a worker would read it) and remove it."""
    stream = keys.queue(model, priority)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        entries = await redis.xrange(stream, count=1)
        if entries:
            entry_id, fields = entries[0]
            await redis.xdel(stream, entry_id)
            return decode_job(fields[b"job"])
        await asyncio.sleep(0.01)
    raise AssertionError(f"no job appeared on {stream}")


async def play_worker(
    redis: Redis, message: JobMessage, pieces: list[str], final_text: str, *, finish: FinishReason = FinishReason.STOP
) -> None:
    """Act as the worker for `message`: one token event per piece of text, then the final result."""
    store = JobStore(redis, 3600)
    await store.start(message.job_id, "fake-worker")
    offset = 0
    for token_id, piece in enumerate(pieces, start=3):
        await store.publish_tokens([TokenDelta(message.job_id, token_id, piece, offset)])
        offset += len(piece)
    output = JobOutput(final_text, tuple(range(3, 3 + len(pieces) + 1)), finish)
    await store.finish(message.job_id, JobStatus.SUCCEEDED, output=output, completion_tokens=len(pieces) + 1)
