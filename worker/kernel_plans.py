"""The LoRA launch plans of the models a worker serves, and the W8A16 plans of those it serves in
fp8, tuned on its GPU where no table has them.

A GPU without a tuned table runs every LoRA projection on `default_plan`, which costs several times
what tuned plans cost over the base layer (docs/benchmarks.md, "H100: the first tuned table"). So
before a model's engine is built, `ensure_tuned` tunes the (projection shape, token bucket) plans
that neither the packaged table (kernels/configs/) nor the worker's plan cache holds for this GPU:

- the plan cache is a directory of plan files like the packaged ones (--kernel-plans-dir, by
  default STATE_DIR/kernel-plans), searched first by every lookup of the process
  (kernels.lora.configs.set_plan_cache_dir);
- within a time budget (--kernel-tune-budget-s; 0 tunes nothing), buckets in ascending order:
  decode sizes first, which every step of a busy server has, prefill sizes last;
- the cache file is rewritten after every bucket, so a tune cut short by the budget or a restart
  resumes at the next start where it stopped;
- a bucket the budget did not reach takes, for now, the plan of the nearest tuned bucket of its
  shape (configs.plan_for: the smallest bucket above, else the largest), or `default_plan` where
  the shape has none.

`lorafleet tune` runs the same tuner by hand (cli/tune.py).

A model served in fp8 runs its dense projections at decode sizes on the W8A16 GEMM, whose default
plan reads 0.4-0.8 of its byte roofline on an H100 (docs/benchmarks.md, "the same code on an H100").
`ensure_w8a16_tuned` tunes the (weight shape, token bucket) cells neither W8A16 table holds
(kernels/quant/w8a16_plans.py; w8a16_<GPU>.json in the same two directories), smallest bucket first,
within its own --kernel-tune-budget-s, after the LoRA plans. Both take the shapes the process runs
(under tensor parallelism, the worker passes a rank's share: shard_info).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from kernels.lora.configs import Plan, PlanKey, config_file, read_plans, set_plan_cache_dir
from kernels.lora.tiles import rank_pad
from kernels.lora.tuning import (
    BucketResult,
    Echo,
    LayerShapes,
    LayerTuner,
    ProjectionShape,
    TuneDeadline,
    silent,
    update_plan_file,
)
from kernels.quant.w8a16_plans import PlanKey as W8A16Key
from kernels.quant.w8a16_plans import config_file as w8a16_file
from kernels.quant.w8a16_plans import read_plans as read_w8a16_plans
from kernels.quant.w8a16_tuning import TOKEN_BUCKETS as W8A16_BUCKETS
from kernels.quant.w8a16_tuning import CellResult, tune_cells
from kernels.quant.w8a16_tuning import TuneRun as W8A16Run
from shared.config import EngineConfig
from shared.model_info import ModelInfo
from worker.model.lora_linear import LoRAPages

log = structlog.get_logger(__name__)

# The token buckets plans are tuned for, as the committed H100 table was (bench/tune_lora.py's default):
# a batch of T tokens takes the smallest bucket >= T. The steps between 64 and 512 tokens are the
# served decode and mixed steps (~90-128 decodes, with prefill chunks beside them), where a plan of the
# next bucket up lost the most (docs/benchmarks.md, "mixed steps re-tuned").
TOKEN_LADDER = (1, 8, 32, 64, 96, 128, 192, 256, 384, 512, 1024, 4096)


def page_rank(info: ModelInfo, max_lora_rank: int) -> int:
    """Rank rows per adapter page, as CausalLM pages its pool (LoRAPages.for_pool)."""
    return LoRAPages.for_pool(info, max_loras=1, max_lora_rank=max_lora_rank).page_rank


def pool_rank(info: ModelInfo, max_lora_rank: int) -> int:
    """The max rank the kernels see (whole pages of a max-rank adapter), whose padding keys the plans."""
    rows = page_rank(info, max_lora_rank)
    return -(-max_lora_rank // rows) * rows


def dense_projections(info: ModelInfo) -> tuple[ProjectionShape, ...]:
    """The dense projections of a decoder layer of this model, each one weight as the engine holds it
    (q|k|v and gate|up fused): attention's qkv and o, and the MLP's gate_up and down unless every
    layer's MLP is a mixture of experts (the experts keep their own buffers and kernels, kernels/moe/)."""
    q_widths = tuple(info.projection_shape(p)[1] for p in ("q_proj", "k_proj", "v_proj"))
    o_k, o_n = info.projection_shape("o_proj")
    projections = [ProjectionShape("qkv", info.hidden_size, q_widths), ProjectionShape("o", o_k, (o_n,))]
    if len(info.moe_layers) < info.num_layers:
        down_k, down_n = info.projection_shape("down_proj")
        projections.append(ProjectionShape("gate_up", info.hidden_size, (info.intermediate_size,) * 2))
        projections.append(ProjectionShape("down", down_k, (down_n,)))
    return tuple(projections)


