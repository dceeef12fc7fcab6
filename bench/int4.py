"""The 4-bit (W4A16) side of bench/engine.py: random weights quantized as a worker quantizes at load
(int4: affine groups; nf4: bitsandbytes' NF4 levels in blocks of 64), and the issue's 4-bit targets."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.quant.codebook import quantize_codebook
from kernels.quant.int4_reference import quantize_int4
from worker.model.lora_linear import LoRALinear

if TYPE_CHECKING:
    from bench.engine_report import Row

# issue 22: 4-bit decode >= 2.5x bf16 at batch 1-8
DECODE_OVER_BF16 = 2.5
ADAPTERS_OVER_BASE = 0.9


def quantize_random(module: LoRALinear, group_size: int) -> None:
    """Fill a 4-bit layer with N(0, 0.02) weights quantized as --quantization int4 or nf4 (the layer's
    format) quantizes them at load, its tensor-core copy (if it keeps one) filled as a loaded layer's is."""
    n, k = module.qweight.shape[1], module.in_features
    weight = torch.empty(n, k, dtype=torch.bfloat16, device=module.qweight.device).normal_(0.0, 0.02)
    if module.codebook is not None:
        _, packed = quantize_codebook(weight, group_size, module.quantization)
    else:
        _, packed = quantize_int4(weight, group_size)
        module.zeros.copy_(packed.zeros)
    module.qweight.copy_(packed.qweight)
    module.scales.copy_(packed.scales)
    module.fill_decode_copy()


def print_int4_targets(rows: list[Row], bf16_system: str) -> None:
    """The 4-bit rows beside the issue's targets: decode over bf16's at batch 1-8, 8 adapters over the
    same 4-bit base, and the share of each row's own roofline (4-bit weights and their scales)."""
    engine = {(r.system, r.batch, r.prompt, r.adapters): r for r in rows if r.system.startswith("lorafleet")}
    int4 = sorted(key for key in engine if key[0].startswith(("lorafleet int4", "lorafleet nf4")))
    if not int4:
        return
    print("\n4-bit targets")
    for system, batch, prompt, adapters in int4:
        row = engine[(system, batch, prompt, adapters)]
        share = row.decode_tok_s / row.roofline_tok_s
        print(f"  {system} batch {batch} prompt {prompt} adapters {adapters}: {share:.2f} of its roofline")
        bf16 = engine.get((bf16_system, batch, prompt, adapters))
        if bf16 is not None and batch <= 8:
            ratio = row.decode_tok_s / bf16.decode_tok_s
            print(f"    decode {ratio:.2f}x bf16 (>= {DECODE_OVER_BF16})")
        base = engine.get((system, batch, prompt, 0))
        if base is not None and adapters == 8:
            ratio = row.decode_tok_s / base.decode_tok_s
            print(f"    8 adapters: {ratio:.2f}x the same 4-bit base without (>= {ADAPTERS_OVER_BASE})")
