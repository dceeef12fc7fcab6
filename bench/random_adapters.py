"""The benchmarks' adapters: random PEFT LoRA files written once per shape and seed, and brought onto
an engine's device through its adapter pool before anything is timed."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.adapter_digest import file_digest
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.model_info import PROJECTIONS, ModelInfo
from shared.schema import AdapterRef, SamplingParams
from worker.adapter_pool.peft_adapter import peft_key
from worker.engine.engine import LLMEngine
from worker.engine.engine_request import EngineRequest


def write_adapter(directory: Path, info: ModelInfo, rank: int, seed: int) -> AdapterRef:
    """A PEFT adapter of `rank` on every projection, random bf16 A (std fan_in^-0.5) and B (std 0.01),
    scale 2 (alpha = 2 * rank), in `directory` (kept if it is already there: the same seed writes the
    same file); returns its registry reference, its path relative to `directory`'s parent."""
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(seed)
        tensors = {}
        for layer in range(info.num_layers):
            for projection in PROJECTIONS:
                fan_in, fan_out = info.projection_shape(projection)
                a = torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5
                tensors[peft_key(layer, projection, "A")] = a.to(torch.bfloat16)
                tensors[peft_key(layer, projection, "B")] = (torch.randn(fan_out, rank, generator=gen) * 0.01).to(
                    torch.bfloat16
                )
        save_file(tensors, str(weights))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)}
        (directory / CONFIG_FILE).write_text(json.dumps(config))
    return AdapterRef(directory.name, 1, directory.name, file_digest(weights))


def adapter_name(info: ModelInfo, rank: int, seed: int) -> str:
    """The directory of a benchmark adapter in the adapter root, named by everything its file depends
    on: write_adapter keeps a file already there, and runs of several shapes (bench/tensor_parallel.py's
    8B and 70B) or an --adapter-dir shared between runs must not serve one shape another's (issue #26)."""
    return f"bench-{info.name}-r{rank}-{seed}"


def adapter_dir(path: str | None) -> Path:
    """Where adapter files go: `path` (made if missing), else a new temporary directory."""
    if path is None:
        return Path(tempfile.mkdtemp(prefix="bench-adapters-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None))
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


def load_adapters(engine: LLMEngine, refs: list[AdapterRef]) -> None:
    """Bring every adapter of `refs` onto the device through the engine's adapter pool, as a worker does
    for the requests naming them: one one-token request each, run to completion."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for index, ref in enumerate(refs):
        engine.add(EngineRequest(job_id=f"load-{index}", prompt_token_ids=(1, 2, 3), sampling=params, adapter=ref))
    results = []
    while engine.num_unfinished:
        results += engine.step()
    failed = [r for r in results if r.error is not None]
    assert not failed, f"adapters did not load: {failed[0].error}"
    resident = set(engine.adapter_slots.resident)
    assert all(ref.uid in resident for ref in refs), "an adapter was evicted: the pool is smaller than the set"
