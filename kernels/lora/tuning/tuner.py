"""The multi-LoRA tuner: the plans of one layer's projections, at one rank, on the current CUDA
device, per token bucket T (a batch of up to T tokens takes the bucket's plans; past the largest
bucket, the largest's).

Per bucket, with served_adapters(T) adapters (or a fixed count, capped at T) laid out as in
layer.py (in scattered pages of as many rank rows as the engine pages that model's adapters in;
plans are keyed by the padded max rank, so they serve any page size):
  1. per projection shape of the layer, time each kernel's candidate configurations alone (fused;
     shrink; the grouped and the gathering expand on the best shrink's z; at decode sizes the single
     launch, single_launch.py) and keep the fastest of each, and the faster of the two expands.
     These timings are medians of CUDA-graph replays with L2 flushed before each call
     (timing.Flushed), since in a model the previous layer's weights have evicted them;
  2. time the whole layer (its projections, base GEMMs included) as the decoder calls it
     (timing.served_us: on the overlap path all LoRA work runs beside the base GEMMs, o and down add
     their deltas into the residual stream, and the kernels after qkv and gate_up read theirs,
     which is timed and added: timing.delta_read_us) along each path with those configurations, and
     the overlap path once per shrink split (candidates.layer_candidates); candidates in turn,
     `rounds` times over; record the candidate with the lowest median. Paths are chosen per layer,
     not per projection: alone, a projection's timing misses how its LoRA work overlaps the
     neighbouring GEMMs, and per-projection picks measured worse.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernels.lora import LoRABatch
from kernels.lora.configs import Plan, PlanKey, default_plan
from kernels.lora.expand import lora_expand
from kernels.lora.expand_gather import lora_expand_gather
from kernels.lora.fused import lora_fused
from kernels.lora.shrink import lora_shrink
from kernels.lora.single_launch import MAX_TOKENS as SINGLE_LAUNCH_MAX_TOKENS
from kernels.lora.single_launch import lora_single_launch
from kernels.lora.tiles import rank_pad, slice_groups
from kernels.lora.tuning.candidates import (
    FUSED_MAX_TOKENS,
    GATHER_MAX_TOKENS,
    expand_candidates,
    fused_candidates,
    gather_candidates,
    layer_candidates,
    shrink_candidates,
    single_candidates,
)
from kernels.lora.tuning.layer import LayerShapes, Projection, make_batch, make_layer
from kernels.lora.tuning.timing import Flushed, delta_read_us, median_us, served_us

Echo = Callable[[str], None]  # takes the tuner's progress, a line at a time


def served_adapters(num_tokens: int) -> int:
    """Distinct adapters a served step of num_tokens tokens carries, as the tuner spreads a bucket
    over them (and the committed H100 table was tuned): a full step at saturation holds ~40 of 100
    Zipf(1.0) adapters, the small steps of a light load fewer, and plans tuned at 40 for 32 and 64
    tokens lost at 8 adapters (docs/benchmarks.md, "mixed steps re-tuned"). Never more than T."""
    return min(num_tokens, 16 if num_tokens <= 64 else 40)


def silent(line: str) -> None:
    """An Echo that shows nothing."""


class TuneDeadline(Exception):
    """The time given to a bucket ran out before its last timing; its timings are dropped."""


@dataclass(frozen=True)
class BucketResult:
    """Step 2's outcome for batches of up to `num_tokens` tokens."""

    num_tokens: int
    chosen: str  # the fastest candidate: a path, or "overlap/split_k=S"
    plans: tuple[Plan, ...]  # the chosen candidate's, one per projection in the layer's order
    layer_us: dict[str, float]  # the served layer's time along every candidate, and "base": the base GEMMs'

    @property
    def over_base(self) -> float:
        """What the chosen plans add to the base layer, as a fraction of it."""
        return self.layer_us[self.chosen] / self.layer_us["base"] - 1


