"""Launch plans of the W8A16 GEMM (w8a16.py), tuned per GPU model.

A plan file, w8a16_<GPU name, spaces as underscores>.json, holds one plan per weight shape (N, K) and
token bucket:

    {"device": "NVIDIA H100 80GB HBM3", "date": "...", "commands": ["python -m bench.tune_w8a16 ..."],
     "plans": [{"n": 6144, "k": 4096, "max_tokens": 8, "block_m": 16, "block_n": 64, "block_k": 128,
                "split_k": 4, "num_warps": 4, "num_stages": 4, "swap": false}, ...]}

Written by the tuner (w8a16_tuning.py, run by bench/tune_w8a16.py). Looked up as the LoRA plans are
(kernels/lora/configs.py): in the process's plan cache directory (kernels/plan_files.py, set by
configs.set_plan_cache_dir) first, then in the packaged kernels/configs/; a cached plan wins for its
shape and bucket. A GEMM of T tokens takes the plan of its shape with the smallest max_tokens >= T
(the largest if T exceeds them all); a shape or GPU without one, `default_plan`. T never enters the
kernel as a constexpr, so no token count recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import triton

from kernels.plan_files import PACKAGED_DIR, cache_dir, read_entries
from kernels.quant.reference import W8A16_MAX_TOKENS


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True, slots=True)
class W8A16Plan:
    """A launch of the W8A16 kernel: tile sizes, the K split, the compiler's warps and stages, and the
    operand order (swap: acc [BLOCK_N, BLOCK_M] = w · xᵀ, the weight's rows on the MMA's M side)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    swap: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):  # tl.dot's minimum, tl.arange's powers of two
            if getattr(self, name) < 16 or not _power_of_two(getattr(self, name)):
                raise ValueError(f"W8A16 plan: {name} {getattr(self, name)} must be a power of two >= 16")
        if not _power_of_two(self.num_warps) or self.num_warps > 16:
            raise ValueError(f"W8A16 plan: num_warps {self.num_warps} must be 1, 2, 4, 8 or 16")
        if self.split_k < 1 or self.num_stages < 1:
            raise ValueError(f"W8A16 plan: split_k {self.split_k} and num_stages {self.num_stages} must be >= 1")

    def describe(self) -> str:
        """`m16 n64 k128 split4 w4 s4` (and ` swap`): one plan on one line of a table."""
        swap = " swap" if self.swap else ""
        return (f"m{self.block_m} n{self.block_n} k{self.block_k} split{self.split_k} "
                f"w{self.num_warps} s{self.num_stages}{swap}")  # fmt: skip


def default_plan(num_tokens: int, n: int, k: int, num_sms: int) -> W8A16Plan:
    """Untuned fallback for x [num_tokens, k] against a weight [n, k] on a GPU of `num_sms` SMs (the
    sizes measured best at Llama-8B's shapes on an H200: docs/benchmarks.md, "Quantized bases").

    BLOCK_M: tl.dot's minimum 16, up to W8A16_MAX_TOKENS. BLOCK_N 64: the MMA's M side once the
    operands swap past 16 tokens. Up to 16 tokens the kernel only streams weights: BLOCK_K 128 (an
    8 KiB fp8 tile), four stages deep (the loads in flight per SM that saturate HBM: bandwidth ×
    latency / SMs ≈ 4.8 TB/s × ~0.8 µs / 132 ≈ 30 KiB), K split up to 4 ways for at least three
    programs per SM. Past 16 the MMAs and the x tiles take their share: BLOCK_K 256, three stages,
    about one program per SM (a K split beyond that only adds partial sums)."""
    block_m = min(max(16, triton.next_power_of_2(num_tokens)), W8A16_MAX_TOKENS)
    block_n = 64
    block_k, stages, programs_per_sm = (128, 4, 3) if block_m == 16 else (256, 3, 1)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(num_tokens, block_m)
    split_k = max(1, min(triton.cdiv(programs_per_sm * num_sms, tiles) if block_m == 16 else num_sms // tiles, 4))
    split_k = min(split_k, max(1, k // (2 * block_k)))
    return W8A16Plan(block_m, block_n, block_k, split_k, num_warps=4, num_stages=stages, swap=block_m > 16)


# (N, K) of the weight, and the bucket's max_tokens
PlanKey = tuple[int, int, int]


def config_file(device_name: str, directory: Path | None = None) -> Path:
    """The W8A16 plan file of a GPU model in `directory` (None: the packaged one)."""
    return (directory or PACKAGED_DIR) / f"w8a16_{device_name.replace(' ', '_')}.json"


def plan_entry(key: PlanKey, plan: W8A16Plan) -> dict[str, Any]:
    """One plan as a plan file lists it."""
    n, k, max_tokens = key
    return {"n": n, "k": k, "max_tokens": max_tokens} | dataclasses.asdict(plan)


def read_plans(path: Path) -> dict[PlanKey, W8A16Plan]:
    """A W8A16 plan file's plans by (N, K, max_tokens); none for a file that does not exist. A file
    that is not one raises ValueError naming it (and, for a bad plan, the field)."""
    entries = read_entries(path, "W8A16")
    try:
        plans = {}
        for entry in entries:
            fields = {name: entry[name] for name in entry if name not in ("n", "k", "max_tokens")}
            plans[entry["n"], entry["k"], entry["max_tokens"]] = W8A16Plan(**fields)
        return plans
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} is not a W8A16 plan file: {type(exc).__name__}: {exc}") from exc


def plan_files(device_name: str, cache: Path | None) -> list[Path]:
    """The plan files a lookup reads for this GPU model with this plan cache directory, the one that
    wins last."""
    packaged = config_file(device_name)
    return [packaged] if cache is None else [packaged, config_file(device_name, cache)]


def reload_plans() -> None:
    """Forget every lookup, so that the next reads the plan files again (one was just written)."""
    _tuned_plans.cache_clear()
    _plan_for.cache_clear()


@functools.cache
def _tuned_plans(device_name: str, cache: Path | None) -> dict[tuple[int, int], list[tuple[int, W8A16Plan]]]:
    merged: dict[PlanKey, W8A16Plan] = {}
    for path in plan_files(device_name, cache):
        merged |= read_plans(path)
    plans: dict[tuple[int, int], list[tuple[int, W8A16Plan]]] = {}
    for (n, k, max_tokens), plan in sorted(merged.items()):
        plans.setdefault((n, k), []).append((max_tokens, plan))
    return plans


def tuned_plan(device_name: str, num_tokens: int, n: int, k: int) -> W8A16Plan | None:
    """The tuned plan for this GPU, weight shape and token count; None where no table has the shape."""
    bucket = _tuned_plans(device_name, cache_dir()).get((n, k))
    if not bucket:
        return None
    return next((plan for max_tokens, plan in bucket if max_tokens >= num_tokens), bucket[-1][1])


def plan_for(device_name: str, num_tokens: int, n: int, k: int, num_sms: int) -> W8A16Plan:
    """The tuned plan for this GPU, weight shape and token count, else `default_plan`."""
    return _plan_for(device_name, cache_dir(), num_tokens, n, k, num_sms)


@functools.lru_cache(maxsize=16384)
def _plan_for(device_name: str, cache: Path | None, num_tokens: int, n: int, k: int, num_sms: int) -> W8A16Plan:
    # keyed by the cache directory too: a process that sets it after a lookup reads the new tables
    return tuned_plan(device_name, num_tokens, n, k) or default_plan(num_tokens, n, k, num_sms)
