"""FP8 GEMMs against bf16 at Llama-3-8B's projection shapes, on a CUDA GPU: the table that picks the
token count where fp8_linear switches from W8A16 to W8A8 (kernels/quant W8A16_MAX_TOKENS).

    python -m bench.quant_kernels [--tokens 1 8 16 32 48 64 96 128 256] [--out FILE]

Per projection (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672, down 14336 -> 4096) and
token count M, the median time of (CUDA-graph replays, L2 flushed before each: in a model the other
layers' weights have evicted this one's):
    bf16    F.linear with the bf16 weight (cuBLAS)
    W8A16   the Triton weight-only kernel (kernels/quant/w8a16.py) with the plan it picks on this GPU
            (`W8A16 plan`: this GPU's tuned table's, kernels/configs/w8a16_<GPU>.json, else "default")
    W8A8    the per-token quantization kernel and torch._scaled_mm (rowwise scales)
each beside its byte roofline: the weight (2 or 1 bytes an element, plus a float32 scale a row),
x and y once, over the measured copy bandwidth. `picked` is what fp8_linear runs at that M.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from bench.lora_kernels import copy_bandwidth
from kernels.lora.tuning.timing import Flushed
from kernels.quant import W8A16_MAX_TOKENS, quantize_weight, w8a8_linear, w8a16_linear
from kernels.quant.w8a16 import plan_for_tensor
from kernels.quant.w8a16_plans import tuned_plan

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@dataclass(frozen=True, slots=True)
class Row:
    projection: str
    tokens: int
    bf16_us: float
    bf16_roof_us: float
    w8a16_us: float
    w8a8_us: float
    fp8_roof_us: float
    w8a16_plan: str  # the plan W8A16 ran (W8A16Plan.describe), and "(tuned)" or "(default)"

    @property
    def picked(self) -> str:
        return "W8A16" if self.tokens <= W8A16_MAX_TOKENS else "W8A8"


def roofline_us(n: int, k: int, tokens: int, weight_bytes: int, bandwidth: float) -> float:
    """Bytes every GEMM must move (weight, its scales for fp8, x and y in bf16) over the bandwidth."""
    scales = 4 * n if weight_bytes == 1 else 0
    return (n * k * weight_bytes + scales + 2 * tokens * (n + k)) / bandwidth * 1e6


def measure(tokens: list[int], bandwidth: float) -> list[Row]:
    timed = Flushed()
    rows = []
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, scales = quantize_weight(weight)
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            source = "tuned" if tuned_plan(torch.cuda.get_device_name(), m, n, k) else "default"
            rows.append(
                Row(
                    name,
                    m,
                    timed(lambda x=x, weight=weight: F.linear(x, weight)),
                    roofline_us(n, k, m, 2, bandwidth),
                    timed(lambda x=x, q=q, scales=scales: w8a16_linear(x, q, scales)),
                    timed(lambda x=x, q=q, scales=scales: w8a8_linear(x, q, scales)),
                    roofline_us(n, k, m, 1, bandwidth),
                    f"{plan_for_tensor(x, n).describe()} ({source})",
                )
            )
            print(format_row(rows[-1]), flush=True)
        del weight, q, scales
    return rows


HEADER = (
    "| projection | M | bf16 µs | × roof | W8A16 µs | × roof | W8A8 µs | × roof "
    "| W8A16 / bf16 | W8A8 / bf16 | picked | W8A16 plan |\n"
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"
)


def format_row(r: Row) -> str:
    """× roof: the roofline's time over the measured one (1.0 = at the byte floor); A / bf16: speed-up."""
    return (
        f"| {r.projection} | {r.tokens} | {r.bf16_us:.1f} | {r.bf16_roof_us / r.bf16_us:.2f} | "
        f"{r.w8a16_us:.1f} | {r.fp8_roof_us / r.w8a16_us:.2f} | {r.w8a8_us:.1f} | {r.fp8_roof_us / r.w8a8_us:.2f} | "
        f"{r.bf16_us / r.w8a16_us:.2f}× | {r.bf16_us / r.w8a8_us:.2f}× | {r.picked} | {r.w8a16_plan} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32, 48, 64, 96, 128, 256])
    parser.add_argument("--out", help="also write the rows as JSON to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.quant_kernels needs a CUDA GPU")
    bandwidth = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bandwidth / 1e12:.2f} TB/s  "
          f"W8A16 up to {W8A16_MAX_TOKENS} tokens\n{HEADER}", flush=True)  # fmt: skip
    rows = measure(args.tokens, bandwidth)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "bandwidth": bandwidth,
                       "rows": [asdict(r) for r in rows]}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