def adapted_layer(info: ModelInfo, max_lora_rank: int) -> LayerShapes:
    """The projections the engine adapts in a decoder layer of this model (dense_projections), as
    its adapter pool pages them."""
    return LayerShapes(
        dense_projections(info), page_rank=page_rank(info, max_lora_rank), qk_norm=info.qk_norm, head_dim=info.head_dim
    )


def token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """The ladder's buckets a step of at most this many tokens can take: those below it and the
    first at or above it (or itself, past the ladder)."""
    below = tuple(b for b in TOKEN_LADDER if b < max_num_batched_tokens)
    return (*below, next((b for b in TOKEN_LADDER if b >= max_num_batched_tokens), max_num_batched_tokens))


def plan_keys(shapes: LayerShapes, rank: int) -> list[PlanKey]:
    """What each projection's plans are keyed by at this pool rank."""
    return [(k, widths, rank_pad(rank)) for _, k, widths in shapes.projections]


def missing_buckets(
    device_name: str, shapes: LayerShapes, rank: int, buckets: Sequence[int], cache_dir: Path
) -> list[int]:
    """The buckets for which some projection of the layer has no plan for this GPU, neither packaged
    nor in the cache, in the order they are worth tuning (ascending: decode sizes first)."""
    present = read_plans(config_file(device_name)) | read_plans(config_file(device_name, cache_dir))
    keys = plan_keys(shapes, rank)
    return sorted(b for b in set(buckets) if any((key, b) not in present for key in keys))


def describe(shapes: LayerShapes) -> str:
    """`qkv 4096->4096|1024|1024, o 4096->4096, ...`"""
    return ", ".join(f"{name} {k}->{'|'.join(map(str, widths))}" for name, k, widths in shapes.projections)


@dataclass(frozen=True)
class TuneRun:
    """What one tuning run did: the buckets it tuned, in order, and those it did not reach."""

    results: tuple[BucketResult, ...]
    not_reached: tuple[int, ...]
    elapsed_s: float
    plan_file: Path


def tune_buckets(
    shapes: LayerShapes,
    rank: int,
    buckets: Sequence[int],
    plan_file: Path,
    *,
    device_name: str,
    command: str,
    budget_s: float | None = None,
    on_bucket: Callable[[BucketResult, float, Sequence[int]], None] = lambda result, elapsed, left: None,
    echo: Echo = silent,
) -> TuneRun:
    """Tune the layer at pool rank `rank` for `buckets` in order on the current CUDA device, merging
    each bucket's plans into `plan_file` as soon as it is tuned (and then calling on_bucket with it,
    the seconds since the start and the buckets left). budget_s: stop once that many seconds have
    passed, dropping the bucket in progress (None: no limit)."""
    start = time.monotonic()
    deadline = None if budget_s is None else start + budget_s
    results: list[BucketResult] = []
    tuner = LayerTuner(shapes, rank, echo=echo)
    try:
        keys = tuner.keys()
        for index, num_tokens in enumerate(buckets):
            try:
                result = tuner.tune(num_tokens, deadline=deadline)
            except TuneDeadline:
                break
            plans: dict[tuple[PlanKey, int], Plan] = {
                (key, num_tokens): plan for key, plan in zip(keys, result.plans, strict=True)
            }
            update_plan_file(plan_file, device_name, command, plans)
            results.append(result)
            on_bucket(result, time.monotonic() - start, buckets[index + 1 :])
    finally:
        tuner.close()
    return TuneRun(
        results=tuple(results),
        not_reached=tuple(buckets[len(results) :]),
        elapsed_s=time.monotonic() - start,
        plan_file=plan_file,
    )


def ensure_tuned(info: ModelInfo, engine: EngineConfig, cache_dir: Path, budget_s: float) -> TuneRun | None:
    """Tune, within budget_s seconds, the plans this GPU lacks for the model's LoRA projections at
    the engine's max rank and token buckets, into cache_dir, which this process's plan lookups then
    search first. None where nothing is tuned: a CPU engine, one without LoRA (--max-loras 0), a
    budget of 0, or no plan missing."""
    set_plan_cache_dir(cache_dir)
    device = torch.device(engine.device)
    if device.type != "cuda" or not engine.lora_enabled:
        return None
    device_name = torch.cuda.get_device_name(device)
    _set_aside_if_unreadable(config_file(device_name, cache_dir))
    shapes = adapted_layer(info, engine.max_lora_rank)
    rank = pool_rank(info, engine.max_lora_rank)
    missing = missing_buckets(device_name, shapes, rank, token_buckets(engine.max_num_batched_tokens), cache_dir)
    fields = {"model": info.name, "device": device_name, "rank_pad": rank_pad(rank), "shapes": describe(shapes)}
    if not missing:
        return None
    if budget_s <= 0:
        log.warning("kernel_tune_off", missing_buckets=missing, **fields)
        return None
    log.info("kernel_tune_start", missing_buckets=missing, budget_s=budget_s, cache_dir=str(cache_dir), **fields)

    def progress(result: BucketResult, elapsed_s: float, left: Sequence[int]) -> None:
        log.info(
            "kernel_tune_progress",
            bucket=result.num_tokens,
            path=result.chosen,
            over_base=round(result.over_base, 3),
            elapsed_s=round(elapsed_s, 1),
            left=list(left),
            **fields,
        )

    with torch.cuda.device(device):
        run = tune_buckets(
            shapes,
            rank,
            missing,
            config_file(device_name, cache_dir),
            device_name=device_name,
            command=f"lorafleet worker: first-start tune of {info.name} at max_lora_rank {engine.max_lora_rank}",
            budget_s=budget_s,
            on_bucket=progress,
        )
    tuned = [result.num_tokens for result in run.results]
    log.info(
        "kernel_tune_done", tuned=tuned, not_reached=list(run.not_reached), elapsed_s=round(run.elapsed_s, 1), **fields
    )
    return run


