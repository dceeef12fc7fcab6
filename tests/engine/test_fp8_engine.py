"""FP8 serving through the whole engine, built as a worker builds it (--quantization fp8,
--kv-cache-dtype fp8 in EngineConfig, the residency's memory plan and loader)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kernels.quant import FP8_DTYPE, W8A16_MAX_TOKENS
from shared.schema import JobStatus
from tests.engine.fp8_oracle import fp8_oracle, save_published_kv_scales, save_small_kv_checkpoint
from tests.engine.test_engine_generation import NEW_TOKENS, PROMPTS, greedy_request, make_engine, run_to_completion
from tests.engine.test_engine_gpu import BLOCK_SIZE, decode_logits, prefilled
from tests.engine.test_piecewise_gpu import MixedStep
from tests.engine.tiny_hf import TinyCheckpoint, oracle_greedy
from tests.kernels.lora_cases import rel_err
from worker.engine.block_manager import BlockManager
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import ScheduledSequence
from worker.engine.sequence import Sequence


def test_the_fp8_engine_generates_the_quantized_oracles_greedy_tokens(llama: TinyCheckpoint):
    engine = make_engine(llama, quantization="fp8")
    assert engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
    jobs = {f"job-{name}": name for name in PROMPTS}
    results = run_to_completion(engine, [greedy_request(llama, job, adapter) for job, adapter in jobs.items()])
    oracle = fp8_oracle(llama.oracle)
    for job_id, adapter in jobs.items():
        assert results[job_id].status is JobStatus.SUCCEEDED, results[job_id].error
        assert list(results[job_id].output.token_ids) == oracle_greedy(oracle, PROMPTS[adapter], adapter, NEW_TOKENS)


def test_an_fp8_kv_cache_holds_twice_the_blocks_of_the_same_bytes(llama: TinyCheckpoint):
    auto = make_engine(llama, num_kv_blocks=None, cpu_kv_cache_gb=0.001)
    fp8 = make_engine(llama, num_kv_blocks=None, cpu_kv_cache_gb=0.001, kv_cache_dtype="fp8")
    assert fp8.runner.kv_cache.key[0].dtype == FP8_DTYPE and auto.runner.kv_cache.key[0].dtype == torch.float32
    # float32 activations on CPU: an fp8 cache is a quarter of the bytes per block
    assert fp8.runner.num_blocks // 4 == auto.runner.num_blocks  # the same bytes, floored
    jobs = {f"job-{name}": name for name in PROMPTS}
    results = run_to_completion(fp8, [greedy_request(llama, job, adapter) for job, adapter in jobs.items()])
    assert all(result.status is JobStatus.SUCCEEDED and len(result.output.token_ids) == NEW_TOKENS
               for result in results.values())  # fmt: skip


# The bf16 engine's tolerance of its fp32 run (test_engine_gpu.py): what the GPU engine's bf16
# activations and kernels cost where nothing rounds to fp8 on the way.
BF16_TOLERANCE = 2e-2
# What an fp8 rounding makes of that: the two runs round slightly different values (bf16 against fp32),
# and a value within |e| of a rounding boundary moves by a whole e4m3 step Δ (at most 2**-3 of it) with
# probability |e| / Δ, a mean square of |e| Δ per element instead of e². A relative difference e upstream
# comes out as sqrt(e * 2**-3): for e = BF16_TOLERANCE, 0.05. torch._scaled_mm against the CPU's fp32
# matmul adds only accumulation order and the bf16 output's rounding, inside BF16_TOLERANCE.
FP8_ROUNDING_TOLERANCE = (BF16_TOLERANCE * 2**-3) ** 0.5
# PROMPTS (31 tokens: W8A16, the activations stay bf16 / fp32) and, with a long prompt beside them, a
# prefill past W8A16_MAX_TOKENS (W8A8: the activations rounded to fp8 per token on both sides)
LONG_PROMPT = [(7 * i + 3) % 250 for i in range(W8A16_MAX_TOKENS + 16)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("kv_cache_dtype", "long", "tolerance"),
    [
        ("auto", False, BF16_TOLERANCE),  # nothing rounds to fp8 but the weights, identical on both sides
        ("fp8", False, FP8_ROUNDING_TOLERANCE),  # K and V round to e4m3
        ("auto", True, FP8_ROUNDING_TOLERANCE),  # the activations round to e4m3
        ("fp8", True, 2**0.5 * FP8_ROUNDING_TOLERANCE),  # both, independent
    ],
)
def test_the_fp8_engine_on_the_gpu_matches_the_fp8_engine_on_cpu(
    llama: TinyCheckpoint, kv_cache_dtype: str, long: bool, tolerance: float
):
    """The Triton W8A16 GEMM, torch._scaled_mm, the Triton quantization and (fp8 KV) the cache kernels
    in bf16 against the CPU reference path in float32, which applies the same W8A16 / W8A8 rule and
    quantizes its KV the same way, within the bounds derived above."""
    prompts = [*PROMPTS.values(), *([LONG_PROMPT] if long else [])]

    def logits(device: str, dtype: str) -> torch.Tensor:
        engine = make_engine(llama, device=device, dtype=dtype, quantization="fp8", kv_cache_dtype=kv_cache_dtype)
        return prefill_logits(engine.runner, prompts)

    assert sum(map(len, prompts)) > W8A16_MAX_TOKENS if long else sum(map(len, prompts)) <= W8A16_MAX_TOKENS
    assert rel_err(logits("cuda", "bfloat16"), logits("cpu", "float32")) < tolerance


def prefill_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """float32 [len(prompts), vocab]: each prompt's last logits, all prefilled in one step from an
    empty cache (every block allocated anew: a second call overwrites the first's K/V)."""
    blocks = BlockManager(runner.num_blocks, runner.config.block_size)
    scheduled = []
    for index, prompt in enumerate(prompts):
        seq = Sequence(seq_id=str(index), prompt_token_ids=prompt, sampling=None, seed=0)
        blocks.allocate(seq, len(prompt))
        scheduled.append(ScheduledSequence(seq, len(prompt)))
    return runner.execute(scheduled, lambda uid: None, runner.config.block_size).cpu()


def kv_scales(runner: ModelRunner) -> torch.Tensor:
    """float32 [layers, 2, KV heads]: every layer's K and V scales."""
    return torch.stack([layer.self_attn.kv_scales for layer in runner.model.model.layers]).cpu()


# K and V 2**-10 times the tiny model's (about 0.1-1 there): all below e4m3's smallest normal 2**-6,
# most below its smallest subnormal 2**-9. A power of two: the function is exactly the tiny model's.
SMALL_KV = 2.0**-10
# What rounding every K and V value to e4m3 (3 mantissa bits, steps of 2**-4 to 2**-3 of the value)
# costs: a relative RMS error of at most 2**-3 / sqrt(12) per value, which the logits, a smooth
# function of them, carry at about that size.
KV_ROUNDING_TOLERANCE = 2**-3 / 12**0.5


@pytest.fixture
def small_kv(llama: TinyCheckpoint, tmp_path: Path) -> TinyCheckpoint:
    """The tiny llama reparametrised with K and V SMALL_KV times smaller (same logits)."""
    return replace(llama, model_dir=save_small_kv_checkpoint(llama.model_dir, tmp_path / "small_kv", factor=SMALL_KV))


def test_calibrated_kv_scales_follow_the_k_and_v_magnitudes(llama: TinyCheckpoint, small_kv: TinyCheckpoint):
    """The calibration's forward over the reparametrised model is the tiny model's with K and V
    exactly SMALL_KV times smaller, and so are its amax and scales."""
    ours = kv_scales(make_engine(small_kv, kv_cache_dtype="fp8").runner)
    assert torch.equal(ours, kv_scales(make_engine(llama, kv_cache_dtype="fp8").runner) * SMALL_KV)
    assert (ours < 2**-10).all()  # far from the unit scale: these K/V would be e4m3 subnormals unscaled


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(("device", "dtype"), [("cpu", "float32"), pytest.param("cuda", "bfloat16", marks=ON_GPU)])
def test_kv_scales_keep_small_k_and_v_close_to_the_unquantized_cache(small_kv: TinyCheckpoint, device: str, dtype: str):
    """Prefill logits through an fp8 cache against a cache in the activations' dtype: with the
    calibrated scales the error is e4m3's rounding of every value (KV_ROUNDING_TOLERANCE); with unit
    scales (the unscaled cache this replaces) K and V mostly round to 0 or a subnormal step, many times
    worse. On the GPU through the Triton kernels and the piecewise graphs."""
    prompts = list(PROMPTS.values())
    exact = prefill_logits(make_engine(small_kv, device=device, dtype=dtype).runner, prompts)
    runner = make_engine(small_kv, device=device, dtype=dtype, kv_cache_dtype="fp8").runner
    scaled = rel_err(prefill_logits(runner, prompts), exact)
    for layer in runner.model.model.layers:
        layer.self_attn.kv_scales.fill_(1.0)
    unscaled = rel_err(prefill_logits(runner, prompts), exact)
    assert scaled < KV_ROUNDING_TOLERANCE
    assert unscaled > 4 * KV_ROUNDING_TOLERANCE


def test_a_checkpoints_published_kv_scales_are_used_as_they_are(llama: TinyCheckpoint, tmp_path: Path):
    layers = llama.info.num_layers
    published = {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(0.01 * (i + 1) + (kind == "v") * 0.5)
                 for i in range(layers) for kind in "kv"}  # fmt: skip
    model_dir = save_published_kv_scales(llama.model_dir, tmp_path / "scaled", published)
    runner = make_engine(replace(llama, model_dir=model_dir), kv_cache_dtype="fp8").runner
    assert runner.model.kv_scales_published
    expected = torch.tensor([[[0.01 * (i + 1)], [0.01 * (i + 1) + 0.5]] for i in range(layers)])
    assert torch.equal(kv_scales(runner), expected.expand(-1, -1, llama.info.num_kv_heads))  # per tensor: every head


def test_published_per_head_kv_scales_go_to_their_heads(llama: TinyCheckpoint, tmp_path: Path):
    heads = llama.info.num_kv_heads
    per_head = torch.arange(1, heads + 1, dtype=torch.float32) / 64  # one value per KV head: 1/64, 2/64, …
    published = {f"model.layers.{i}.self_attn.{kind}_scale": per_head * (i + 1) * (2 if kind == "v" else 1)
                 for i in range(llama.info.num_layers) for kind in "kv"}  # fmt: skip
    model_dir = save_published_kv_scales(llama.model_dir, tmp_path / "per_head", published)
    scales = kv_scales(make_engine(replace(llama, model_dir=model_dir), kv_cache_dtype="fp8").runner)
    for i in range(llama.info.num_layers):
        assert torch.equal(scales[i], torch.stack([per_head * (i + 1), per_head * (i + 1) * 2]))


def test_a_kv_scale_neither_per_tensor_nor_per_head_is_refused(llama: TinyCheckpoint, tmp_path: Path):
    published = {f"model.layers.{i}.self_attn.{kind}_scale": torch.ones(3)
                 for i in range(llama.info.num_layers) for kind in "kv"}  # fmt: skip
    model_dir = save_published_kv_scales(llama.model_dir, tmp_path / "odd", published)
    with pytest.raises(ValueError, match=r"k_scale: a KV cache scale of shape \(3,\) is neither per tensor"):
        make_engine(replace(llama, model_dir=model_dir), kv_cache_dtype="fp8")


def test_a_checkpoint_missing_a_layers_kv_scale_is_refused_naming_it(llama: TinyCheckpoint, tmp_path: Path):
    published = {f"model.layers.{i}.self_attn.k_proj.output_scale": torch.tensor(0.1) for i in range(2)}
    published |= {"model.layers.0.self_attn.v_proj.output_scale": torch.tensor(0.1)}  # AutoFP8's names
    model_dir = save_published_kv_scales(llama.model_dir, tmp_path / "partial", published)
    with pytest.raises(ValueError, match=r"^llama: .* lacks 1: v_scale of layer 1$"):  # the model served
        make_engine(replace(llama, model_dir=model_dir), kv_cache_dtype="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_graphs_replay_a_scaled_fp8_cache_as_the_eager_steps_read_it(small_kv: TinyCheckpoint):
    """The decode and piecewise graphs, captured after the calibration, read the layers' scale
    tensors: their steps compute what the same steps compute eagerly (bf16: as test_piecewise_gpu)."""
    runner = make_engine(small_kv, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", max_num_seqs=8,
                         max_num_batched_tokens=96, block_size=BLOCK_SIZE).runner  # fmt: skip
    assert runner.graphs is not None and runner.piecewise is not None
    assert (kv_scales(runner) < 2**-10).all()  # calibrated, far from unit scales
    step = MixedStep(runner, copies=1)  # prefill chunks beside decodes: the piecewise graphs
    base = [-1] * (len(PROMPTS) + 2)
    assert rel_err(step.logits(base, piecewise=True), step.logits(base, piecewise=False)) < 1e-2
    seqs = prefilled(runner, 5)
    graph = decode_logits(runner, seqs, [-1] * 5, eager=False)
    eager = decode_logits(runner, seqs, [-1] * 5, eager=True)
    assert rel_err(graph, eager) < 1e-2


def test_the_calibration_prefills_in_steps_the_memory_plan_budgets(llama: TinyCheckpoint):
    """A step budget below the calibration input prefills it in chunks: the same K/V, the same scales
    (to the chunked attention's rounding)."""
    whole = kv_scales(make_engine(llama, kv_cache_dtype="fp8").runner)
    chunked = kv_scales(make_engine(llama, kv_cache_dtype="fp8", max_num_batched_tokens=5).runner)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=0)
