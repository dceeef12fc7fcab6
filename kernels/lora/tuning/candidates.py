"""The launch configurations the tuner times for a batch of `num_tokens` tokens at padded rank
`r_pad`: a small sweep per kernel, narrowed by what measured pointless (see each bound)."""

from __future__ import annotations

import dataclasses

from kernels.lora.configs import PATHS, ExpandConfig, FusedConfig, GatherConfig, Plan, ShrinkConfig, SingleLaunchConfig

FUSED_MAX_TOKENS = 256  # above, the fused kernel's re-reads of A make it pointless to time
GATHER_MAX_TOKENS = 256  # above, the gathering expand's CUDA-core products make it pointless to time


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


def single_candidates(num_tokens: int, r_pad: int) -> list[SingleLaunchConfig]:
    # 64 or 132 programs a role, or one per K chunk and output tile: beside a GEMM the wider grid
    # contends for its SMs
    return [
        SingleLaunchConfig(block_k=bk, block_n=bn, max_programs=programs)
        for bk in (64, 128)
        for bn in (32, 64)
        for programs in (64, 132, 1024)
    ]


def shrink_candidates(num_tokens: int, r_pad: int) -> list[ShrinkConfig]:
    # past 256 tokens a step is mixed (tuning/layer.py): its decodes sit in groups of a few tokens
    block_ms = (16,) if num_tokens <= 256 else (16, 32, 64)
    # expand reads all partials of z: past 8 they cost it more than they save the shrink
    splits = (2, 4, 8) if num_tokens <= 256 else (1, 2, 4)
    block_ks = (64, 128) if r_pad >= 64 else (128, 256)
    # a decode-sized shrink runs about one program per SM, so what it keeps in flight is its stages'
    # loads: a third stage cut the layer 5% at 96 tokens and 40 adapters on an H100 (docs/benchmarks.md)
    stages = (2, 3, 4)
    return [
        ShrinkConfig(block_m=bm, block_k=bk, split_k=sk, num_stages=st)
        for bm in block_ms
        for bk in block_ks
        for sk in splits
        for st in stages
    ]


def expand_candidates(num_tokens: int, r_pad: int) -> list[ExpandConfig]:
    decode_walks = ((64, 64), (128, 512), (128, 2048), (256, 1024), (256, 4096))
    prefill_walks = ((128, 128), (128, 1024), (256, 256), (256, 2048))
    # (block_m, its (block_n, n_chunk) walks); a mixed step's decodes want the small token tiles
    tiles = [(16, decode_walks)]
    if num_tokens > 256:
        tiles += [(64, prefill_walks), (128, prefill_walks)]
    return [
        ExpandConfig(block_m=bm, block_n=bn, n_chunk=chunk, num_warps=4 if bn <= 128 else 8, num_stages=3)
        for bm, walks in tiles
        for bn, chunk in walks
    ]


def layer_candidates(plans: list[Plan], num_tokens: int, r_pad: int) -> dict[str, list[Plan]]:
    """Step 2's candidates, one plan per projection each: every path with step 1's configurations,
    the overlap path once per shrink split (beside a GEMM, the split that is fastest alone contends
    with it for SMs)."""
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
