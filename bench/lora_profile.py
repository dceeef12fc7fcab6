"""One decoder layer's LoRA kernels, each launched as its plan runs it, for a kernel profiler.

    ncu --clock-control none -k regex:"_shrink_kernel|_expand" --section SpeedOfLight \\
        --section LaunchStats --section Occupancy --section WarpStateStats \\
        python -m bench.lora_profile [--tokens 96] [--adapters 40] [--repeats 3]

Llama-3-8B's layer (bench.lora_kernels.MODELS) at rank 16 with the served token layout
(kernels/lora/tuning/layer.py): for each projection, the plan the dispatcher picks for this GPU and
batch, then its shrink and expand (or gathering expand) `--repeats` times, outside any graph, so a
profiler sees every launch with its grid. The projections that add into the residual stream (o,
down) accumulate as served; qkv and gate_up write their delta. Prints each projection's plan.
What ncu showed at 96 tokens and 40 adapters on an H100: docs/benchmarks.md, issue #20.
"""

from __future__ import annotations

import argparse

import torch

from bench.lora_kernels import MODELS
from kernels.lora import plan_for_batch
from kernels.lora.paths import expand_with_plan
from kernels.lora.shrink import lora_shrink
from kernels.lora.tiles import slice_groups
from kernels.lora.tuning.layer import make_batch, make_layer
from kernels.lora.tuning.timing import RESIDUAL_PROJECTIONS


def run_layer_kernels(num_tokens: int, adapters: int, repeats: int, rank: int = 16) -> list[str]:
    """Launch each projection's LoRA kernels `repeats` times; returns a line per projection naming its plan."""
    shapes = MODELS["llama-3-8b"]
    layer = make_layer(rank, shapes.projections, page_rank=shapes.page_rank)
    batch = make_batch(num_tokens, adapters, rank, page_rank=shapes.page_rank)
    lines = []
    for projection in layer:
        x = torch.randn(num_tokens, projection.k, device="cuda", dtype=torch.bfloat16)
        plan = plan_for_batch(x, projection.lora_a, projection.lora_b, batch)
        y = torch.zeros(num_tokens, sum(projection.widths), device="cuda", dtype=torch.bfloat16)
        accumulate = projection.name in RESIDUAL_PROJECTIONS
        for _ in range(repeats):
            for group in slice_groups(projection.lora_a, projection.lora_b):
                z = lora_shrink(x, group, batch, plan.shrink)
                expand_with_plan(plan, y, z, group, batch, accumulate=accumulate)
        lines.append(f"{projection.name}: {plan.path}, shrink {plan.shrink}, expand {plan.gather or plan.expand}")
    torch.cuda.synchronize()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--adapters", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.lora_profile needs a CUDA GPU")
    for line in run_layer_kernels(args.tokens, args.adapters, args.repeats):
        print(line)


if __name__ == "__main__":
    main()