def tune_at_start(infos: Iterable[ModelInfo], engine: EngineConfig, cache_dir: Path | None) -> None:
    """The first-start tune of every model a worker serves (`ensure_tuned` and `ensure_w8a16_tuned`
    each, engine.kernel_tune_budget_s seconds apiece), before any is loaded: tuning beside a serving
    model would slow it and skew the timings. Nothing without a plan cache (cache_dir None: a worker
    built in-process, not by the CLI)."""
    if cache_dir is None:
        return
    for info in infos:
        for tune in (ensure_tuned, ensure_w8a16_tuned):
            try:
                tune(info, engine, cache_dir, engine.kernel_tune_budget_s)
            except Exception:  # a faster plan is an optimisation: serve on the tables and defaults, not at all
                log.exception("kernel_tune_failed", model=info.name, plans=tune.__name__)
    if torch.device(engine.device).type == "cuda":
        torch.cuda.empty_cache()  # the tuner's layers and buffers go back before the KV cache is carved


def _set_aside_if_unreadable(path: Path, read: Callable[[Path], object] = read_plans) -> None:
    """A cache file that is not a plan file (written by hand, or by another version) would fail
    every lookup: it is renamed beside itself and tuned again."""
    try:
        read(path)
    except ValueError as exc:
        aside = path.with_name(f"{path.name}.unreadable")
        path.replace(aside)
        log.warning("kernel_plans_unreadable", file=str(path), moved_to=str(aside), error=str(exc))


def w8a16_cells(info: ModelInfo) -> list[W8A16Key]:
    """(N, K, bucket) of the W8A16 GEMMs a model served in fp8 runs: each dense projection's weight at
    every decode bucket, smallest bucket first."""
    shapes = dict.fromkeys((sum(p.widths), p.k) for p in dense_projections(info))
    return [(n, k, bucket) for bucket in W8A16_BUCKETS for n, k in shapes]


def missing_w8a16_cells(device_name: str, cells: Sequence[W8A16Key], cache_dir: Path) -> list[W8A16Key]:
    """The cells neither W8A16 table (packaged, cache) holds for this GPU, in `cells`' order."""
    present = read_w8a16_plans(w8a16_file(device_name)) | read_w8a16_plans(w8a16_file(device_name, cache_dir))
    return [cell for cell in cells if cell not in present]


def ensure_w8a16_tuned(info: ModelInfo, engine: EngineConfig, cache_dir: Path, budget_s: float) -> W8A16Run | None:
    """Tune, within budget_s seconds, the W8A16 plans this GPU lacks for a model served in fp8, into
    cache_dir, which this process's plan lookups then search first. None where nothing is tuned: a
    CPU engine, weights not in fp8, a budget of 0, or no cell missing."""
    set_plan_cache_dir(cache_dir)
    device = torch.device(engine.device)
    if device.type != "cuda" or info.quantization != "fp8":
        return None
    device_name = torch.cuda.get_device_name(device)
    _set_aside_if_unreadable(w8a16_file(device_name, cache_dir), read_w8a16_plans)
    missing = missing_w8a16_cells(device_name, w8a16_cells(info), cache_dir)
    fields = {"model": info.name, "device": device_name}
    if not missing:
        return None
    if budget_s <= 0:
        log.warning("w8a16_tune_off", missing_cells=len(missing), **fields)
        return None
    log.info("w8a16_tune_start", missing_cells=len(missing), budget_s=budget_s, cache_dir=str(cache_dir), **fields)

    def progress(result: CellResult, elapsed_s: float) -> None:
        log.info("w8a16_tune_progress", cell=list(result.key), plan=result.plan.describe(), us=round(result.us, 1),
                 default_us=round(result.default_us, 1), elapsed_s=round(elapsed_s, 1), **fields)  # fmt: skip

    with torch.cuda.device(device):
        run = tune_cells(
            missing,
            w8a16_file(device_name, cache_dir),
            device_name=device_name,
            command=f"lorafleet worker: first-start W8A16 tune of {info.name}",
            budget_s=budget_s,
            on_cell=progress,
        )
    log.info("w8a16_tune_done", tuned=len(run.results), not_reached=len(run.not_reached),
             elapsed_s=round(run.elapsed_s, 1), **fields)  # fmt: skip
    return run
