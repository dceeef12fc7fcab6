"""Tuning the W8A16 plans (w8a16_plans.py) for the GPU at hand, one (weight shape, token bucket) cell
at a time, on a CUDA device: bench/tune_w8a16.py is the CLI over it.

Per cell, a random bf16 x [T, K] (T the bucket's max_tokens) against a random fp8 weight [N, K]:
  1. each stage-1 candidate (`candidates`: tiles, operand order and K splits, at the warps and
     stages the default plan uses) and the default plan run once and are checked against the
     reference (a plan that does not compile on this GPU, or computes something else, is dropped),
     then timed: the median of CUDA-graph replays with L2 flushed before each call
     (kernels.lora.tuning.timing.Flushed; in a model the other layers' weights have evicted this
     one's);
  2. the fastest one's warps and stages are varied (`refinements`), checked and timed alike;
  3. the fastest few and the default are timed again, in turn, `rounds` times over, and the lowest
     median wins: plans a few tenths of a µs apart are as far apart as two captures of one plan.
The candidates are few on purpose (about 20-35 timed per cell, from some 30 distinct compilations
over all cells, so that Llama-3-8B's 24 cells are meant to fit in about two minutes): the tile
shapes of the kernel's two operand orders, the K splits that put between one and a few programs on
every SM, then warps and stages around the winner. Cells are best tuned in ascending token order, so
that a budget cut short drops the largest buckets (bench/tune_w8a16.py does).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from kernels.lora.tuning import Echo, TuneDeadline, silent
from kernels.lora.tuning.timing import Flushed
from kernels.plan_files import merge_plans
from kernels.quant.reference import quantize_weight, weight_only_linear_reference
from kernels.quant.w8a16 import w8a16_linear
from kernels.quant.w8a16_plans import PlanKey, W8A16Plan, default_plan, plan_entry, read_plans, reload_plans

TOKEN_BUCKETS = (1, 8, 16, 32, 48, 64)  # decode batch sizes; W8A16 serves up to W8A16_MAX_TOKENS = 64

# (block_n, block_k) of the tiles timed. Streaming (a 16-row token tile): the weight tile [N, K] as the
# MMA's N side (32 rows too: more programs without a K split, whose second kernel costs a launch), or
# swapped onto its M side. Past 16 tokens always swapped (the order the default plan found faster):
# 64 or 128 weight rows, the MMA's M side, K steps of 128 or 256.
STREAM_TILES = ((32, 256), (64, 128), (64, 256))
SWAPPED_STREAM_TILES = ((64, 128), (128, 128))
MMA_TILES = ((64, 128), (64, 256), (128, 128), (128, 256))
SPLITS = (1, 2, 4, 8, 16)
STREAM_WAVES = 4  # programs per SM past which a finer K split only adds partial sums to write and read
MMA_WAVES = 3
WARPS = (4, 8)
STAGES = (2, 3, 4, 5)
SHARED_BYTES = 192 << 10  # a stage's fp8 weight tile and x tile, times the stages: under an H100's 227 KiB


def _splits(tiles: int, k: int, block_k: int, num_sms: int, waves: int) -> list[int]:
    """The K splits worth timing for `tiles` output tiles: those that put between one and `waves`
    programs on every SM, and the largest that puts fewer than one (all SMs busy is not always
    faster than fewer, longer programs); each split range at least two K steps."""
    valid = [s for s in SPLITS if s == 1 or k // s >= 2 * block_k]
    below = [s for s in valid if tiles * s < num_sms]
    in_band = [s for s in valid if num_sms <= tiles * s <= waves * num_sms]
    return sorted(set(below[-1:] + in_band)) or [1]


def fits_shared_memory(plan: W8A16Plan) -> bool:
    """Whether a plan's pipelined tiles stay under SHARED_BYTES (an estimate: the compiler has the last word)."""
    stage_bytes = plan.block_n * plan.block_k + plan.block_m * plan.block_k * 2
    return plan.num_stages * stage_bytes <= SHARED_BYTES


