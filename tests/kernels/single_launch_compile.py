"""Compile the single-launch LoRA kernel for sm_90 ahead of time, no GPU needed (run by
tests/kernels/test_lora_single_launch.py outside the interpreter): per slice count and mode, its
atomic and acquiring operations and its loads from L2, as PTX names them."""

from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.lora.configs import SingleLaunchConfig
from kernels.lora.single_launch import _single_launch_kernel

HOPPER = GPUTarget("cuda", 90, 32)


def ptx(num_slices: int, accumulate: bool) -> str:
    """PTX of a bf16 launch of rank 16 in pages of 16, up to 6 tokens, in the default configuration."""
    config = SingleLaunchConfig()
    constants = {
        "NUM_SLICES": num_slices, "PR": 16, "R_PAD": 16, "BLOCK_T": 8,
        "BLOCK_K": config.block_k, "BLOCK_N": config.block_n, "ACCUMULATE": accumulate,
    }  # fmt: skip
    pointers = {"x_ptr": "*bf16", "y_ptr": "*bf16", "z_ptr": "*fp32", "sorted_scales_ptr": "*fp32"}
    signature = {}
    for name in _single_launch_kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*bf16" if name[0] in "ab" else "*i32")
        else:
            signature[name] = "i32"
    source = ASTSource(_single_launch_kernel, signature, constexprs=constants)
    compiled = triton.compile(source, target=HOPPER, options={"num_warps": config.num_warps})
    if not compiled.asm["cubin"]:
        raise RuntimeError(f"{num_slices} slices, accumulate={accumulate}: no cubin")
    return compiled.asm["ptx"]


if __name__ == "__main__":
    for num_slices in (1, 2, 3):
        for accumulate in (False, True):
            text = ptx(num_slices, accumulate)
            ordered = sorted(set(re.findall(r"(?:atom|red)\.global[\w.]+|ld\.global\.(?:gpu\.acquire|cg)[\w.]*", text)))
            print(f"slices={num_slices} accumulate={accumulate} {' '.join(ordered)}", flush=True)
