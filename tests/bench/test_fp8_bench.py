"""bench.engine's FP8 rows (the rows themselves need a GPU): the roofline counts each projection in the
format it is served in, "fp8-mixed" serves q/k/v and down in bf16 as an FP8 checkpoint's ignore list
keeps them, and its decode over bf16 prints beside the bound its bytes set."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bench.engine import parse_args
from bench.engine_report import LORAFLEET, Row, engine_system, print_targets
from bench.random_engine import LLAMA3_8B, MIXED_FP8_UNQUANTIZED, random_model, served
from bench.roofline import weight_bytes
from shared.config import EngineConfig
from shared.model_info import PROJECTIONS
from worker.model.lora_linear import LoRALinear

H, FF, KV, LAYERS = 4096, 14336, 1024, 32
SHAPES = {"q_proj": (H, H), "k_proj": (H, KV), "v_proj": (H, KV), "o_proj": (H, H),
          "gate_proj": (H, FF), "up_proj": (H, FF), "down_proj": (FF, H)}  # fmt: skip
NORMS_AND_HEAD = LAYERS * 2 * 2 * H + 2 * (128256 * H + H)


def fp8_bytes(inputs: int, outputs: int) -> int:
    return inputs * outputs + 4 * outputs  # a byte a weight, a float32 scale a row


def test_fp8_mixed_is_a_quantization_the_bench_takes():
    assert parse_args(["--quantization", "none", "fp8", "fp8-mixed"]).quantization == ["none", "fp8", "fp8-mixed"]


def test_the_fp8_roofline_reads_a_byte_a_weight_and_a_scale_a_row():
    expected = LAYERS * sum(fp8_bytes(*shape) for shape in SHAPES.values()) + NORMS_AND_HEAD
    assert weight_bytes(served(LLAMA3_8B, "fp8", "auto")) == expected


def test_the_mixed_roofline_reads_the_projections_kept_in_bf16_at_two_bytes_a_weight():
    per_layer = sum(2 * k * n if name in MIXED_FP8_UNQUANTIZED else fp8_bytes(k, n) for name, (k, n) in SHAPES.items())
    mixed = served(LLAMA3_8B, "fp8-mixed", "auto")
    assert weight_bytes(mixed) == LAYERS * per_layer + NORMS_AND_HEAD
    # the bound it is measured against: 1.40x fewer bytes than bf16 a decode step, where all-FP8's is 1.87x
    assert weight_bytes(LLAMA3_8B) / weight_bytes(mixed) == pytest.approx(1.40, abs=0.01)
    assert weight_bytes(LLAMA3_8B) / weight_bytes(served(LLAMA3_8B, "fp8", "auto")) == pytest.approx(1.87, abs=0.01)


def test_the_mixed_model_serves_the_kept_projections_in_bf16_in_every_layer():
    info = served(LLAMA3_8B, "fp8-mixed", "auto")
    assert info.quantization == "fp8" and engine_system(info) == "lorafleet fp8-mixed/auto"
    assert info.unquantized_summary() == [
        "model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.k_proj", "model.layers.*.self_attn.v_proj",
        "model.layers.*.mlp.down_proj",
    ]  # fmt: skip
    for layer in range(LAYERS):
        kept = {p for p in PROJECTIONS if info.projection_quantization(layer, p) == "none"}
        assert kept == set(MIXED_FP8_UNQUANTIZED)


def test_a_random_mixed_model_holds_bf16_weights_beside_fp8_ones():
    tiny = replace(LLAMA3_8B, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=64, vocab_size=512)  # fmt: skip
    model = random_model(served(tiny, "fp8-mixed", "auto"), EngineConfig(device="cpu", max_loras=2, max_lora_rank=16))
    linears = {name.split(".")[-1]: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert set(linears) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    for name, linear in linears.items():
        kept = name in ("qkv_proj", "down_proj")
        assert linear.weight.dtype == (torch.bfloat16 if kept else torch.float8_e4m3fn)
        assert (linear.weight_scale is None) == kept
        weight = linear.weight.float() if kept else linear.weight.float() * linear.weight_scale[:, None]
        assert weight.std().item() == pytest.approx(0.02, rel=0.1)  # N(0, 0.02), quantized or not


def test_the_mixed_rows_decode_over_bf16_prints_beside_what_its_bytes_allow(capsys: pytest.CaptureFixture[str]):
    def row(system: str, decode: float, roofline: float) -> Row:
        return Row(system, 32, 128, 128, 0, decode, 10.0, 1.0, decode, roofline)

    print_targets([row(LORAFLEET, 1000.0, 2000.0), row("lorafleet fp8-mixed/auto", 1300.0, 2800.0)], {})

    out = capsys.readouterr().out
    assert "lorafleet fp8-mixed/auto batch 32 prompt 128 adapters 0: 0.46 of its roofline" in out
    assert "decode 1.30x bf16 (its bytes allow 1.40x)" in out
