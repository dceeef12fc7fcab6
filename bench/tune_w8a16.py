"""Tune the W8A16 GEMM's launch plans for this GPU; writes kernels/configs/w8a16_<GPU>.json.

    python -m bench.tune_w8a16 [--shapes llama-3-8b] [--tokens 1 8 16 32 48 64] [--budget-s 140] [--out FILE]

--shapes picks the projections whose weights are tuned (bench.lora_kernels.MODELS; a projection's
N is its slices' widths summed): llama-3-8b, qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672
and down 14336 -> 4096; qwen3-30b-a3b, its attention's qkv and o. For each token bucket T in
ascending order (a GEMM of T tokens takes the smallest bucket >= T), then each projection, the tuner
(kernels/quant/w8a16_tuning.py, whose docstring has the details) checks its candidate plans against
the reference and times them (CUDA-graph replays, L2 flushed before each, as bench.quant_kernels
times them), varies the fastest's warps and stages, and times the finalists and the default plan
again in turn. Each cell's plan is merged into --out (default: the packaged table of this GPU)
as soon as it is chosen; cells the --budget-s did not reach keep what the file held, or take the
default plan. Printed at the end, per cell: the plan chosen, its time, the fraction of its byte
roofline it reaches (bench.quant_kernels.roofline_us at the measured copy bandwidth), and the
default plan beside it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.lora_kernels import MODELS, copy_bandwidth
from bench.quant_kernels import roofline_us
from kernels.quant.w8a16_plans import config_file
from kernels.quant.w8a16_tuning import TOKEN_BUCKETS, CellResult, tune_cells

HEADER = (
    "| projection | N | K | M | plan | µs | × roof | default plan | µs | × roof | default / plan |\n"
    "| --- | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: |"
)


def projections(model: str) -> dict[tuple[int, int], str]:
    """(N, K) → projection name, for the model's dense projections."""
    return {(sum(p.widths), p.k): p.name for p in MODELS[model].projections}


def format_row(name: str, r: CellResult, bandwidth: float) -> str:
    roof = roofline_us(r.n, r.k, r.num_tokens, 1, bandwidth)
    return (
        f"| {name} | {r.n} | {r.k} | {r.num_tokens} | {r.plan.describe()} | {r.us:.1f} | {roof / r.us:.2f} | "
        f"{r.default.describe()} | {r.default_us:.1f} | {roof / r.default_us:.2f} | {r.default_us / r.us:.2f}× |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=MODELS, default="llama-3-8b", help="whose projection weights to tune")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKEN_BUCKETS))
    parser.add_argument("--budget-s", type=float, default=140.0, help="stop after this many seconds (0: no limit)")
    parser.add_argument("--out", type=Path, help="the plan file to merge into (default: this GPU's packaged one)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.tune_w8a16 needs a CUDA GPU")
    if any(t < 1 for t in args.tokens):
        raise SystemExit(f"--tokens must be >= 1, not {args.tokens}")

    start = time.monotonic()
    device = torch.cuda.get_device_name()
    path = args.out or config_file(device)
    names = projections(args.shapes)
    cells = [(n, k, t) for t in sorted(set(args.tokens)) for n, k in names]
    bandwidth = copy_bandwidth()
    print(f"device {device}  copy bandwidth {bandwidth / 1e12:.2f} TB/s  {len(cells)} cells into {path}", flush=True)

    def progress(r: CellResult, elapsed_s: float) -> None:
        print(f"# {names[r.n, r.k]} M={r.num_tokens}: {r.plan.describe()} {r.us:.1f} µs "
              f"(default {r.default_us:.1f} µs; {r.timed} timed, {r.dropped} dropped) at {elapsed_s:.0f} s",
              flush=True)  # fmt: skip

    run = tune_cells(
        cells,
        path,
        device_name=device,
        command=" ".join(["python -m bench.tune_w8a16", *sys.argv[1:]]),
        budget_s=args.budget_s or None,
        on_cell=progress,
        echo=lambda line: print(line, flush=True),
    )
    print(f"\n{device}, copy bandwidth {bandwidth / 1e12:.2f} TB/s\n{HEADER}")
    for r in run.results:
        print(format_row(names[r.n, r.k], r, bandwidth))
    if run.not_reached:
        left = ", ".join(f"{names[n, k]} M={t}" for n, k, t in run.not_reached)
        print(f"# the budget ran out before: {left}")
    print(f"# {len(run.results)} plans merged into {path} in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
