"""The W4A16 GEMMs (kernels/quant/int4.py) on a CUDA GPU at Llama-3-8B's projection shapes, beside
bf16 cuBLAS on the same shapes and the memory roofline of its own bytes.

    python -m bench.int4_gemm [--tokens 1 2 4 8 16 32 64 256 1024] [--formats int4 int4-kmajor nf4 nf4-gather]
                              [--sweep]

Formats: int4 (affine, float16 scale and zero point per group of 128, as a bf16 model on CUDA serves
--quantization int4: with its tensor-core copy, kernels/quant/int4_mma.py, so tinygemm takes up to
TINYGEMM_MAX_TOKENS rows and the Triton kernels the rest), int4-kmajor (not by default: the same
weight without the copy, the Triton kernels at every size, as --no-int4-decode-copy or an fp16
model serves it), and nf4 (bitsandbytes' NF4 codebook, float32 absmax per block of 64, as --quantization nf4: the levels
looked up in registers, kernels/quant/codebook_lookup.py); nf4-gather (not by default) the same
weight with its codebook unnamed, so the kernel gathers each level from the table in memory, the
path a codebook of other levels takes. Each row: microseconds per call (median
of CUDA-graph replays, L2 flushed before each call: in a model the previous layer's weights have
evicted this one's), the bf16 GEMM's, the speedup, and the 4-bit kernel's bytes (4-bit weights,
their scales and zero points, x and y) over its time as a share of the measured copy bandwidth.
--sweep: also a grid of launches around the default at decode sizes (sweep()), the best printed
beside the default's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch
import torch.nn.functional as F

from bench.lora_kernels import copy_bandwidth
from kernels.lora.tuning.timing import Flushed
from kernels.quant import int4_linear
from kernels.quant.codebook import quantize_codebook
from kernels.quant.int4_gemm import Int4Config, int4_config, int4_gemm
from kernels.quant.int4_mma import to_mma_layout
from kernels.quant.int4_reference import Int4Weight, quantize_int4

# the group (block) of inputs sharing a scale, and the bytes of its scale and zero point, per format
GROUPS = {"int4": 128, "int4-kmajor": 128, "nf4": 64, "nf4-gather": 64}
GROUP_BYTES = {"int4": 2 + 2, "int4-kmajor": 2 + 2, "nf4": 4, "nf4-gather": 4}
# (name, N, K): qkv, o, gate_up, down of Llama-3-8B
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def kernel_bytes(weight_format: str, m: int, n: int, k: int) -> int:
    return k * n // 2 + GROUP_BYTES[weight_format] * (k // GROUPS[weight_format]) * n + 2 * m * k + 2 * m * n


def quantized(weight_format: str, weight: torch.Tensor) -> Int4Weight:
    """weight [N, K] in `weight_format`, quantized as a worker quantizes it at load (nf4-gather: as nf4)."""
    if weight_format.startswith("int4"):
        packed = quantize_int4(weight, GROUPS["int4"])[1]
        return dataclasses.replace(packed, tensor_cores=to_mma_layout(packed)) if weight_format == "int4" else packed
    packed = quantize_codebook(weight, GROUPS["nf4"], "nf4")[1]
    return packed if weight_format == "nf4" else dataclasses.replace(packed, codebook_name=None)


def sweep(m: int, n: int, k: int, flushed: Flushed, x: torch.Tensor, packed: Int4Weight) -> tuple[float, Int4Config]:
    """(µs, launch) of the fastest decode launch of a grid around int4_config's: for the CUDA-core
    kernel (one row) its tiles, warps and stages at the default's split, then the best
    of those at every split; for the tensor-core kernel (BLOCK_N, SPLIT_K, num_stages)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = int4_config(m, n, k, packed.group_size, sms)

    def fastest(configs: list[Int4Config]) -> tuple[float, Int4Config]:
        return min(((flushed(lambda c=c: int4_gemm(x, packed, c)), c) for c in configs), key=lambda t: t[0])

    if default.gemv:
        block_ks = [block_k for block_k in (64, 128) if packed.group_size % block_k == 0]
        grid = itertools.product((64, 128, 256), block_ks, (2, 4, 8), (2, 4))
        tiles = [dataclasses.replace(default, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)
                 for block_n, block_k, warps, stages in grid]  # fmt: skip
        _, best = fastest(tiles)
        splits = [split for split in (1, 2, 4, 8, 16, 32) if split * 2 <= k // best.block_k]
        return fastest([dataclasses.replace(best, split_k=split) for split in splits])
    configs = []
    for block_n, split, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (2, 3, 4)):
        if split * 4 <= k // default.block_k:
            configs.append(dataclasses.replace(default, block_n=block_n, split_k=split, num_stages=stages))
    return fastest(configs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.int4_gemm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256, 1024])
    parser.add_argument("--formats", nargs="+", choices=tuple(GROUPS), default=["int4", "nf4"])
    parser.add_argument("--sweep", action="store_true", help="also try a grid of decode launches")
    args = parser.parse_args(argv)
    bandwidth = copy_bandwidth()
    flushed = Flushed()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'proj':<8}{'format':>11}{'M':>6}{'4-bit us':>9}{'bf16 us':>9}{'speedup':>9}{'of copy bw':>11}"
          + ("   best swept (kernel, block m n k, split, warps, stages) us" if args.sweep else ""))  # fmt: skip
    for name, n, k in SHAPES:
        for weight_format in args.formats:
            for m in args.tokens:
                row = shape_row(name, weight_format, m, n, k, flushed, bandwidth, sweep_too=args.sweep and m <= 64)
                print(row, flush=True)


def shape_row(name: str, weight_format: str, m: int, n: int, k: int, flushed: Flushed, bandwidth: float, *,
              sweep_too: bool) -> str:  # fmt: skip
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    packed = quantized(weight_format, weight)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    int4_us = flushed(lambda: int4_linear(x, packed))
    bf16_us = flushed(lambda: F.linear(x, weight))
    share = kernel_bytes(weight_format, m, n, k) / (int4_us * 1e-6) / bandwidth
    line = f"{name:<8}{weight_format:>11}{m:>6}{int4_us:>9.1f}{bf16_us:>9.1f}{bf16_us / int4_us:>9.2f}{share:>11.2f}"
    if sweep_too:
        best_us, best = sweep(m, n, k, flushed, x, packed)
        kernel = "gemv" if best.gemv else "mma"
        line += (f"   ({kernel}, {best.block_m}, {best.block_n}, {best.block_k}, {best.split_k}, {best.num_warps}, "
                 f"{best.num_stages}) {best_us:.1f}")  # fmt: skip
    return line


if __name__ == "__main__":
    main()