class LayerTuner:
    """Tunes one layer's projections at one rank on the current CUDA device (see the module docstring).
    Holds a random layer with its adapter pool on the GPU until `close`."""

    def __init__(
        self,
        shapes: LayerShapes,
        rank: int,
        *,
        adapters: int | None = None,
        rounds: int = 3,
        echo: Echo = silent,
    ) -> None:
        """adapters: distinct adapters in every bucket's batch (capped at T); None: served_adapters(T)."""
        self.shapes = shapes
        self.rank = rank
        self.adapters = adapters
        self.rounds = rounds
        self.echo = echo
        self.layer: list[Projection] = make_layer(rank, shapes.projections, page_rank=shapes.page_rank)
        self.flushed = Flushed()
        self._deadline: float | None = None

    def keys(self) -> list[PlanKey]:
        """What each projection's plans are keyed by, in the layer's order."""
        return [(p.k, p.widths, rank_pad(self.rank)) for p in self.layer]

    def tune(
        self, num_tokens: int, *, kernels: Sequence[Plan] | None = None, deadline: float | None = None
    ) -> BucketResult:
        """Steps 1 and 2 for batches of up to num_tokens tokens. kernels: each projection's stored
        configurations, to choose paths only (step 2). deadline: a time.monotonic() past which the
        bucket is given up (TuneDeadline)."""
        self._deadline = deadline
        adapters = served_adapters(num_tokens) if self.adapters is None else min(num_tokens, self.adapters)
        batch = make_batch(num_tokens, adapters, self.rank, page_rank=self.shapes.page_rank)
        xs = [torch.randn(num_tokens, p.k, device="cuda").to(torch.bfloat16) for p in self.layer]
        if kernels is None:
            kernels = []
            for proj, x in zip(self.layer, xs, strict=True):
                self.echo(f"  {proj.name}")
                kernels.append(self._tune_kernels(proj, x, batch))
        candidates = layer_candidates(list(kernels), num_tokens, rank_pad(self.rank))
        times = self._layer_times(xs, candidates, batch)
        chosen = min((name for name in times if name != "base"), key=times.__getitem__)
        return BucketResult(num_tokens, chosen, tuple(candidates[chosen]), times)

    def close(self) -> None:
        """Give the layer's memory back to the device."""
        self.layer = []
        del self.flushed
        torch.cuda.empty_cache()

    def _check_time(self) -> None:
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise TuneDeadline

    def _best(self, label: str, candidates: list[Any], timed: Callable[[Any], float]) -> Any:
        times = []
        for config in candidates:
            self._check_time()
            try:
                times.append((timed(config), config))
            except Exception as exc:  # a config can exceed shared memory or registers on this GPU
                self.echo(f"    {label} {config}: {type(exc).__name__}: {str(exc)[:80]}")
        us, config = min(times, key=lambda item: item[0])
        self.echo(f"    {label:8s} {us:8.1f} us  {config}")
        return config

    def _tune_kernels(self, proj: Projection, x: torch.Tensor, batch: LoRABatch) -> Plan:
        """Step 1 for one projection: the fastest configuration of every kernel (path left to step 2)."""
        num_tokens, flushed_us = x.shape[0], self.flushed
        (group,) = slice_groups(proj.lora_a, proj.lora_b)
        r_pad = rank_pad(proj.rank)
        y = torch.empty(num_tokens, proj.weight.shape[0], device="cuda", dtype=torch.bfloat16)

        plan = default_plan(num_tokens, r_pad)
        if num_tokens <= FUSED_MAX_TOKENS:
            fused = self._best(
                "fused",
                fused_candidates(num_tokens, r_pad),
                lambda c: flushed_us(lambda: lora_fused(y, x, group, batch, c, accumulate=False)),
            )
            plan = dataclasses.replace(plan, fused=fused)
        shrink = self._best(
            "shrink",
            shrink_candidates(num_tokens, r_pad),
            lambda c: flushed_us(lambda: lora_shrink(x, group, batch, c)),
        )
        z = lora_shrink(x, group, batch, shrink)
        expand = self._best(
            "expand",
            expand_candidates(num_tokens, r_pad),
            lambda c: flushed_us(lambda: lora_expand(y, z, group, batch, c)),
        )
        gather = None
        if num_tokens <= GATHER_MAX_TOKENS:
            gather = self._best(
                "gather",
                gather_candidates(num_tokens, r_pad),
                lambda c: flushed_us(lambda: lora_expand_gather(y, z, group, batch, c)),
            )
            grouped_us = flushed_us(lambda: lora_expand(y, z, group, batch, expand))
            if grouped_us < flushed_us(lambda: lora_expand_gather(y, z, group, batch, gather)):
                gather = None
        if num_tokens <= SINGLE_LAUNCH_MAX_TOKENS:
            single = self._best(
                "single",
                single_candidates(num_tokens, r_pad),
                lambda c: flushed_us(lambda: lora_single_launch(y, x, group, batch, c, accumulate=False)),
            )
            plan = dataclasses.replace(plan, single=single)
        return dataclasses.replace(plan, shrink=shrink, expand=expand, gather=gather)

    def _layer_times(
        self, xs: list[torch.Tensor], candidates: dict[str, list[Plan]], batch: LoRABatch
    ) -> dict[str, float]:
        """Step 2: the layer's time (us) as served along each candidate, and its base time. Candidates
        are timed in turn, `rounds` times over, and each keeps its median: decode paths differ by a
        few microseconds, about as much as separate captures of one path do."""
        layer = self.layer
        delta_reads = delta_read_us(layer, xs[0].shape[0], qk_norm=self.shapes.qk_norm, head_dim=self.shapes.head_dim)
        runs: dict[str, Callable[[], float]] = {
            name: lambda plans=plans: served_us(layer, xs, plans, batch, delta_reads)
            for name, plans in candidates.items()
        }
        runs["base"] = lambda: median_us(
            lambda: [torch.nn.functional.linear(x, p.weight) for p, x in zip(layer, xs, strict=True)]
        )
        samples: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(self.rounds):
            for name, run in runs.items():
                self._check_time()
                samples[name].append(run())
        return {name: statistics.median(times) for name, times in samples.items()}
