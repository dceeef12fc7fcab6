"""Tune the multi-LoRA launch configurations and paths for this GPU; writes kernels/configs/<GPU>.json.

    python -m bench.tune_lora [--model llama-3-8b] [--tokens 1 8 32 64 96 ... 4096] [--ranks 16 64]
                              [--adapters N]

--model picks the layer whose projection shapes are tuned (bench.lora_kernels.MODELS): llama-3-8b,
its qkv, o, gate_up and down; qwen3-30b-a3b, its attention's qkv and o (its experts are
bench.tune_moe's). For each rank and token bucket T (a batch past the largest bucket takes it, so
let the largest cover the model's prefill chunk), with as many adapters as a served step of T tokens
carries (16 up to 64 tokens, 40 above; --adapters N: min(T, N) in every bucket), the tuner
(kernels/lora/tuning/tuner.py, whose docstring has the details):
  1. per projection shape of the layer, times each kernel's candidate configurations alone, with
     L2 flushed, and keeps the fastest of each;
  2. times the whole layer as the decoder calls it along each path with those configurations (the
     overlap path once per shrink split), candidates in turn, --rounds times over, and records the
     candidate with the lowest median for batches of up to T tokens (--paths-only: only this step,
     on the stored configurations). Paths are chosen per layer, not per projection.
Plans of the shapes, ranks and buckets not tuned again are kept from the existing file. `lorafleet tune` tunes a
model's own shapes the same way, from its checkpoint's config.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.lora_kernels import MODELS
from kernels.lora.configs import Plan, PlanKey, config_file, read_plans
from kernels.lora.tuning import LayerTuner, update_plan_file
from worker.kernel_plans import TOKEN_LADDER


def stored_plans(
    existing: dict[tuple[PlanKey, int], Plan], keys: list[PlanKey], rank: int, num_tokens: int
) -> list[Plan]:
    """The plans a previous run stored for these shapes at this bucket (for --paths-only)."""
    try:
        return [existing[key, num_tokens] for key in keys]
    except KeyError as missing:
        (k, widths, _), _ = missing.args[0]
        raise SystemExit(f"--paths-only: no stored plan for K={k} widths={widths} rank={rank} T={num_tokens}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="llama-3-8b", help="whose projection shapes to tune")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKEN_LADDER))
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument(
        "--adapters",
        type=int,
        help="distinct adapters per batch, capped at T (default: as served, 16 up to 64 tokens, 40 above)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timings of each path per layer")
    parser.add_argument(
        "--paths-only", action="store_true", help="keep the stored kernel configurations, choose paths again"
    )
    args = parser.parse_args()

    device = torch.cuda.get_device_name()
    path = config_file(device)
    existing = read_plans(path)
    model = MODELS[args.model]
    command = " ".join(["python -m bench.tune_lora", *sys.argv[1:]])
    tuned: dict[tuple[PlanKey, int], Plan] = {}

    start = time.time()
    for rank in args.ranks:
        tuner = LayerTuner(
            model, rank, adapters=args.adapters, rounds=args.rounds, echo=lambda line: print(line, flush=True)
        )
        for num_tokens in args.tokens:
            print(f"# r{rank} T={num_tokens} ({time.time() - start:.0f} s)", flush=True)
            kernels = stored_plans(existing, tuner.keys(), rank, num_tokens) if args.paths_only else None
            result = tuner.tune(num_tokens, kernels=kernels)
            times = "  ".join(f"{p} {us:.1f}" for p, us in result.layer_us.items())
            print(f"  -> {result.chosen}   (layer us: {times})", flush=True)
            tuned |= {(key, num_tokens): plan for key, plan in zip(tuner.keys(), result.plans, strict=True)}
            # after every bucket, so an interrupted run keeps what it measured
            total = update_plan_file(path, device, command, tuned)
        tuner.close()
    print(f"# wrote {total} plans to {path} in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
