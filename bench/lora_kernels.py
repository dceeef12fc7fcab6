"""Multi-LoRA overhead per decoder layer (Llama-3-8B's by default), on a CUDA GPU.

    python -m bench.lora_kernels [--model llama-3-8b] [--tokens 1 8 32 ...] [--adapters 1 8 16 64]
                                 [--ranks 16 64] [--page-rank N] [--out FILE]

One "layer" is a model's adapted dense projections in bf16 (MODELS): for llama-3-8b qkv
(4096 -> 4096|1024|1024), o (4096 -> 4096), gate_up (4096 -> 14336|14336), down (14336 -> 4096); for
qwen3-30b-a3b its attention, qkv (2048 -> 4096|512|512) and o (4096 -> 2048) (its experts are
bench.tune_moe's). Per case it times, as medians of CUDA-graph replays (triton.testing.do_bench_cudagraph):
    base      the projections' F.linear calls
    +LoRA     their lora_linear calls as the dispatcher picks them (path shown per projection:
              f(used), s(plit), o(verlap)), and each path forced for all of them
    served    the layer as the decoder calls it: qkv and gate_up leave their delta to the next fused
              kernel (lora_linear_deferred), o and down add theirs into the residual stream, so on
              the overlap path the whole update runs beside the base GEMM; plus what reading the
              delta adds after qkv and gate_up (RoPE + KV write, or for a model with q/k norms the
              separate add before them; SiLU·up), timed with and without (kernels/lora/tuning/timing.py)
The LoRA metadata is built once per engine step, outside the layer (its time is printed apart).

Token layout (kernels/lora/tuning/layer.py): up to 256 tokens are decode tokens, each of its own
request, adapters spread evenly and shuffled; above, a mixed step of 128 such decodes and prefill
chunks of at most 256 tokens, one adapter each. Adapters sit in random slots of a 64-slot pool
whose max rank is the case's rank, stored in pages of --page-rank rank rows (default: as the engine
pages the model's adapters, 16 for llama-3-8b, one page of the whole rank for an MoE model)
scattered over the page pool in random order (--page-rank 0: the unpaged layout, one page of the
case's rank per slot).

Byte floor: what LoRA must move beyond the base GEMM if the update rides in the GEMM's epilogue:
each distinct adapter's A and B once, plus x once for the shrink, at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.lora import LoRABatch, linear_with_plan, lora_linear, plan_for_batch
from kernels.lora.configs import PATHS
from kernels.lora.tuning import LayerShapes, ProjectionShape
from kernels.lora.tuning.candidates import FUSED_MAX_TOKENS
from kernels.lora.tuning.layer import Projection, make_batch, make_layer
from kernels.lora.tuning.timing import delta_read_us, median_us, served_us

LLAMA3_8B = (
    ProjectionShape("qkv", 4096, (4096, 1024, 1024)),
    ProjectionShape("o", 4096, (4096,)),
    ProjectionShape("gate_up", 4096, (14336, 14336)),
    ProjectionShape("down", 14336, (4096,)),
)
# bench/moe.py's model: hidden 2048, 32 q / 4 kv heads of 128; only attention is dense
QWEN3_30B_A3B_ATTENTION = (
    ProjectionShape("qkv", 2048, (4096, 512, 512)),
    ProjectionShape("o", 4096, (2048,)),
)
PAGE_RANK = 16  # worker.model.lora_linear.PAGE_RANK
# worker.model.model: MoE models take one page of the whole max rank per adapter
MODELS = {
    "llama-3-8b": LayerShapes(LLAMA3_8B, page_rank=PAGE_RANK),
    "qwen3-30b-a3b": LayerShapes(QWEN3_30B_A3B_ATTENTION, page_rank=0, qk_norm=True),
}


def copy_bandwidth() -> float:
    """Device-to-device copy through the SMs, bytes read + written per second. (Not Tensor.copy_:
    captured in a graph it becomes a memcpy node, which measured 2.77 TB/s on an H200 against
    4.26 TB/s for an elementwise kernel.)"""
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB of float32
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / (median_us(lambda: torch.add(src, 0.0, out=dst)) * 1e-6)


def floor_bytes(layer: list[Projection], num_tokens: int, adapters: int) -> int:
    return sum(adapters * p.adapter_bytes() + num_tokens * p.k * 2 for p in layer)


def run_case(
    layer: list[Projection], shapes: LayerShapes, num_tokens: int, adapters: int, rank: int, bandwidth: float
) -> dict:
    page_rank = shapes.page_rank
    xs = [torch.randn(num_tokens, p.k, device="cuda").to(torch.bfloat16) for p in layer]
    batch = make_batch(num_tokens, adapters, rank, page_rank=page_rank)

    def base() -> None:
        for p, x in zip(layer, xs, strict=True):
            F.linear(x, p.weight)

    def auto() -> None:
        for p, x in zip(layer, xs, strict=True):
            lora_linear(x, p.weight, None, p.lora_a, p.lora_b, batch)

    picked = [plan_for_batch(x, p.lora_a, p.lora_b, batch) for p, x in zip(layer, xs, strict=True)]

    def forced(path: str) -> Callable[[], None]:
        plans = [
            dataclasses.replace(plan_for_batch(x, p.lora_a, p.lora_b, batch), path=path)
            for p, x in zip(layer, xs, strict=True)
        ]

        def run() -> None:
            for plan, p, x in zip(plans, layer, xs, strict=True):
                linear_with_plan(plan, x, p.weight, None, p.lora_a, p.lora_b, batch)

        return run

    # base, LoRA, base: clocks drift under the long prefill GEMMs, so base is the mean around LoRA
    base_before = median_us(base)
    lora_us = median_us(auto)
    result = {
        "tokens": num_tokens,
        "adapters": adapters,
        "rank": rank,
        "page_rank": page_rank,
        "base_us": (base_before + median_us(base)) / 2,
        "lora_us": lora_us,
        "served_us": served_us(
            layer, xs, picked, batch, delta_read_us(layer, num_tokens, qk_norm=shapes.qk_norm, head_dim=shapes.head_dim)
        ),
        "paths": [plan.path for plan in picked],
        "build_us": median_us(
            lambda: LoRABatch.build(batch.token_slots, batch.slot_ranks, batch.slot_scales, batch.slot_pages)
        ),
        "floor_us": floor_bytes(layer, num_tokens, adapters) / bandwidth * 1e6,
    }
    for path in PATHS:
        if path != "fused" or num_tokens <= FUSED_MAX_TOKENS:
            result[f"{path}_us"] = median_us(forced(path))
    return result


def format_row(r: dict) -> str:
    over = lambda us: f"{100 * (us - r['base_us']) / r['base_us']:6.1f}"  # noqa: E731
    lora = r["lora_us"] - r["base_us"]
    paths = "".join(p[0] for p in r["paths"])  # per projection: f(used), s(plit), o(verlap)
    per_path = " ".join(over(r[f"{p}_us"]) if f"{p}_us" in r else "     -" for p in PATHS)
    return (
        f"{r['tokens']:5d} {r['adapters']:4d} {r['rank']:4d} {r['base_us']:9.1f} {lora:8.1f} {over(r['lora_us'])} "
        f"{over(r['served_us'])} "
        f"{paths:>5} {per_path} {r['floor_us']:8.1f} {100 * r['floor_us'] / r['base_us']:6.1f} "
        f"{lora / r['floor_us']:6.2f} {r['build_us']:6.1f}"
    )


HEADER = "    T    d    r   base_us  lora_us  over% servd%  path fused% split% ovlap%  floor_us floor% x_flr build_us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="llama-3-8b", help="whose projections form the layer")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 256, 1024, 4096])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 16, 64])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--page-rank", type=int, help="rank rows per page; 0: unpaged (default: as served)")
    parser.add_argument("--out", help="write all measurements as JSON here")
    args = parser.parse_args()
    model = MODELS[args.model]
    if args.page_rank is not None:
        model = dataclasses.replace(model, page_rank=args.page_rank)
    page_rank = model.page_rank

    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    device = torch.cuda.get_device_name()
    pages = f"pages of {page_rank} ranks" if page_rank else "unpaged"
    print(f"# {args.model}, {device}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, {pages}")
    print(HEADER, flush=True)
    results = []
    start = time.time()
    for rank in args.ranks:
        layer = make_layer(rank, model.projections, page_rank=page_rank)
        for num_tokens in args.tokens:
            for adapters in args.adapters:
                if adapters > num_tokens:
                    continue
                results.append(run_case(layer, model, num_tokens, adapters, rank, bandwidth))
                print(format_row(results[-1]), flush=True)
        del layer
        torch.cuda.empty_cache()
    print(f"# {len(results)} cases in {time.time() - start:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            document = {"model": args.model, "device": device, "copy_bandwidth": bandwidth, "results": results}
            json.dump(document, f, indent=1)


if __name__ == "__main__":
    main()
