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
              separate add before them; SiLU·up), timed with and without
The LoRA metadata is built once per engine step, outside the layer (its time is printed apart).

Token layout: up to 256 tokens are decode tokens, each of its own request, adapters spread evenly
and shuffled; above, d prefill requests of T/d contiguous tokens, one adapter each. Adapters sit in
random slots of a 64-slot pool whose max rank is the case's rank, stored in pages of --page-rank
rank rows (default: as the engine pages the model's adapters, 16 for llama-3-8b, one page of the
whole rank for an MoE model) scattered over the page pool in random order (--page-rank 0: the
unpaged layout, one page of the case's rank per slot).

Byte floor: what LoRA must move beyond the base GEMM if the update rides in the GEMM's epilogue:
each distinct adapter's A and B once, plus x once for the shrink, at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from kernels.fused import rope_and_cache_kv, silu_and_mul
from kernels.lora import LoRABatch, linear_deferred_with_plan, linear_with_plan, lora_linear, plan_for_batch
from kernels.lora.configs import PATHS, Plan

RESIDUAL_PROJECTIONS = ("o", "down")  # their outputs are added to the residual stream next
HEAD_DIM = 128  # both models': q heads = q width / HEAD_DIM, kv heads = k width / HEAD_DIM
# name, K, slice widths
Shapes = tuple[tuple[str, int, tuple[int, ...]], ...]
LLAMA3_8B: Shapes = (
    ("qkv", 4096, (4096, 1024, 1024)),
    ("o", 4096, (4096,)),
    ("gate_up", 4096, (14336, 14336)),
    ("down", 14336, (4096,)),
)
# bench/moe.py's model: hidden 2048, 32 q / 4 kv heads of 128; only attention is dense
QWEN3_30B_A3B_ATTENTION: Shapes = (
    ("qkv", 2048, (4096, 512, 512)),
    ("o", 4096, (2048,)),
)
POOL_SLOTS = 64
PAGE_RANK = 16  # worker.engine.lora_linear.PAGE_RANK


@dataclass(frozen=True)
class ModelLayer:
    """A model's adapted dense projections, and how the engine serves them."""

    shapes: Shapes
    page_rank: int  # rank rows per adapter page as the engine pages them; 0: one page of the whole rank
    qk_norm: bool = False  # q/k heads normalised before RoPE: the qkv delta is added by a pass of its own


# worker.engine.model: MoE models take one page of the whole max rank per adapter
MODELS = {
    "llama-3-8b": ModelLayer(LLAMA3_8B, page_rank=PAGE_RANK),
    "qwen3-30b-a3b": ModelLayer(QWEN3_30B_A3B_ATTENTION, page_rank=0, qk_norm=True),
}
DECODE_MAX_TOKENS = 256
FUSED_BENCH_MAX_TOKENS = 256  # the fused path re-reads A per token tile: pointless to time above


@dataclass
class Projection:
    name: str
    rank: int  # every adapter's
    weight: torch.Tensor  # [sum N_i, K]
    lora_a: list[torch.Tensor]  # [P, PR, K] per slice
    lora_b: list[torch.Tensor]  # [P, N_i, PR] per slice

    @property
    def k(self) -> int:
        return self.weight.shape[1]

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(b.shape[1] for b in self.lora_b)

    def adapter_bytes(self) -> int:
        """Bytes of one adapter's A and B over all slices."""
        return sum(self.rank * (a.shape[2] + b.shape[1]) for a, b in zip(self.lora_a, self.lora_b, strict=True)) * 2


def pages_per_slot(rank: int, page_rank: int) -> int:
    """Pages an adapter of this rank takes (page_rank 0: the unpaged layout, one page)."""
    return math.ceil(rank / page_rank) if page_rank else 1


def make_layer(
    rank: int, shapes: Shapes = LLAMA3_8B, slots: int = POOL_SLOTS, page_rank: int = PAGE_RANK
) -> list[Projection]:
    """The layer's projections with a pool of `slots` adapters of this rank, in pages of page_rank
    rows (0: unpaged)."""
    pages, rows = slots * pages_per_slot(rank, page_rank), page_rank or rank

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)

    return [
        Projection(
            name=name,
            rank=rank,
            weight=rand(sum(widths), k, scale=k**-0.5),
            lora_a=[rand(pages, rows, k, scale=k**-0.5) for _ in widths],
            lora_b=[rand(pages, n, rows, scale=rank**-0.5) for n in widths],
        )
        for name, k, widths in shapes
    ]


