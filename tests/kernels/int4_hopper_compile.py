"""Compile the W4A16 kernels for sm_90 ahead of time, no GPU needed (run by tests/kernels/test_int4.py
outside the interpreter): prints each activation dtype whose launches compiled."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.quant.int4_gemm import Int4Config, _int4_gemm_kernel, _int4_gemv_kernel

LAUNCHES = [  # (activations, launch, dequantization: the kernels' DEQUANT)
    ("bf16", Int4Config(16, 64, 128, 8, 4, 4), "affine"),  # decode, split-K with its arrival counters
    ("fp16", Int4Config(64, 64, 128, 2, 4, 4), "affine"),
    ("bf16", Int4Config(64, 128, 64, 2, 4, 4), "affine"),  # a batch of 65-256 rows
    ("fp32", Int4Config(128, 128, 64, 1, 8, 4), "affine"),  # prefill, float32 products
    ("bf16", Int4Config(1, 128, 128, 16, 4, 3, gemv=True), "affine"),  # decode of one sequence on the CUDA cores
    ("fp16", Int4Config(1, 64, 64, 2, 2, 2, gemv=True), "affine"),
    ("bf16", Int4Config(16, 64, 64, 8, 4, 4), "nf4"),  # codebooks in registers (inline PTX)
    ("bf16", Int4Config(128, 128, 64, 1, 8, 4), "nf4"),
    ("bf16", Int4Config(1, 128, 64, 16, 4, 3, gemv=True), "nf4"),
    ("bf16", Int4Config(16, 64, 64, 8, 4, 4), "fp4"),
    ("bf16", Int4Config(1, 128, 64, 16, 4, 3, gemv=True), "fp4"),
    ("bf16", Int4Config(16, 64, 64, 8, 4, 4), "table"),  # a codebook read from memory
]


def compile_for_hopper(dtype: str, config: Int4Config, dequant: str) -> None:
    signature = {"y_ptr": f"*{dtype}", "partials_ptr": "*fp32", "arrivals_ptr": "*i32", "x_ptr": f"*{dtype}",
                 "qweight_ptr": "*i32", "scales_ptr": "*fp16" if dequant == "affine" else "*fp32", "zeros_ptr": "*fp16",
                 "codebook_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32"}  # fmt: skip
    constants = {"GROUP": 128 if dequant == "affine" else 64, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
                 "BLOCK_K": config.block_k, "SPLIT_K": config.split_k, "DEQUANT": dequant}  # fmt: skip
    if not config.gemv:
        constants["DOT_PRECISION"] = "ieee" if dtype == "fp32" else "tf32"
    kernel = _int4_gemv_kernel if config.gemv else _int4_gemm_kernel
    source = ASTSource(kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constexprs=constants)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    if not compiled.asm["cubin"]:
        raise RuntimeError(f"{dtype} {config} ({dequant}): no cubin")


if __name__ == "__main__":
    for dtype, config, dequant in LAUNCHES:
        compile_for_hopper(dtype, config, dequant)
        print(dtype + ("" if dequant == "affine" else f"-{dequant}"), flush=True)
