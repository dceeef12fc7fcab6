"""Launch configurations of the MoE kernels, tuned per GPU model by bench/tune_moe.py.

kernels/configs/moe_<GPU name, spaces as underscores>.json holds, per kernel and GEMM shape
(N, K) and pair bucket, the best configuration measured:

    {"device": "NVIDIA H200", "date": "...", "commands": ["python -m bench.tune_moe ..."],
     "entries": [{"kernel": "gemm", "n": 1536, "k": 2048, "max_pairs": 64, "config": {...}}, ...]}

A launch over P (token, expert) pairs takes the entry of its kernel and shape with the smallest
max_pairs >= P (the largest if P exceeds them all); without a file, the defaults below. P never
enters a kernel as a constexpr, so no token count recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

KernelName = Literal["gemm", "shrink", "expand"]


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """The base grouped GEMM and the LoRA expand (BLOCK_K unused by the expand: K is the rank;
    n_tiles unused by the GEMM)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8  # L2 swizzle: this many row blocks walk the N tiles together
    num_warps: int = 4
    num_stages: int = 3
    n_tiles: int = 1  # the expand's column tiles per program (lora_expand.py)


@dataclass(frozen=True, slots=True)
class ShrinkConfig:
    block_m: int = 16
    block_k: int = 128
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 2


def default_config(kernel: KernelName, num_pairs: int) -> GemmConfig | ShrinkConfig:
    """Untuned fallback: small tiles for decode-sized pair counts (most blocks are mostly padding),
    larger ones for prefill."""
    large = num_pairs > 1024
    if kernel == "shrink":
        return ShrinkConfig(block_m=64 if large else 16, split_k=1 if large else 4)
    if kernel == "expand":
        return GemmConfig(block_m=64 if large else 16, block_n=128, num_stages=2)
    return GemmConfig(block_m=64 if large else 16, block_n=128 if large else 64, num_warps=8 if large else 4)


@dataclass(frozen=True, slots=True)
class MoEPlan:
    """Every launch configuration of one MoE layer call. The LoRA kernels share one block_m: they
    tile the same (adapter, expert) pair blocks."""

    gemm_up: GemmConfig
    gemm_down: GemmConfig
    shrink_up: ShrinkConfig
    expand_up: GemmConfig
    shrink_down: ShrinkConfig
    expand_down: GemmConfig

    def __post_init__(self) -> None:
        lora = (self.shrink_up, self.expand_up, self.shrink_down, self.expand_down)
        if len({config.block_m for config in lora}) != 1:
            raise ValueError("the MoE-LoRA shrink and expand configurations must share block_m")

    @property
    def lora_block_m(self) -> int:
        return self.shrink_up.block_m


def config_file(device_name: str) -> Path:
    return CONFIG_DIR / f"moe_{device_name.replace(' ', '_')}.json"


@functools.cache
def _tuned(device_name: str) -> dict[tuple[str, int, int], list[tuple[int, GemmConfig | ShrinkConfig]]]:
    path = config_file(device_name)
    if not path.exists():
        return {}
    table: dict[tuple[str, int, int], list[tuple[int, GemmConfig | ShrinkConfig]]] = {}
    for entry in json.loads(path.read_text())["entries"]:
        kind = ShrinkConfig if entry["kernel"] == "shrink" else GemmConfig
        key = (entry["kernel"], entry["n"], entry["k"])
        table.setdefault(key, []).append((entry["max_pairs"], kind(**entry["config"])))
    for bucket in table.values():
        bucket.sort(key=lambda item: item[0])
    return table


@functools.lru_cache(maxsize=4096)
def config_for(device_name: str, kernel: KernelName, n: int, k: int, num_pairs: int) -> GemmConfig | ShrinkConfig:
    """The tuned configuration for this GPU, kernel, shape and pair count, else the default."""
    bucket = _tuned(device_name).get((kernel, n, k))
    if not bucket:
        return default_config(kernel, num_pairs)
    return next((config for max_pairs, config in bucket if max_pairs >= num_pairs), bucket[-1][1])


@functools.lru_cache(maxsize=4096)
def plan_for(device_name: str, hidden: int, width: int, rank_up: int, rank_down: int, num_pairs: int) -> MoEPlan:
    """The layer's plan: gate_up [2·width, hidden] and down [hidden, width] GEMMs, LoRA ranks
    rank_up (gate_up) and rank_down. A tuned file's LoRA entries share block_m per bucket; if a
    shape is missing from it, the LoRA kernels all take their defaults."""

    def get(kernel: KernelName, n: int, k: int) -> Any:
        return config_for(device_name, kernel, n, k, num_pairs)

    lora = (get("shrink", rank_up, hidden), get("expand", 2 * width, rank_up),
            get("shrink", rank_down, width), get("expand", hidden, rank_down))  # fmt: skip
    if len({config.block_m for config in lora}) != 1:
        lora = (default_config("shrink", num_pairs), default_config("expand", num_pairs)) * 2
    return MoEPlan(get("gemm", 2 * width, hidden), get("gemm", hidden, width), *lora)


def entry(kernel: KernelName, n: int, k: int, max_pairs: int, config: GemmConfig | ShrinkConfig) -> dict[str, Any]:
    """One JSON entry, as the tuner writes it."""
    return {"kernel": kernel, "n": n, "k": k, "max_pairs": max_pairs, "config": dataclasses.asdict(config)}