def candidates(num_tokens: int, n: int, k: int, num_sms: int) -> list[W8A16Plan]:
    """Step 1's plans for x [num_tokens, k] against a weight [n, k]: the module docstring's tiles, each
    at its K splits, at the default plan's warps and stages for that tile."""
    block_m = default_plan(num_tokens, n, k, num_sms).block_m
    if block_m == 16:
        tiles = [(bn, bk, False) for bn, bk in STREAM_TILES] + [(bn, bk, True) for bn, bk in SWAPPED_STREAM_TILES]
        waves = STREAM_WAVES
    else:
        tiles, waves = [(bn, bk, True) for bn, bk in MMA_TILES], MMA_WAVES
    plans = []
    for block_n, block_k, swap in tiles:
        stages = 4 if block_k == 128 and block_m == 16 else 3
        count = triton.cdiv(n, block_n) * triton.cdiv(num_tokens, block_m)
        for split_k in _splits(count, k, block_k, num_sms, waves):
            plans.append(W8A16Plan(block_m, block_n, block_k, split_k, 4, stages, swap))
    return [plan for plan in plans if fits_shared_memory(plan)]


def refinements(plan: W8A16Plan) -> list[W8A16Plan]:
    """Step 2's plans: `plan` at every other count of warps and stages that fits in shared memory."""
    variants = (dataclasses.replace(plan, num_warps=w, num_stages=s) for w in WARPS for s in STAGES)
    return [variant for variant in variants if variant != plan and fits_shared_memory(variant)]


def matches(y: torch.Tensor, reference: torch.Tensor) -> bool:
    """y within x's dtype's rounding of the fp32 reference (2**-8 of each value for bf16), plus
    2**-12 of the largest: the fp32 sums of different K orders differ by far less, and a plan that
    dropped or repeated any part of the K reduction by far more."""
    error = (y.float() - reference).abs()
    return bool((error <= reference.abs() * 2**-8 + reference.abs().max() * 2**-12).all())


@dataclass(frozen=True)
class CellResult:
    """One (shape, bucket) cell tuned: the plan chosen and the default's, each with its time (µs)."""

    n: int
    k: int
    num_tokens: int
    plan: W8A16Plan
    us: float
    default: W8A16Plan
    default_us: float
    timed: int  # plans timed
    dropped: int  # plans that failed to compile or to match the reference

    @property
    def key(self) -> PlanKey:
        return (self.n, self.k, self.num_tokens)


