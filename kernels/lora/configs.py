"""Launch configurations and the path each batch shape takes, tuned per GPU model.

A plan file, <GPU name, spaces as underscores>.json, holds one plan per projection shape (K, slice
widths, padded rank) and token bucket:

    {"device": "NVIDIA H100 80GB HBM3", "date": "...", "commands": ["python -m bench.tune_lora ..."],
     "plans": [{"k": 4096, "widths": [4096, 1024, 1024], "rank_pad": 16, "max_tokens": 32,
                "path": "fused", "fused": {"block_m": 16, "block_n": 64, ...}}, ...]}

Plans are looked up in two places, in this order: the process's plan cache directory
(`set_plan_cache_dir`; the worker sets it from --kernel-plans-dir and tunes what its models lack
into it at start, worker/kernel_plans.py) and the packaged kernels/configs/ (tuned tables committed
with the code, written by bench/tune_lora.py or `lorafleet tune --packaged`). A plan in the cache
wins over the packaged one of the same shape and bucket; the buckets of both serve. A batch of T
tokens takes the plan of its shape with the smallest max_tokens >= T (the largest if T exceeds them
all). Shapes or GPUs without a plan use `default_plan`. The bucket never enters a kernel:
configurations are constexprs, T is a runtime argument, so no token count recompiles.

Paths (see paths.py): "fused" (fused.py, then the base GEMM accumulates into its output),
"split" (shrink.py + expand, likewise), "overlap" (shrink.py on a second stream beside the base
GEMM, then expand adds into its output). "split" and "overlap" expand through expand_gather.py when
the plan has a `gather` configuration, else expand.py; where the caller takes the delta (the
decoder) beside a quantized base's short decode GEMM (paths._single_launch_beside), "overlap" runs
shrink and expand as one launch instead (single_launch.py, its `single` configuration).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kernels.plan_files import PACKAGED_DIR, cache_dir, read_entries, set_cache_dir

PathName = Literal["fused", "split", "overlap"]
PATHS: tuple[PathName, ...] = ("fused", "split", "overlap")


@dataclass(frozen=True, slots=True)
class ShrinkConfig:
    block_m: int = 16
    block_k: int = 256
    split_k: int = 8
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True, slots=True)
class ExpandConfig:
    block_m: int = 64
    block_n: int = 128
    n_chunk: int = 128  # columns one program walks, a multiple of block_n
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.n_chunk % self.block_n:
            raise ValueError(f"n_chunk {self.n_chunk} must be a multiple of block_n {self.block_n}")


@dataclass(frozen=True, slots=True)
class GatherConfig:
    block_t: int = 32
    block_n: int = 32
    r_chunk: int = 16
    num_warps: int = 8
    num_stages: int = 1


@dataclass(frozen=True, slots=True)
class FusedConfig:
    block_m: int = 16
    block_n: int = 128
    block_k: int = 256
    n_chunk: int = 512
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.n_chunk % self.block_n:
            raise ValueError(f"n_chunk {self.n_chunk} must be a multiple of block_n {self.block_n}")


@dataclass(frozen=True, slots=True)
class SingleLaunchConfig:
    block_k: int = 64  # inputs per shrink chunk
    block_n: int = 64  # outputs per expand tile
    # shrink programs at most, and as many expand programs at most: one of each per H100 SM measured
    # best at 2-8 tokens (docs/benchmarks.md, "single launch")
    max_programs: int = 132
    num_warps: int = 4


@dataclass(frozen=True, slots=True)
class Plan:
    path: PathName
    fused: FusedConfig = FusedConfig()
    shrink: ShrinkConfig = ShrinkConfig()
    expand: ExpandConfig = ExpandConfig()
    gather: GatherConfig | None = None  # expand through expand_gather.py instead of expand.py
    # the overlap path's side work for a caller that takes the delta, beside a quantized base's short
    # decode GEMM (paths.py);
    # None in plans tuned before the single launch existed: its default configuration
    single: SingleLaunchConfig | None = None

    def to_json(self) -> dict[str, Any]:
        """Every path's configurations, so that a tuned file also serves forced paths (bench, tests)."""
        names = ("fused", "shrink", "expand", "gather", "single")
        configs = {name: dataclasses.asdict(getattr(self, name)) for name in names if getattr(self, name)}
        return {"path": self.path} | configs

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> Plan:
        if entry["path"] not in PATHS:
            raise ValueError(f"unknown LoRA path {entry['path']!r} (expected one of {PATHS})")
        kinds = {
            "fused": FusedConfig,
            "shrink": ShrinkConfig,
            "expand": ExpandConfig,
            "gather": GatherConfig,
            "single": SingleLaunchConfig,
        }
        return cls(path=entry["path"], **{k: kind(**entry[k]) for k, kind in kinds.items() if k in entry})


