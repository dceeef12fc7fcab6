"""The single-launch LoRA kernel (kernels/lora/single_launch.py) against the plain-torch reference
(through the interpreter on CPU, which runs its programs in ticket order; on a GPU in any order), and
repeated launches, which check that each leaves its workspace zero for the next."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import kernels.lora.paths
from kernels.lora.configs import Plan, SingleLaunchConfig
from kernels.lora.paths import linear_deferred_with_plan
from kernels.lora.single_launch import MAX_TOKENS, lora_single_launch
from kernels.lora.tiles import slice_groups
from kernels.quant import quantize_weight
from kernels.quant.int4_mma import TINYGEMM_MAX_TOKENS, to_mma_layout
from kernels.quant.int4_reference import quantize_int4
from tests.kernels.lora_cases import make_case, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 2e-3, torch.float32: 1e-5 if DEVICE == "cpu" else 2e-3, torch.bfloat16: 1e-2}
# odd sizes: K not a multiple of BLOCK_K, widths not of BLOCK_N; more K chunks and tiles than programs
SMALL = SingleLaunchConfig(block_k=32, block_n=16, max_programs=3)
HUNDREDS_OF_PROGRAMS = SingleLaunchConfig(block_k=32, block_n=16, max_programs=4096)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 5, MAX_TOKENS])
@pytest.mark.parametrize("accumulate", [True, False])
def test_adds_or_writes_each_tokens_adapter_delta(dtype: torch.dtype, num_tokens: int, accumulate: bool) -> None:
    """Three slices, mixed ranks (one 0), paged weights with garbage past each rank, base tokens."""
    case = make_case(
        num_tokens, 72, [40, 24, 17], [24, 8, 0, 16], dtype=dtype, device=DEVICE, page_rank=8, seed=num_tokens
    )
    group = slice_groups(case.lora_a, case.lora_b)[0]
    start = torch.randn(num_tokens, case.width, device=DEVICE).to(dtype)
    y = start.clone() if accumulate else torch.full_like(start, float("nan"))
    expected = case.delta(start if accumulate else torch.zeros_like(start))
    lora_single_launch(y, case.x, group, case.batch, SMALL, accumulate=accumulate)
    assert rel_err(y, expected) < TOL[dtype]


def test_launches_after_the_first_start_from_a_zero_workspace() -> None:
    """Each launch zeroes its workspace (the sums and the barrier's counters) on the way out: the same
    launch three times gives the same delta, with one and two slices (rows of a different layout)."""
    for widths in ([48], [32, 16]):
        case = make_case(6, 64, widths, [16, 16, 16], device=DEVICE, base_fraction=0.0, seed=len(widths))
        group = slice_groups(case.lora_a, case.lora_b)[0]
        first = torch.zeros(6, case.width, device=DEVICE).half()
        lora_single_launch(first, case.x, group, case.batch, SMALL, accumulate=False)
        for _ in range(2):
            again = torch.zeros_like(first)
            lora_single_launch(again, case.x, group, case.batch, SMALL, accumulate=False)
            assert torch.equal(again, first)
        assert rel_err(first, case.delta(torch.zeros(6, case.width))) < TOL[torch.float16]


def test_rows_without_an_adapter_are_left_alone_or_written_zero() -> None:
    case = make_case(4, 32, [32], [16, 16], device=DEVICE, base_fraction=1.0)
    group = slice_groups(case.lora_a, case.lora_b)[0]
    y = torch.randn(4, 32, device=DEVICE).half()
    before = y.clone()
    lora_single_launch(y, case.x, group, case.batch, SMALL)
    assert torch.equal(y, before)
    lora_single_launch(y, case.x, group, case.batch, SMALL, accumulate=False)
    assert not y.any()


def test_more_tokens_than_a_launch_holds_are_refused() -> None:
    case = make_case(MAX_TOKENS + 1, 32, [16], [16], device=DEVICE)
    y = torch.zeros(MAX_TOKENS + 1, 16, device=DEVICE).half()
    with pytest.raises(ValueError, match="at most"):
        lora_single_launch(y, case.x, slice_groups(case.lora_a, case.lora_b)[0], case.batch, SMALL)


def test_the_kernel_compiles_for_hopper_with_the_orderings_its_wait_relies_on() -> None:
    """Without a GPU, for sm_90 (tests/kernels/single_launch_compile.py), every slice count and mode:
    the ticket and the sums relaxed, a shrink program's count released, the expand programs' wait an
    acquire (an add of 0 compiles to an acquiring load), the last one out's count acq_rel, and z
    read from L2 (.cg)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "tests.kernels.single_launch_compile"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 6
    for line in lines:
        assert "atom.global.gpu.relaxed.add.u32" in line  # the ticket
        assert "red.global.gpu.relaxed.add.f32" in line  # the sums
        assert "red.global.gpu.release.add.u32" in line  # a shrink program done
        assert "ld.global.gpu.acquire.b32" in line  # the wait
        assert "atom.global.gpu.acq_rel.add.u32" in line  # an expand program done
        assert "ld.global.cg" in line  # z


@pytest.mark.parametrize("num_tokens", [1, TINYGEMM_MAX_TOKENS, TINYGEMM_MAX_TOKENS + 1])
@pytest.mark.parametrize("copy", [True, False])
def test_the_decoder_takes_the_single_launch_beside_tinygemm_only(
    monkeypatch: pytest.MonkeyPatch, num_tokens: int, copy: bool
) -> None:
    """The overlap path's deferred delta (what qkv and gate_up hand the next kernel): one launch where
    the 4-bit base multiplies through its tensor-core copy, shrink then expand elsewhere; the same
    delta either way."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # tinygemm's dtype; the interpreter's dots
    case = make_case(num_tokens, 128, [64, 32], [16, 8], dtype=dtype, device=DEVICE, base_fraction=0.0)
    weight = quantize_int4(case.weight.float(), 64)[1]
    if copy:
        weight = dataclasses.replace(weight, tensor_cores=to_mma_layout(weight))
    launches = []
    monkeypatch.setattr(
        kernels.lora.paths, "lora_single_launch", lambda *a, **k: launches.append(lora_single_launch(*a, **k))
    )
    plan = Plan(path="overlap")
    _, delta = linear_deferred_with_plan(plan, case.x, weight, None, case.lora_a, case.lora_b, case.batch)
    assert len(launches) == (1 if copy and num_tokens <= TINYGEMM_MAX_TOKENS else 0)
    assert rel_err(delta, case.delta(torch.zeros(num_tokens, case.width))) < TOL[dtype]


@pytest.mark.parametrize("num_tokens", [1, MAX_TOKENS, MAX_TOKENS + 1])
@pytest.mark.parametrize("fp8", [True, False])
def test_the_decoder_takes_the_single_launch_beside_fp8_decode_gemms_not_beside_bf16(
    monkeypatch: pytest.MonkeyPatch, num_tokens: int, fp8: bool
) -> None:
    """Beside an fp8 weight's W8A16 GEMM one launch up to the kernel's MAX_TOKENS, shrink then expand
    past it; beside a bf16 weight always shrink then expand; the same delta either way."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    case = make_case(num_tokens, 128, [64, 32], [16, 8], dtype=dtype, device=DEVICE, base_fraction=0.0)
    weight, scale = quantize_weight(case.weight) if fp8 else (case.weight, None)
    launches = []
    monkeypatch.setattr(
        kernels.lora.paths, "lora_single_launch", lambda *a, **k: launches.append(lora_single_launch(*a, **k))
    )
    plan = Plan(path="overlap")
    _, delta = linear_deferred_with_plan(
        plan, case.x, weight, None, case.lora_a, case.lora_b, case.batch, weight_scale=scale
    )
    assert len(launches) == (1 if fp8 and num_tokens <= MAX_TOKENS else 0)
    assert rel_err(delta, case.delta(torch.zeros(num_tokens, case.width))) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 4, MAX_TOKENS])
@pytest.mark.parametrize("config", [SingleLaunchConfig(), HUNDREDS_OF_PROGRAMS])
def test_llama_shapes_in_bf16(num_tokens: int, config: SingleLaunchConfig) -> None:
    """Llama-3-8B's qkv and down at rank 16 in bf16, with the default grid and with one of hundreds
    of programs (down: 448 shrink, 256 expand), more than start at once beside each other's waits."""
    for k, widths in ((4096, [4096, 1024, 1024]), (14336, [4096])):
        case = make_case(num_tokens, k, widths, [16] * 8, dtype=torch.bfloat16, device=DEVICE, page_rank=16)
        group = slice_groups(case.lora_a, case.lora_b)[0]
        y = torch.randn(num_tokens, case.width, device=DEVICE).to(torch.bfloat16)
        expected = case.delta(y)
        for _ in range(3):
            out = y.clone()
            lora_single_launch(out, case.x, group, case.batch, config)
            assert rel_err(out, expected) < TOL[torch.bfloat16]
