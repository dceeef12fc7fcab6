"""bench.engine's 4-bit rows (the rows themselves need a GPU): the roofline counts 4-bit weights and
their group scales, random weights are quantized as at load, and the targets print beside the rows."""

from __future__ import annotations

import pytest
import torch

from bench.engine import build_parser
from bench.engine_report import LORAFLEET, Row
from bench.int4 import print_int4_targets, quantize_random
from bench.int4_gemm import kernel_bytes, quantized
from bench.random_engine import LLAMA3_8B, served
from bench.roofline import weight_bytes
from kernels.quant.int4_mma import unpack_mma
from kernels.quant.int4_reference import MmaInt4Weight, dequantize_int4, unpack_along_k
from worker.model.lora_linear import LoRALinear, LoRAPages

INT4 = "lorafleet int4/auto"


def test_int4_and_nf4_are_quantizations_the_bench_takes():
    assert build_parser().parse_args(["--quantization", "none", "int4", "nf4"]).quantization == ["none", "int4", "nf4"]


def test_the_roofline_reads_half_a_byte_a_weight_and_a_scale_and_zero_per_group():
    bf16, int4 = LLAMA3_8B, served(LLAMA3_8B, "int4", "auto")
    assert int4.weight_group_size == 128
    h, i, kv = 4096, 14336, 1024
    projections = h * (h + 2 * kv) + h * h + 3 * h * i  # weights per layer
    layer_norms, head_and_final_norm = 2 * 2 * h, 2 * (128256 * h + h)
    expected = 32 * (projections // 2 + projections // 128 * 4 + layer_norms) + head_and_final_norm
    assert weight_bytes(int4) == expected
    # the bound the 2.5x target is measured against: about 3.1x fewer bytes at batch 1 (the bf16 head stays)
    assert 3.0 < weight_bytes(bf16) / weight_bytes(int4) < 3.3


def test_the_nf4_roofline_reads_half_a_byte_a_weight_and_a_float32_absmax_per_block():
    nf4 = served(LLAMA3_8B, "nf4", "auto")
    assert nf4.weight_group_size == 64
    h, i, kv = 4096, 14336, 1024
    projections = h * (h + 2 * kv) + h * h + 3 * h * i
    expected = 32 * (projections // 2 + projections // 64 * 4 + 2 * 2 * h) + 2 * (128256 * h + h)
    assert weight_bytes(nf4) == expected


@pytest.mark.parametrize(("quantization", "group"), [("int4", 128), ("nf4", 64)])
def test_random_4bit_weights_are_quantized_normal_weights(quantization: str, group: int):
    pages = LoRAPages.for_pool(LLAMA3_8B, max_loras=0, max_lora_rank=16)
    layer = LoRALinear(256, {"q_proj": 96, "k_proj": 32}, bias=False, pages=pages, dtype=torch.bfloat16,
                       device="cpu", quantization=quantization, group_size=group)  # fmt: skip
    torch.manual_seed(0)
    quantize_random(layer, group)
    weight = dequantize_int4(layer.base_weight)
    assert weight.shape == (128, 256)
    assert weight.std().item() == pytest.approx(0.02, rel=0.1)
    # the GEMM reads NF4's levels from registers (the codebook named), not from the table in memory
    assert layer.base_weight.codebook_name == (None if quantization == "int4" else "nf4")


@pytest.mark.parametrize(
    ("weight_format", "group", "codebook_name"),
    [("int4-kmajor", 128, None), ("nf4", 64, "nf4"), ("nf4-gather", 64, None)],
)
def test_the_gemm_bench_quantizes_as_a_worker_does(weight_format: str, group: int, codebook_name: str | None):
    packed = quantized(weight_format, torch.randn(96, 256) * 0.02)
    assert packed.shape == (96, 256) and packed.group_size == group and packed.codebook_name == codebook_name
    assert (packed.codebook is None) == (weight_format == "int4-kmajor")
    # float16 scale and zero point per 128 weights (int4), a float32 absmax per 64 (nf4): 1/32 or 1/16 byte a weight
    scale_bytes = 96 * 256 // (32 if weight_format == "int4-kmajor" else 16)
    assert kernel_bytes(weight_format, 1, 96, 256) == 96 * 256 // 2 + scale_bytes + 2 * 256 + 2 * 96


def test_the_gemm_bench_serves_int4_with_its_tensor_core_copy_as_a_bf16_worker_does():
    weight = torch.randn(96, 256) * 0.02
    packed, kmajor = quantized("int4", weight), quantized("int4-kmajor", weight)
    assert kmajor.tensor_cores is None and isinstance(packed.tensor_cores, MmaInt4Weight)
    assert torch.equal(unpack_mma(packed.tensor_cores.qweight).T, unpack_along_k(kmajor.qweight))
    assert kernel_bytes("int4", 1, 96, 256) == kernel_bytes("int4-kmajor", 1, 96, 256)  # a step reads one layout


def test_the_4bit_targets_print_beside_their_rows(capsys: pytest.CaptureFixture[str]):
    def row(system: str, batch: int, adapters: int, decode: float) -> Row:
        return Row(system, batch, 128, 16, adapters, decode, 1.0, 1.0, decode, 1000.0)

    rows = [
        row(LORAFLEET, 1, 0, 100.0),
        row(INT4, 1, 0, 300.0),
        row(INT4, 1, 8, 240.0),
        row(LORAFLEET, 32, 0, 1000.0),
        row(INT4, 32, 0, 900.0),  # past batch 8: no bf16 ratio printed
    ]
    print_int4_targets(rows, LORAFLEET)
    out = capsys.readouterr().out
    assert "lorafleet int4/auto batch 1 prompt 128 adapters 0: 0.30 of its roofline" in out
    assert "decode 3.00x bf16 (>= 2.5)" in out
    assert "8 adapters: 0.80x the same 4-bit base without (>= 0.9)" in out
    assert out.count("x bf16") == 1