GATHER_MAX_TOKENS = 128  # default: above this the per-token B gathers cost more than grouped tiles
OVERLAP_MAX_TOKENS = 1024  # default: above this the base GEMM's C-input epilogue beats a pass over y


def default_plan(num_tokens: int, rank_pad: int) -> Plan:
    """Untuned fallback, from the H200 measurements in docs/benchmarks.md: the shrink beside the
    base GEMM and an expand into its output up to prefill sizes (gathering for small batches), the
    write-then-accumulate split above."""
    block_m = 16 if num_tokens <= 256 else 64
    # spread the K reduction until the grid covers the GPU several times over
    split_k = max(1, min(8, 1024 // max(1, num_tokens // block_m)))
    return Plan(
        path="overlap" if num_tokens <= OVERLAP_MAX_TOKENS else "split",
        shrink=ShrinkConfig(block_m=block_m, block_k=64 if rank_pad >= 64 else 128, split_k=split_k),
        expand=ExpandConfig(block_m=64, block_n=128 if rank_pad <= 64 else 64),
        gather=GatherConfig() if num_tokens <= GATHER_MAX_TOKENS else None,
    )


# (K, slice widths, padded max rank): what a plan is tuned for, besides its token bucket
PlanKey = tuple[int, tuple[int, ...], int]


def config_file(device_name: str, directory: Path | None = None) -> Path:
    """The plan file of a GPU model in `directory` (None: the packaged one)."""
    return (directory or PACKAGED_DIR) / f"{device_name.replace(' ', '_')}.json"


def plan_entry(key: PlanKey, max_tokens: int, plan: Plan) -> dict[str, Any]:
    """One plan as a plan file lists it."""
    k, widths, rank_pad = key
    return {"k": k, "widths": list(widths), "rank_pad": rank_pad, "max_tokens": max_tokens} | plan.to_json()


def read_plans(path: Path) -> dict[tuple[PlanKey, int], Plan]:
    """A plan file's plans by (shape, max_tokens); none for a file that does not exist. A file that
    is not a plan file raises ValueError naming it."""
    entries = read_entries(path, "LoRA")
    try:
        return {
            ((entry["k"], tuple(entry["widths"]), entry["rank_pad"]), entry["max_tokens"]): Plan.from_json(entry)
            for entry in entries
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} is not a LoRA plan file: {type(exc).__name__}: {exc}") from exc


def set_plan_cache_dir(directory: Path | None) -> None:
    """Where this process finds the plans tuned at run time, searched before the packaged ones
    (None: the packaged ones only). Set once by the worker from its configuration; lookups made
    before are forgotten."""
    set_cache_dir(directory)
    reload_plans()


def plan_cache_dir() -> Path | None:
    return cache_dir()


def reload_plans() -> None:
    """Forget every lookup, so that the next reads the plan files again (one was just written)."""
    _tuned_plans.cache_clear()
    plan_for.cache_clear()


def plan_files(device_name: str) -> list[Path]:
    """The plan files a lookup reads for this GPU model, the one that wins last."""
    packaged = config_file(device_name)
    cache = cache_dir()
    return [packaged] if cache is None else [packaged, config_file(device_name, cache)]


@functools.cache
def _tuned_plans(device_name: str) -> dict[PlanKey, list[tuple[int, Plan]]]:
    merged: dict[tuple[PlanKey, int], Plan] = {}
    for path in plan_files(device_name):
        merged |= read_plans(path)
    plans: dict[PlanKey, list[tuple[int, Plan]]] = {}
    for (key, max_tokens), plan in sorted(merged.items(), key=lambda item: item[0][1]):
        plans.setdefault(key, []).append((max_tokens, plan))
    return plans


@functools.lru_cache(maxsize=16384)
def plan_for(device_name: str, k: int, widths: tuple[int, ...], rank_pad: int, num_tokens: int) -> Plan:
    """The tuned plan for this GPU, projection shape and token count, else `default_plan`."""
    bucket = _tuned_plans(device_name).get((k, widths, rank_pad))
    if not bucket:
        return default_plan(num_tokens, rank_pad)
    return next((plan for max_tokens, plan in bucket if max_tokens >= num_tokens), bucket[-1][1])
