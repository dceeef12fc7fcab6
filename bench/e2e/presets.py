"""The sizes one benchmark run uses: the model's shape, the adapters, the traffic, the worker's engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cli.demo_model import DemoModelShape
from shared.config import EngineConfig


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    shape: DemoModelShape  # hidden size, layers, heads, context (vocab is separate: no BPE training here)
    vocab_size: int
    dtype: str  # of the checkpoint and the adapters
    rope_theta: float
    num_adapters: int
    lora_rank: int
    num_tenants: int  # adapter k belongs to tenant k % num_tenants
    zipf_alpha: float
    saturation_target: float  # Zipf saturation over base-only (issue #20: 0.85 at 100 adapters, 0.80 at 1,000)
    prompt_tokens: int  # every request's prompt, BOS included
    output_tokens: int  # every request's completion (ignore_eos)
    engine: EngineConfig  # the worker's engine, and the engine-alone replay's
    gateways: int  # gateway processes; the client spreads requests over them round-robin
    warmup_requests: int
    calibration_s: float  # each calibration run (closed loop, one per mode)
    run_s: float  # arrivals of each load run
    drain_s: float  # longest wait for a run's last requests after its arrivals end


PRESETS = {
    "llama3-8b": Preset(
        name="llama3-8b",
        shape=DemoModelShape(
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            max_position_embeddings=8192,
        ),
        vocab_size=128256,
        dtype="bfloat16",
        rope_theta=500000.0,
        num_adapters=100,
        lora_rank=16,
        num_tenants=4,
        zipf_alpha=1.0,
        saturation_target=0.85,
        prompt_tokens=256,
        output_tokens=128,
        # A full batch of 128 Zipf(1.0) draws over 100 adapters holds ~48 distinct ones on average: 64
        # slots of rank 16 (84 MB each, 5.4 GB) let it run full, and the tail still goes through loads
        engine=EngineConfig(device="cuda", max_num_seqs=128, max_loras=64, max_lora_rank=16),
        gateways=4,
        warmup_requests=128,
        # the saturation is read over the second half: 10 s, ~4 request lifetimes (8 s gave one code
        # 0.80x and 0.89x in two runs: docs/benchmarks.md, 2026-11-26 17:37)
        calibration_s=20.0,
        run_s=15.0,
        drain_s=15.0,
    ),
    # a few seconds on a CPU: keeps the code path exercised by the test suite
    "tiny": Preset(
        name="tiny",
        shape=DemoModelShape(
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            max_position_embeddings=256,
        ),
        vocab_size=512,
        dtype="float32",
        rope_theta=10000.0,
        num_adapters=6,
        lora_rank=4,
        num_tenants=2,
        zipf_alpha=1.0,
        saturation_target=0.85,
        prompt_tokens=12,
        output_tokens=6,
        engine=EngineConfig(device="cpu", max_num_seqs=8, max_loras=3, max_lora_rank=8, num_kv_blocks=256),
        gateways=1,
        warmup_requests=4,
        calibration_s=1.5,
        run_s=1.5,
        drain_s=15.0,
    ),
}
# 1,000 adapters, the second scale: ~77 distinct ones in a full batch of Zipf(1.0) draws, so
# 64 GPU slots cannot hold one batch's (H100, 2026-11-26: 39% GPU hits, 75 sequences a step, 0.49x).
# 192 slots (16 GB; the KV cache keeps ~33 GB, far more than 128 sequences of 384 tokens need) hold
# the ~78% of requests that go to the 192 most popular, and the host tier twice that.
# Their files take 84 GB beside the 16 GB model: a machine with that much room in its --workdir.
PRESETS["llama3-8b-1000"] = dataclasses.replace(
    PRESETS["llama3-8b"],
    name="llama3-8b-1000",
    num_adapters=1000,
    saturation_target=0.80,
    engine=dataclasses.replace(PRESETS["llama3-8b"].engine, max_loras=192),
)