def token_slots(num_tokens: int, adapters: int, slots: int = POOL_SLOTS, seed: int = 0) -> torch.Tensor:
    """Slot of each token (see the module docstring for the layout)."""
    rng = random.Random(seed)
    chosen = rng.sample(range(slots), adapters)
    if num_tokens <= DECODE_MAX_TOKENS:
        per_token = [chosen[i % adapters] for i in range(num_tokens)]
        rng.shuffle(per_token)
    else:
        run = math.ceil(num_tokens / adapters)
        per_token = [chosen[min(i // run, adapters - 1)] for i in range(num_tokens)]
    return torch.tensor(per_token, dtype=torch.int32, device="cuda")


def make_batch(
    num_tokens: int, adapters: int, rank: int, slots: int = POOL_SLOTS, page_rank: int = PAGE_RANK
) -> LoRABatch:
    """The step's metadata, with every slot's pages drawn at random from the layer's page pool."""
    ranks = torch.full((slots,), rank, dtype=torch.int32, device="cuda")
    scales = torch.full((slots,), 2.0, dtype=torch.float32, device="cuda")
    per_slot = pages_per_slot(rank, page_rank)
    pages = torch.randperm(slots * per_slot, generator=torch.Generator().manual_seed(1)).reshape(slots, per_slot)
    return LoRABatch.build(token_slots(num_tokens, adapters, slots), ranks, scales, pages.to("cuda"))


def median_us(fn: Callable[[], object], rep_ms: int = 25) -> float:
    return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """Device-to-device copy through the SMs, bytes read + written per second. (Not Tensor.copy_:
    captured in a graph it becomes a memcpy node, which measured 2.77 TB/s on an H200 against
    4.26 TB/s for an elementwise kernel.)"""
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB of float32
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / (median_us(lambda: torch.add(src, 0.0, out=dst)) * 1e-6)


def floor_bytes(layer: list[Projection], num_tokens: int, adapters: int) -> int:
    return sum(adapters * p.adapter_bytes() + num_tokens * p.k * 2 for p in layer)


def run_served(
    layer: list[Projection], xs: list[torch.Tensor], plans: list[Plan], batch: LoRABatch, residual: torch.Tensor
) -> None:
    """The layer as the decoder calls it, along `plans`: qkv and gate_up leave their delta to the next
    fused kernel (not run here), o and down add theirs into `residual` [T, hidden]."""
    for plan, p, x in zip(plans, layer, xs, strict=True):
        args = (plan, x, p.weight, None, p.lora_a, p.lora_b, batch)
        if p.name in RESIDUAL_PROJECTIONS:
            linear_with_plan(*args, residual=residual)
        else:
            linear_deferred_with_plan(*args)


def attention_heads(widths: tuple[int, ...]) -> tuple[int, int]:
    """(q heads, kv heads) of a qkv projection with slice widths (q, k, v), heads of HEAD_DIM."""
    if len(widths) != 3 or widths[1] != widths[2] or any(w % HEAD_DIM for w in widths):
        raise ValueError(f"qkv widths {widths} are not (q, k, v) of whole {HEAD_DIM}-wide heads with k = v")
    return widths[0] // HEAD_DIM, widths[1] // HEAD_DIM


def delta_consumer(p: Projection, num_tokens: int) -> Callable[[torch.Tensor | None], object] | None:
    """The fused kernel that reads p's deferred delta [T, sum N_i] (its argument; None: without one),
    on tensors of p's shapes: RoPE + KV-cache write after qkv, SiLU·up after gate_up; None for a
    projection whose delta is not deferred."""
    if p.name not in ("qkv", "gate_up"):
        return None
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    out = torch.randn(num_tokens, sum(p.widths), **bf16)
    if p.name == "gate_up":
        return lambda delta: silu_and_mul(out, delta)
    heads, kv_heads = attention_heads(p.widths)
    cos, sin = torch.randn(num_tokens, HEAD_DIM, **bf16), torch.randn(num_tokens, HEAD_DIM, **bf16)
    caches = [torch.empty(-(-num_tokens // 16), 16, kv_heads, HEAD_DIM, **bf16) for _ in range(2)]
    slots = torch.arange(num_tokens, device="cuda")
    return lambda delta: rope_and_cache_kv(out, cos, sin, *caches, slots, heads, delta)


def delta_read_us(layer: list[Projection], num_tokens: int, *, qk_norm: bool = False) -> dict[str, float]:
    """What reading a deferred LoRA delta adds after each deferred projection of the layer (us): its
    consumer (delta_consumer) timed with and without the delta; with qk_norm, the qkv delta's own add,
    which the decoder runs before the q/k norms (worker.engine.layers.SelfAttention), RoPE then
    running without it."""
    added = {}
    for p in layer:
        if (consume := delta_consumer(p, num_tokens)) is None:
            continue
        delta = torch.randn(num_tokens, sum(p.widths), device="cuda", dtype=torch.bfloat16)
        if p.name == "qkv" and qk_norm:
            added[p.name] = _add_us(delta)
        else:
            added[p.name] = max(0.0, _consume_us(consume, delta) - _consume_us(consume, None))
    return added


def _add_us(delta: torch.Tensor) -> float:
    out = torch.randn_like(delta)
    return median_us(lambda: out.add_(delta))


def _consume_us(consume: Callable[[torch.Tensor | None], object], delta: torch.Tensor | None) -> float:
    return median_us(lambda: consume(delta))


def served_us(
    layer: list[Projection],
    xs: list[torch.Tensor],
    plans: list[Plan],
    batch: LoRABatch,
    delta_reads: dict[str, float],
) -> float:
    """The served layer's time (us): run_served, plus the delta reads of the projections it defers."""
    hidden = {p.weight.shape[0] for p in layer if p.name in RESIDUAL_PROJECTIONS}
    if len(hidden) > 1:
        raise ValueError(f"residual projections of different widths {sorted(hidden)}")
    residual = torch.zeros(xs[0].shape[0], max(hidden, default=0), device="cuda", dtype=torch.bfloat16)
    deferred = sum(delta_reads.get(p.name, 0.0) for p, plan in zip(layer, plans, strict=True) if plan.path == "overlap")
    return median_us(lambda: run_served(layer, xs, plans, batch, residual)) + deferred


def run_case(
    layer: list[Projection],
    num_tokens: int,
    adapters: int,
    rank: int,
    page_rank: int,
    bandwidth: float,
    *,
    qk_norm: bool = False,
) -> dict:
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
        "served_us": served_us(layer, xs, picked, batch, delta_read_us(layer, num_tokens, qk_norm=qk_norm)),
        "paths": [plan.path for plan in picked],
        "build_us": median_us(
            lambda: LoRABatch.build(batch.token_slots, batch.slot_ranks, batch.slot_scales, batch.slot_pages)
        ),
        "floor_us": floor_bytes(layer, num_tokens, adapters) / bandwidth * 1e6,
    }
    for path in PATHS:
        if path != "fused" or num_tokens <= FUSED_BENCH_MAX_TOKENS:
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


HEADER = (
    "    T    d    r   base_us  lora_us  over% servd%  path fused% split% ovlap%  floor_us floor% x_flr build_us"
)


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
    page_rank = model.page_rank if args.page_rank is None else args.page_rank

    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    device = torch.cuda.get_device_name()
    pages = f"pages of {page_rank} ranks" if page_rank else "unpaged"
    print(f"# {args.model}, {device}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, {pages}")
    print(HEADER, flush=True)
    results = []
    start = time.time()
    for rank in args.ranks:
        layer = make_layer(rank, model.shapes, page_rank=page_rank)
        for num_tokens in args.tokens:
            for adapters in args.adapters:
                if adapters > num_tokens:
                    continue
                results.append(run_case(layer, num_tokens, adapters, rank, page_rank, bandwidth, qk_norm=model.qk_norm))
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
