"""Tune and time the MoE kernels on a CUDA GPU at one model's MoE shapes (default Qwen3-30B-A3B:
hidden 2048, 128 experts, top-8, expert width 768), with a LoRA of rank --rank on every expert in
--adapters slots, tokens spread round-robin over the adapters.

    python -m bench.tune_moe [--tokens 1 8 32 256 1600] [--rank 32] [--adapters 8] [--write]

Per token count (pairs = tokens × top-k): a small sweep of launch configurations per kernel, the
best kept (--write: into kernels/configs/moe_<GPU>.json, which kernels/moe/configs.py reads).
Printed per token count, each a median of triton.testing.do_bench, with the tuned configurations:
    base MoE   routing + alignment + both grouped GEMMs + activation + top-k sum (the whole layer)
    MoE+LoRA   the same with every token's adapter on every expert
    gu shrink / gu expand / dn shrink / dn expand   the four MoE-LoRA kernels
    align / lora align   the pair metadata by expert, and by (adapter, expert)
    roofline   the base layer's active expert weights read once at the measured copy bandwidth
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import sys
from collections.abc import Callable
from functools import partial

import torch
import triton.testing

from bench.roofline import copy_bandwidth
from kernels.moe import ExpertLoRA, route
from kernels.moe.align import adapter_expert_blocks, expert_blocks
from kernels.moe.configs import GemmConfig, MoEPlan, ShrinkConfig, config_file, entry
from kernels.moe.fused import moe_triton
from kernels.moe.gemm import moe_gemm
from kernels.moe.lora_expand import moe_lora_expand
from kernels.moe.lora_shrink import moe_lora_shrink
from tests.kernels.moe_cases import make_moe_case

GEMMS = [GemmConfig(block_n=n, block_k=k, num_warps=w, num_stages=s) for n, k, w, s in
         ((64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3))]  # fmt: skip
SHRINKS = [ShrinkConfig(block_k=128, split_k=s) for s in (1, 4, 8)]
EXPANDS = [GemmConfig(block_n=n, num_stages=2) for n in (64, 128)]
BLOCK_MS = (16, 64)
Config = GemmConfig | ShrinkConfig


def ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")


def fastest(options: list[tuple[Callable[[], object], Config]]) -> tuple[float, Config]:
    """(time ms, configuration) of the fastest option."""
    return min(((ms(fn), config) for fn, config in options), key=lambda item: item[0])


def tune(num_tokens: int, args: argparse.Namespace) -> tuple[dict[tuple[str, int, int], Config], dict[str, float]]:
    """Best configurations (by kernel and shape) and the layer's times for one token count."""
    case = make_moe_case(
        num_tokens, hidden=args.hidden, width=args.width, num_experts=args.experts,
        slot_ranks=[args.rank] * args.adapters, dtype=torch.bfloat16, device="cuda", seed=num_tokens,
    )  # fmt: skip
    case.token_slots.copy_(torch.arange(num_tokens, device="cuda") % args.adapters)
    weights, ids = route(case.x @ case.router.T, args.top_k, True)
    pair_weights = weights.reshape(-1)
    num_pairs = ids.numel()
    act = torch.randn(num_pairs, args.width, device="cuda", dtype=torch.bfloat16)
    # (name, input, rows_div, base weight, LoRA A, LoRA B, routing weights): gate_up, then down
    projections = (
        ("gu", case.x, args.top_k, case.w13, case.lora.a13, case.lora.b13, None),
        ("dn", act, 1, case.w2, case.lora.a2, case.lora.b2, pair_weights),
    )
    best: dict[tuple[str, int, int], Config] = {}
    times: dict[str, float] = {}
    for name, a, rows_div, w, _, _, mul in projections:
        options = []
        for block_m, gemm in itertools.product(BLOCK_MS, GEMMS):
            config = dataclasses.replace(gemm, block_m=block_m)
            blocks = expert_blocks(ids, args.experts, block_m)
            options.append((partial(moe_gemm, a, w, blocks, rows_div, config, mul), config))
        times[f"{name} gemm"], best[("gemm", w.shape[1], w.shape[2])] = fastest(options)
    lora_options = []
    for block_m in BLOCK_MS:
        blocks = adapter_expert_blocks(ids, case.token_slots, args.adapters, args.experts, block_m)
        chosen: dict[tuple[str, int, int], Config] = {}
        parts: dict[str, float] = {}
        for name, a, rows_div, _, lora_a, lora_b, mul in projections:
            shrinks = [dataclasses.replace(s, block_m=block_m) for s in SHRINKS]
            t_shrink, shrink = fastest([(partial(moe_lora_shrink, a, lora_a, blocks, rows_div, c), c) for c in shrinks])
            z = moe_lora_shrink(a, lora_a, blocks, rows_div, shrink)
            out = torch.zeros(num_pairs, lora_b.shape[2], device="cuda", dtype=torch.bfloat16)
            expands = [dataclasses.replace(e, block_m=block_m) for e in EXPANDS]
            # or one program over a whole gate / up half (gate_up) or all of down, z loaded once
            columns = lora_b.shape[2] // 2 if name == "gu" else lora_b.shape[2]
            expands += [GemmConfig(block_m=block_m, block_n=128, n_tiles=columns // 128, num_warps=w, num_stages=s)
                        for w, s in ((4, 2), (8, 3)) if columns % 128 == 0]  # fmt: skip
            t_expand, expand = fastest(
                [(partial(moe_lora_expand, out, z, lora_b, case.slot_scales, blocks, c, mul), c) for c in expands]
            )
            chosen[("shrink", lora_a.shape[2], lora_a.shape[3])] = shrink
            chosen[("expand", lora_b.shape[2], lora_b.shape[3])] = expand
            parts[f"{name} shrink"], parts[f"{name} expand"] = t_shrink, t_expand
        lora_options.append((sum(parts.values()), chosen, parts))
    _, chosen, parts = min(lora_options, key=lambda item: item[0])
    best.update(chosen)
    times.update(parts)

    h, i, r13, r2 = args.hidden, args.width, case.lora.a13.shape[2], case.lora.a2.shape[2]
    plan = MoEPlan(best[("gemm", 2 * i, h)], best[("gemm", h, i)], best[("shrink", r13, h)],
                   best[("expand", 2 * i, r13)], best[("shrink", r2, i)], best[("expand", h, r2)])  # fmt: skip

    def layer(lora: ExpertLoRA | None = None) -> torch.Tensor:
        weights, ids = route(case.x @ case.router.T, args.top_k, True)  # routing is part of the layer
        if lora is None:
            return moe_triton(case.x, weights, ids, case.w13, case.w2, plan=plan)
        return moe_triton(case.x, weights, ids, case.w13, case.w2, lora, case.token_slots, case.slot_scales, plan)

    times["base MoE"] = ms(layer)
    times["align"] = ms(partial(expert_blocks, ids, args.experts, plan.gemm_up.block_m))
    times["lora align"] = ms(
        partial(adapter_expert_blocks, ids, case.token_slots, args.adapters, args.experts, plan.lora_block_m)
    )
    times["MoE+LoRA"] = ms(partial(layer, case.lora))
    active = torch.unique(ids).numel()
    times["active experts"] = active
    times["roofline"] = active * 3 * args.hidden * args.width * 2 / args.bandwidth * 1e3
    return best, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 256, 1600])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--write", action="store_true", help="write the tuned configurations for this GPU")
    args = parser.parse_args()
    args.bandwidth = copy_bandwidth()
    device = torch.cuda.get_device_name()
    entries, rows = [], []
    for num_tokens in sorted(args.tokens):
        best, times = tune(num_tokens, args)
        pairs = num_tokens * args.top_k
        entries += [entry(kernel, n, k, pairs, config) for (kernel, n, k), config in best.items()]
        rows.append((num_tokens, pairs, times))
        print(f"tuned T={num_tokens}: {times}", file=sys.stderr, flush=True)
    columns = ["base MoE", "MoE+LoRA", "gu shrink", "gu expand", "dn shrink", "dn expand", "align", "lora align",
               "roofline"]  # fmt: skip
    print(f"\n{device}, copy bandwidth {args.bandwidth / 1e12:.2f} TB/s; one MoE layer, ms (median); "
          f"LoRA rank {args.rank}, {args.adapters} adapters")  # fmt: skip
    print(f"| tokens | pairs | active experts | {' | '.join(columns)} |")
    print("|" + " --- |" * (len(columns) + 3))
    for num_tokens, pairs, times in rows:
        cells = " | ".join(f"{times[c]:.3f}" for c in columns)
        print(f"| {num_tokens} | {pairs} | {times['active experts']} | {cells} |")
    if args.write:
        path = config_file(device)
        path.write_text(json.dumps({
            "device": device, "date": datetime.date.today().isoformat(),
            "commands": ["python -m bench.tune_moe " + " ".join(sys.argv[1:])], "entries": entries,
        }, indent=1) + "\n")  # fmt: skip
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
