"""W4A16 (kernels/quant/int4*): the packings every source format is repacked from, the quantizer's
round trip, and the Triton GEMM against its torch reference over odd shapes, split-K and both
source packings (fp32/fp16 through the interpreter, bf16 on the GPU), also under every LoRA path."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from kernels.lora import linear_deferred_with_plan, linear_with_plan, lora_linear
from kernels.lora.configs import GatherConfig, default_plan
from kernels.quant import Int4Weight, int4_linear
from kernels.quant.int4_gemm import Int4Config, int4_config, int4_gemm
from kernels.quant.int4_reference import (
    AWQ_ORDER,
    MAX_LEVEL,
    arrival_counters,
    dequantize_int4,
    int4_linear_reference,
    pack_along_k,
    pack_along_n,
    quantize_int4,
    unpack_along_k,
    unpack_along_n,
)
from tests.kernels.lora_cases import make_case, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter computes bf16 tl.dot wrongly (tests/kernels/conftest.py): bf16 on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def random_levels(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randint(0, MAX_LEVEL + 1, (rows, cols), generator=torch.Generator().manual_seed(seed))


def random_int4(n: int, k: int, group: int, seed: int) -> Int4Weight:
    """A 4-bit weight [n, k] with random levels, scales and (non-integer-free) zero points."""
    generator = torch.Generator().manual_seed(seed)
    return Int4Weight(
        qweight=pack_along_k(random_levels(k, n, seed)).to(DEVICE),
        scales=(torch.rand(k // group, n, generator=generator) * 0.02 + 1e-3).half().to(DEVICE),
        zeros=torch.randint(0, 17, (k // group, n), generator=generator).half().to(DEVICE),
        arrivals=arrival_counters(DEVICE),
    )


def test_packing_along_k_round_trips_every_level():
    q = random_levels(64, 24, seed=0)
    q[:8, 0] = torch.arange(8) + 8  # the top nibble set: the int32 is negative
    packed = pack_along_k(q)
    assert packed.shape == (8, 24) and packed.dtype == torch.int32 and bool((packed < 0).any())
    assert torch.equal(unpack_along_k(packed), q.int())


def test_awq_packing_holds_columns_in_its_interleaved_order():
    q = torch.arange(8).repeat(3, 1)  # column c holds the value c
    packed = pack_along_n(q, AWQ_ORDER)
    nibbles = [(int(packed[0, 0]) >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(unpack_along_n(packed, AWQ_ORDER), q.int())


@pytest.mark.parametrize("group", [32, 128])
def test_quantizer_round_trip_is_within_half_a_step(group: int):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 256, generator=generator) * torch.logspace(-3, 1, 40)[:, None]
    weight[3] = 0.0
    weight[5, :group] = torch.rand(group, generator=generator) + 0.5  # a group of positive weights only
    levels, packed = quantize_int4(weight, group)
    assert torch.equal(unpack_along_k(packed.qweight), levels)
    assert packed.shape == (40, 256) and packed.group_size == group
    steps = packed.scales.float().repeat_interleave(group, dim=0).T  # [N, K]
    error = (dequantize_int4(packed) - weight).abs()
    # round to nearest against the stored scale; the float16 rounding of the scale moves the
    # group's ends by at most 15 * 2**-11 of a step
    assert bool((error <= steps * (0.5 + 2**-7)).all())
    assert torch.equal(dequantize_int4(packed)[3], torch.zeros(256))  # zeros stay zeros
    assert float(error.max()) > 0  # quantization happened


def test_quantizing_packed_slices_equals_quantizing_them_apart():
    generator = torch.Generator().manual_seed(2)
    q_proj, k_proj = torch.randn(48, 128, generator=generator), torch.randn(16, 128, generator=generator) * 5
    _, together = quantize_int4(torch.cat([q_proj, k_proj]), 128)
    _, alone = quantize_int4(k_proj, 128)
    assert torch.equal(together.qweight[:, 48:], alone.qweight)
    assert torch.equal(together.scales[:, 48:], alone.scales)
    assert torch.equal(together.zeros[:, 48:], alone.zeros)


CASES = [  # (M, N, K, group): odd M and N, K over several groups
    (1, 72, 128, 128),
    (3, 200, 256, 64),
    (16, 64, 384, 128),
    (17, 136, 256, 32),
    (70, 96, 256, 128),  # past the decode sizes: the prefill tiles
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k", "group"), CASES)
def test_gemm_matches_the_reference(dtype: torch.dtype, m: int, n: int, k: int, group: int):
    weight = random_int4(n, k, group, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype=dtype, device=DEVICE)
    config = int4_config(m, n, k, group, sm_count=132)
    assert config.gemv == (m == 1)
    if DEVICE == "cpu" and m <= 16:  # the interpreter runs every program in Python: small tiles keep it quick
        config = dataclasses.replace(config, block_n=32, block_k=min(32, group), split_k=1)
    y = int4_gemm(x, weight, config)
    expected = int4_linear_reference(x, weight)
    assert y.dtype == dtype and y.shape == (m, n)
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2  # float32 sums in a different order; one 16-bit rounding
    assert torch.allclose(y.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_the_cuda_core_kernel_multiplies_one_row(split: int):
    weight = random_int4(40, 384, 64, seed=split)
    x = torch.randn(1, 384, generator=torch.Generator().manual_seed(split)).to(DEVICE)
    y = int4_gemm(x, weight, Int4Config(1, 32, 32, split, 4, 1, gemv=True))
    assert torch.allclose(y, int4_linear_reference(x, weight), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="one row"):
        int4_gemm(torch.randn(2, 384, device=DEVICE), weight, Int4Config(1, 32, 32, 1, 4, 1, gemv=True))


@pytest.mark.parametrize("split", [2, 3])
def test_split_k_sums_the_same_product_launch_after_launch(split: int):
    weight = random_int4(40, 384, 32, seed=5)
    x = torch.randn(20, 384, generator=torch.Generator().manual_seed(6)).to(DEVICE)  # two row tiles
    whole = int4_gemm(x, weight, Int4Config(16, 32, 32, 1, 4, 1))
    first = int4_gemm(x, weight, Int4Config(16, 32, 32, split, 4, 1))
    assert torch.allclose(first, whole, rtol=1e-5, atol=1e-5)
    assert torch.allclose(first, int4_linear_reference(x, weight), rtol=1e-4, atol=1e-4)
    # the arrival counters are back at zero: the next launch (a graph replay) sums the same, bit for bit
    assert torch.equal(int4_gemm(x, weight, Int4Config(16, 32, 32, split, 4, 1)), first)


@pytest.mark.parametrize("source", ["awq", "gptq"])
def test_gemm_reads_weights_repacked_from_both_published_packings(source: str):
    n, k, group = 64, 256, 128
    levels = random_levels(k, n, seed=7)  # [K, N]
    # AWQ packs [K, N / 8] along N in its interleaved order; GPTQ [K / 8, N] along K, as we do
    published = pack_along_n(levels, AWQ_ORDER) if source == "awq" else pack_along_k(levels)
    unpacked = unpack_along_n(published, AWQ_ORDER) if source == "awq" else unpack_along_k(published)
    scales_and_zeros = random_int4(n, k, group, seed=8)
    weight = dataclasses.replace(scales_and_zeros, qweight=pack_along_k(unpacked).to(DEVICE))
    dequantized = (
        levels.float() - weight.zeros.float().cpu().repeat_interleave(group, 0)
    ) * weight.scales.float().cpu().repeat_interleave(group, 0)
    assert torch.equal(dequantize_int4(weight).cpu(), dequantized.T)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    y = int4_gemm(x, weight, Int4Config(16, 32, 32, 1, 4, 1))
    assert torch.allclose(y, x @ dequantized.T.to(DEVICE).T, rtol=1e-4, atol=1e-4)


def test_zero_tokens_give_an_empty_result():
    weight = random_int4(32, 128, 128, seed=1)
    assert int4_gemm(torch.empty(0, 128, device=DEVICE), weight).shape == (0, 32)


def test_mismatched_inner_width_is_refused():
    weight = random_int4(32, 128, 128, seed=1)
    with pytest.raises(ValueError, match="K=256"):
        int4_gemm(torch.randn(2, 256, device=DEVICE), weight)


def test_decode_configs_split_the_narrow_projections_of_llama3_8b():
    # one row: the CUDA-core kernel, 128 columns a program, split until two programs per SM
    assert int4_config(1, 4096, 4096, 128, 132) == Int4Config(1, 128, 128, 16, 4, 3, gemv=True)
    assert int4_config(1, 28672, 4096, 128, 132).split_k == 2
    # o_proj and down_proj (64 column tiles) split; gate_up (448 tiles) fills the GPU alone
    assert int4_config(8, 4096, 4096, 128, 132).split_k == 8
    assert int4_config(8, 4096, 14336, 128, 132).split_k == 8
    assert int4_config(8, 6144, 4096, 128, 132).split_k == 4
    assert int4_config(8, 28672, 4096, 128, 132).split_k == 1
    assert int4_config(64, 4096, 4096, 128, 132).split_k == 4  # as many partial bytes as weight bytes
    assert int4_config(128, 4096, 4096, 128, 132).split_k == 2
    assert int4_config(1024, 4096, 4096, 128, 132).split_k == 1  # prefill: enough tiles, no split
    assert int4_config(1024, 28672, 4096, 128, 132).block_m == 128


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the dispatch takes the kernel on CUDA only")
def test_linear_with_bias_on_cuda_matches_the_reference():
    weight = random_int4(96, 256, 128, seed=3)
    x = torch.randn(6, 256, device=DEVICE, dtype=torch.bfloat16)
    bias = torch.randn(96, device=DEVICE, dtype=torch.bfloat16)
    expected = int4_linear_reference(x, weight, bias).float()
    assert torch.allclose(int4_linear(x, weight, bias).float(), expected, rtol=2e-2, atol=2e-2)


PATHS = [("fused", None), ("split", None), ("split", GatherConfig()), ("overlap", None)]


def test_lora_linear_adds_the_delta_on_top_of_the_4bit_base_on_cpu():
    case = make_case(9, 128, [32, 16], [8, 0, 4], dtype=torch.float32, device="cpu", seed=5)
    _, weight = quantize_int4(case.weight, 32)
    y = lora_linear(case.x, weight, case.bias, case.lora_a, case.lora_b, case.batch)
    assert torch.allclose(y, case.delta(int4_linear_reference(case.x, weight, case.bias)), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [1, 40, 600])
@pytest.mark.parametrize(("path", "expand"), PATHS)
def test_every_lora_path_adds_its_delta_to_the_4bit_base(path: str, expand: GatherConfig | None, num_tokens: int):
    case = make_case(num_tokens, 1024, [1024, 256, 256], [16, 8, 0, 32], dtype=torch.bfloat16, device="cuda",
                     page_rank=16, seed=num_tokens)  # fmt: skip
    _, weight = quantize_int4(case.weight, 128)
    plan = dataclasses.replace(default_plan(num_tokens, 32), path=path, gather=expand)
    expected = case.delta(int4_linear_reference(case.x.float(), weight, case.bias))
    y = linear_with_plan(plan, case.x, weight, case.bias, case.lora_a, case.lora_b, case.batch)
    assert rel_err(y, expected) < 1e-2
    base, delta = linear_deferred_with_plan(plan, case.x, weight, case.bias, case.lora_a, case.lora_b, case.batch)
    assert rel_err(base if delta is None else base.float() + delta.float(), expected) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_split_k_decode_gemm_replays_from_a_cuda_graph():
    weight = random_int4(4096, 4096, 128, seed=11)  # o_proj of Llama-3-8B: split 4 ways or more
    assert int4_config(4, 4096, 4096, 128, torch.cuda.get_device_properties(0).multi_processor_count).split_k > 1
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    int4_gemm(x, weight)  # warm-up: compiles, and allocates the arrival counters outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = int4_gemm(x, weight)
    for seed in range(3):
        x.copy_(torch.randn(4, 4096, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16))
        graph.replay()
        assert rel_err(y, int4_linear_reference(x, weight)) < 1e-2


def test_the_kernel_compiles_for_hopper():
    """Compiled ahead of time for sm_90 on any machine, outside the interpreter (a process of its own:
    this one's Triton may be the interpreter's): what the interpreter accepts and the GPU compiler
    refuses. Split-K decode launches in bf16 and fp16, a prefill launch in float32, and codebook
    launches of each kernel: NF4 and FP4 in registers (inline PTX, which ptxas must accept), a table
    read from memory."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.int4_hopper_compile"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [
        "bf16", "fp16", "bf16", "fp32", "bf16", "fp16", "bf16-nf4", "bf16-nf4", "bf16-nf4", "bf16-fp4", "bf16-fp4",
        "bf16-table",
    ]  # fmt: skip
