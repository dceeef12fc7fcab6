"""Compile the LoRA token-tile pieces for sm_90 ahead of time, no GPU needed (run by
tests/kernels/test_lora_metadata.py outside the interpreter): prints what a program's read of its
tile map row compiles to, then each metadata build size whose launch compiled."""

from __future__ import annotations

import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.lora.metadata import TILE_HEIGHTS, _build_kernel, max_token_tiles
from kernels.lora.tiles import token_tile

HOPPER = GPUTarget("cuda", 90, 32)
BUILDS = [(1, 1, 1), (96, 64, 4), (384, 256, 4), (4096, 256, 8)]  # (T, S, pages per slot)


@triton.jit
def _tile_probe(tile_map_ptr, out_ptr):
    group, row0, count, start = token_tile(tile_map_ptr, tl.program_id(1))
    out = out_ptr + tl.program_id(1) * 4
    tl.store(out, group)
    tl.store(out + 1, row0)
    tl.store(out + 2, count)
    tl.store(out + 3, start)


def tile_read_ptx() -> str:
    """PTX of one program's read of its row; pointers 16-byte aligned, as Triton specializes
    LoRABatch.token_tiles' views (16-byte rows) at launch."""
    aligned = [["tt.divisibility", 16]]
    source = ASTSource(
        _tile_probe, {"tile_map_ptr": "*i32", "out_ptr": "*i32"}, constexprs={}, attrs={(0,): aligned, (1,): aligned}
    )
    return triton.compile(source, target=HOPPER, options={"num_warps": 4}).asm["ptx"]


def compile_build(num_tokens: int, num_slots: int, pages_per_slot: int) -> None:
    """The metadata build's launch of LoRABatch._build_on_device at these sizes."""
    map_rows = max_token_tiles(num_tokens, num_slots + 1, TILE_HEIGHTS[0])
    constants = {
        "BLOCK_T": triton.next_power_of_2(num_tokens),
        "BINS": triton.next_power_of_2(num_slots + 2),
        "PAGES_PAD": triton.next_power_of_2(pages_per_slot),
        "ROWS_PAD": triton.next_power_of_2(map_rows + 1),
        "MIN_HEIGHT": TILE_HEIGHTS[0],
    }
    signature = {
        name: "constexpr" if name in constants else ("*fp32" if "scales" in name else "*i32")
        if name.endswith("_ptr") else "i32"
        for name in _build_kernel.arg_names
    }  # fmt: skip
    options = {"num_warps": 4 if num_tokens <= 256 else 8}
    compiled = triton.compile(ASTSource(_build_kernel, signature, constexprs=constants), target=HOPPER, options=options)
    if not compiled.asm["cubin"]:
        raise RuntimeError(f"T={num_tokens}, S={num_slots}: no cubin")


if __name__ == "__main__":
    ptx = tile_read_ptx()
    loads = re.findall(r"ld\.global\S*", ptx)
    print(f"tile-read loads={','.join(loads)} shuffles={ptx.count('shfl.sync')} barriers={ptx.count('bar.sync')}")
    for num_tokens, num_slots, pages_per_slot in BUILDS:
        compile_build(num_tokens, num_slots, pages_per_slot)
        print(f"build T={num_tokens} S={num_slots}", flush=True)