class W8A16Tuner:
    """Tunes W8A16 cells on the current CUDA device (the module docstring). Holds a random fp8 weight
    of every shape it has tuned (Llama-3-8B's four: 0.2 GB) until `close`."""

    def __init__(self, *, rounds: int = 2, finalists: int = 2, echo: Echo = silent) -> None:
        self.rounds = rounds
        self.finalists = finalists
        self.echo = echo
        self.num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self.flushed = Flushed()
        self._weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._deadline: float | None = None

    def tune(self, n: int, k: int, num_tokens: int, *, deadline: float | None = None) -> CellResult:
        """Steps 1-3 for x [num_tokens, k] against a weight [n, k]. deadline: a time.monotonic() past
        which the cell is given up (TuneDeadline)."""
        self._deadline = deadline
        if (n, k) not in self._weights:
            self._weights[n, k] = quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        q, scales = self._weights[n, k]
        x = torch.randn(num_tokens, k, device="cuda", dtype=torch.bfloat16)
        reference = weight_only_linear_reference(x.float(), q, scales)
        default = default_plan(num_tokens, n, k, self.num_sms)
        times: dict[W8A16Plan, float] = {}
        dropped = 0

        def time_all(plans: Sequence[W8A16Plan]) -> None:
            nonlocal dropped
            for plan in plans:
                if plan in times:
                    continue
                self._check_time()
                try:
                    ok = matches(w8a16_linear(x, q, scales, plan=plan), reference)
                except Exception as exc:  # a plan can exceed shared memory or registers on this GPU
                    self.echo(f"    {plan.describe()}: {type(exc).__name__}: {str(exc)[:80]}")
                    ok = None
                if not ok:
                    dropped += 1
                    if ok is False:
                        self.echo(f"    {plan.describe()}: does not match the reference, dropped")
                    continue
                times[plan] = self.flushed(lambda plan=plan: w8a16_linear(x, q, scales, plan=plan))

        time_all([default, *candidates(num_tokens, n, k, self.num_sms)])
        if default not in times:
            raise RuntimeError(f"the default W8A16 plan {default.describe()} failed at N={n} K={k} T={num_tokens}")
        time_all(refinements(min(times, key=times.__getitem__)))
        finalists = sorted(times, key=times.__getitem__)[: self.finalists]
        final = self._rounds([*finalists, default] if default not in finalists else finalists, x, q, scales)
        best = min(final, key=final.__getitem__)
        return CellResult(n, k, num_tokens, best, final[best], default, final[default], len(times), dropped)

    def close(self) -> None:
        """Give the weights and the flush buffer back to the device."""
        self._weights = {}
        del self.flushed
        torch.cuda.empty_cache()

    def _rounds(
        self, plans: Sequence[W8A16Plan], x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor
    ) -> dict[W8A16Plan, float]:
        samples: dict[W8A16Plan, list[float]] = {plan: [] for plan in plans}
        for _ in range(self.rounds):
            for plan in plans:
                self._check_time()
                samples[plan].append(self.flushed(lambda plan=plan: w8a16_linear(x, q, scales, plan=plan)))
        return {plan: statistics.median(values) for plan, values in samples.items()}

    def _check_time(self) -> None:
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise TuneDeadline


def update_plan_file(path: Path, device: str, command: str, plans: Mapping[PlanKey, W8A16Plan]) -> int:
    """Merge `plans` ((N, K, max_tokens) → plan) into the W8A16 plan file at `path`, for GPU `device`,
    and list `command` among the commands that made it; returns how many plans the file holds
    (kernels/plan_files.merge_plans); this process's next lookups read it again."""
    count = merge_plans(path, device, command, plans, read_plans, plan_entry)
    reload_plans()
    return count


@dataclass(frozen=True)
class TuneRun:
    """What one run did: the cells it tuned, in order, and those it did not reach."""

    results: tuple[CellResult, ...]
    not_reached: tuple[PlanKey, ...]
    elapsed_s: float
    plan_file: Path


def tune_cells(
    cells: Sequence[PlanKey],
    plan_file: Path,
    *,
    device_name: str,
    command: str,
    budget_s: float | None = None,
    on_cell: Callable[[CellResult, float], None] = lambda result, elapsed_s: None,
    echo: Echo = silent,
) -> TuneRun:
    """Tune (N, K, max_tokens) `cells` in order on the current CUDA device, merging each plan into
    `plan_file` as soon as it is chosen (then calling on_cell with it and the seconds since the start).
    budget_s: stop once that many seconds have passed, dropping the cell in progress (None: no limit)."""
    start = time.monotonic()
    deadline = None if budget_s is None else start + budget_s
    results: list[CellResult] = []
    tuner = W8A16Tuner(echo=echo)
    try:
        for n, k, num_tokens in cells:
            try:
                result = tuner.tune(n, k, num_tokens, deadline=deadline)
            except TuneDeadline:
                break
            update_plan_file(plan_file, device_name, command, {result.key: result.plan})
            results.append(result)
            on_cell(result, time.monotonic() - start)
    finally:
        tuner.close()
    return TuneRun(tuple(results), tuple(cells[len(results) :]), time.monotonic() - start, plan_file)
