"""Tune the multi-LoRA launch configurations and paths for this GPU; writes kernels/configs/<GPU>.json.

    python -m bench.tune_lora [--model llama-3-8b] [--tokens 1 8 32 64 256 1024 4096] [--ranks 16 64]
                              [--adapters 16]

--model picks the layer whose projection shapes are tuned (bench.lora_kernels.MODELS): llama-3-8b,
its qkv, o, gate_up and down; qwen3-30b-a3b, its attention's qkv and o (its experts are
bench.tune_moe's). For each rank and token bucket T (a batch past the largest bucket takes it, so
let the largest cover the model's prefill chunk), with min(T, --adapters) adapters laid out as in
the benchmark (in scattered pages of as many rank rows as the engine pages that model's adapters
in; plans are keyed by the padded max rank, so they serve any page size):
  1. per projection shape of the layer, time each kernel's candidate
     configurations alone (fused; shrink; the grouped and the gathering expand on the best shrink's
     z) and keep the fastest of each, and the faster of the two expands. These
     timings are medians of CUDA-graph replays with L2 flushed before each call (a 128 MiB read,
     timed alone and subtracted), since in a model the previous layer's weights have evicted them;
  2. time the whole layer (its projections, base GEMMs included) as the decoder calls it
     (bench.lora_kernels.served_us: on the overlap path all LoRA work runs beside the base GEMMs,
     o and down add their deltas into the residual stream, and the kernels after qkv and gate_up
     read theirs, which is timed and added: bench.lora_kernels.delta_read_us)
     along each path with those configurations, and the overlap path once per shrink split (beside
     a GEMM, the split that is fastest alone contends with it for SMs); candidates in turn, --rounds
     times over; record the candidate with the lowest median for batches of up to T tokens
     (--paths-only: only this step, on the stored configurations). Paths are chosen per layer, not
     per projection: alone, a projection's timing misses how its LoRA work overlaps the
     neighbouring GEMMs, and per-projection picks measured worse.
Plans for shapes and ranks not re-tuned are kept from the existing file.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from bench.lora_kernels import MODELS, Projection, delta_read_us, median_us, served_us
from bench.lora_kernels import make_batch as bench_batch
from bench.lora_kernels import make_layer as bench_layer
from kernels.lora import LoRABatch
from kernels.lora.configs import (
    PATHS,
    ExpandConfig,
    FusedConfig,
    GatherConfig,
    Plan,
    ShrinkConfig,
    config_file,
    default_plan,
)
from kernels.lora.expand import lora_expand
from kernels.lora.expand_gather import lora_expand_gather
from kernels.lora.fused import lora_fused
from kernels.lora.shrink import lora_shrink
from kernels.lora.tiles import rank_pad, slice_groups

FUSED_MAX_TOKENS = 256  # above, the fused kernel's re-reads of A make it pointless to time
GATHER_MAX_TOKENS = 256  # above, the gathering expand's CUDA-core products make it pointless to time


class Flushed:
    """Median time of a function with L2 flushed before each call (the flush timed once, subtracted).
    The flush reads: a write would leave L2 full of dirty lines for the timed call to write back."""

    def __init__(self) -> None:
        self.scratch = torch.ones(32 << 20, dtype=torch.float32, device="cuda")
        self.flush_us = median_us(self.scratch.sum, rep_ms=8)

    def __call__(self, fn: Callable[[], object]) -> float:
        def flush_and_run() -> None:
            self.scratch.sum()
            fn()

        return median_us(flush_and_run, rep_ms=8) - self.flush_us


def fused_candidates(num_tokens: int, r_pad: int) -> list[FusedConfig]:
    block_ks = (128, 256) if r_pad >= 64 else (256, 512)
    return [
        FusedConfig(block_m=16, block_n=128, block_k=bk, n_chunk=chunk, num_stages=3)
        for bk in block_ks
        for chunk in (512, 2048)
    ]


def gather_candidates(num_tokens: int, r_pad: int) -> list[GatherConfig]:
    block_ts = (16,) if num_tokens <= 16 else (16, 32)
    return [
        GatherConfig(block_t=bt, block_n=bn, num_warps=4 if bt * bn <= 512 else 8) for bt in block_ts for bn in (32, 64)
    ]


def shrink_candidates(num_tokens: int, r_pad: int) -> list[ShrinkConfig]:
    block_ms = (16,) if num_tokens <= 256 else (32, 64)
    # expand reads all partials of z: past 8 they cost it more than they save the shrink
    splits = (2, 4, 8) if num_tokens <= 256 else (1, 2)
    block_ks = (64, 128) if r_pad >= 64 else (128, 256)
    return [ShrinkConfig(block_m=bm, block_k=bk, split_k=sk) for bm in block_ms for bk in block_ks for sk in splits]


def expand_candidates(num_tokens: int, r_pad: int) -> list[ExpandConfig]:
    if num_tokens <= 256:
        block_ms, walks = (16,), ((64, 64), (128, 512), (128, 2048), (256, 1024), (256, 4096))
    else:
        block_ms, walks = (64, 128), ((128, 128), (128, 1024), (256, 256), (256, 2048))
    return [
        ExpandConfig(block_m=bm, block_n=bn, n_chunk=chunk, num_warps=4 if bn <= 128 else 8, num_stages=3)
        for bm in block_ms
        for bn, chunk in walks
    ]


def best(label: str, candidates: list, timed: Callable[[object], float]) -> object:
    times = []
    for config in candidates:
        try:
            times.append((timed(config), config))
        except Exception as exc:  # a config can exceed shared memory or registers on this GPU
            print(f"    {label} {config}: {type(exc).__name__}: {str(exc)[:80]}", file=sys.stderr)
    us, config = min(times, key=lambda item: item[0])
    print(f"    {label:8s} {us:8.1f} us  {config}", flush=True)
    return config


def tune_kernels(flushed_us: Flushed, proj: Projection, x: torch.Tensor, batch: LoRABatch) -> Plan:
    """Step 1 for one projection: the fastest configuration of every kernel (path left to step 2)."""
    num_tokens, rank = x.shape[0], proj.rank
    (group,) = slice_groups(proj.lora_a, proj.lora_b)
    r_pad = rank_pad(rank)
    y = torch.empty(num_tokens, proj.weight.shape[0], device="cuda", dtype=torch.bfloat16)

    plan = default_plan(num_tokens, r_pad)
    if num_tokens <= FUSED_MAX_TOKENS:
        fused = best(
            "fused",
            fused_candidates(num_tokens, r_pad),
            lambda c: flushed_us(lambda: lora_fused(y, x, group, batch, c, accumulate=False)),
        )
        plan = dataclasses.replace(plan, fused=fused)
    shrink = best(
        "shrink",
        shrink_candidates(num_tokens, r_pad),
        lambda c: flushed_us(lambda: lora_shrink(x, group, batch, c)),
    )
    z = lora_shrink(x, group, batch, shrink)
    expand = best(
        "expand",
        expand_candidates(num_tokens, r_pad),
        lambda c: flushed_us(lambda: lora_expand(y, z, group, batch, c)),
    )
    gather = None
    if num_tokens <= GATHER_MAX_TOKENS:
        gather = best(
            "gather",
            gather_candidates(num_tokens, r_pad),
            lambda c: flushed_us(lambda: lora_expand_gather(y, z, group, batch, c)),
        )
        grouped_us = flushed_us(lambda: lora_expand(y, z, group, batch, expand))
        if grouped_us < flushed_us(lambda: lora_expand_gather(y, z, group, batch, gather)):
            gather = None
    return dataclasses.replace(plan, shrink=shrink, expand=expand, gather=gather)


def layer_candidates(plans: list[Plan], num_tokens: int, r_pad: int) -> dict[str, list[Plan]]:
    """Step 2's candidates, one plan per projection each: every path with step 1's configurations,
    the overlap path once per shrink split."""
    candidates = {
        path: [dataclasses.replace(plan, path=path) for plan in plans]
        for path in PATHS
        if path != "overlap" and (path != "fused" or num_tokens <= FUSED_MAX_TOKENS)
    }
    for split_k in sorted({config.split_k for config in shrink_candidates(num_tokens, r_pad)}):
        candidates[f"overlap/split_k={split_k}"] = [
            dataclasses.replace(plan, path="overlap", shrink=dataclasses.replace(plan.shrink, split_k=split_k))
            for plan in plans
        ]
    return candidates


def layer_times(
    layer: list[Projection],
    xs: list[torch.Tensor],
    candidates: dict[str, list[Plan]],
    batch: LoRABatch,
    rounds: int,
    qk_norm: bool,
) -> dict[str, float]:
    """Step 2: the layer's time (us) as served along each candidate, and its base time. Candidates
    are timed in turn, `rounds` times over, and each keeps its median: decode paths differ by a
    few microseconds, about as much as separate captures of one path do."""
    delta_reads = delta_read_us(layer, xs[0].shape[0], qk_norm=qk_norm)
    runs: dict[str, Callable[[], float]] = {
        name: lambda plans=plans: served_us(layer, xs, plans, batch, delta_reads) for name, plans in candidates.items()
    }
    runs["base"] = lambda: median_us(
        lambda: [torch.nn.functional.linear(x, p.weight) for p, x in zip(layer, xs, strict=True)]
    )
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            samples[name].append(run())
    return {name: statistics.median(times) for name, times in samples.items()}


def stored_plans(existing: list[dict], k: int, widths: tuple[int, ...], rank: int, num_tokens: int) -> Plan:
    """The plan a previous run stored for this shape, rank and bucket (for --paths-only)."""
    for entry in existing:
        if (entry["k"], tuple(entry["widths"]), entry["rank_pad"], entry["max_tokens"]) == (
            k,
            widths,
            rank_pad(rank),
            num_tokens,
        ):
            return Plan.from_json(entry)
    raise SystemExit(f"--paths-only: no stored plan for K={k} widths={widths} rank={rank} T={num_tokens}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="llama-3-8b", help="whose projection shapes to tune")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 256, 1024, 4096])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--adapters", type=int, default=16, help="distinct adapters per batch (capped at T)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timings of each path per layer")
    parser.add_argument(
        "--paths-only", action="store_true", help="keep the stored kernel configurations, choose paths again"
    )
    args = parser.parse_args()

    device = torch.cuda.get_device_name()
    path = config_file(device)
    existing = json.loads(path.read_text()) if path.exists() else {"plans": [], "commands": []}
    model = MODELS[args.model]
    shapes = model.shapes
    tuned_keys = {(k, tuple(widths), rank_pad(r)) for _, k, widths in shapes for r in args.ranks}
    plans = [e for e in existing["plans"] if (e["k"], tuple(e["widths"]), e["rank_pad"]) not in tuned_keys]
    command = " ".join(["python -m bench.tune_lora", *sys.argv[1:]])
    commands = [c for c in existing["commands"] if c != command] + [command]

    def write() -> None:  # after every bucket, so an interrupted run keeps what it measured
        plans.sort(key=lambda e: (e["k"], e["widths"], e["rank_pad"], e["max_tokens"]))
        document = {"device": device, "date": datetime.date.today().isoformat(), "commands": commands, "plans": plans}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=1) + "\n")

    flushed_us = Flushed()
    start = time.time()
    for rank in args.ranks:
        layer = bench_layer(rank, shapes, page_rank=model.page_rank)
        for num_tokens in args.tokens:
            print(f"# r{rank} T={num_tokens} ({time.time() - start:.0f} s)", flush=True)
            batch = bench_batch(num_tokens, min(num_tokens, args.adapters), rank, page_rank=model.page_rank)
            xs = [torch.randn(num_tokens, p.k, device="cuda").to(torch.bfloat16) for p in layer]
            tuned = []
            for proj, x, (_, k, widths) in zip(layer, xs, shapes, strict=True):
                if args.paths_only:
                    tuned.append(stored_plans(existing["plans"], k, widths, rank, num_tokens))
                else:
                    print(f"  {proj.name}", flush=True)
                    tuned.append(tune_kernels(flushed_us, proj, x, batch))
            candidates = layer_candidates(tuned, num_tokens, rank_pad(rank))
            times = layer_times(layer, xs, candidates, batch, args.rounds, model.qk_norm)
            chosen = min((name for name in times if name != "base"), key=times.__getitem__)
            print(f"  -> {chosen}   (layer us: {'  '.join(f'{p} {us:.1f}' for p, us in times.items())})", flush=True)
            for (_, k, widths), plan in zip(shapes, candidates[chosen], strict=True):
                entry = {"k": k, "widths": list(widths), "rank_pad": rank_pad(rank), "max_tokens": num_tokens}
                plans.append(entry | plan.to_json())
            write()
        del layer
        torch.cuda.empty_cache()
    print(f"# wrote {len(plans)} plans to {path} in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
