"""FP8 MoE models (Qwen3-MoE, Mixtral): expert projections W8A16 (fp8 weights, unquantized
activations), attention and dense MLPs W8A8, per-expert adapters in the model's dtype; the engine's
logits against transformers + PEFT computing the same quantized arithmetic in float32
(tests/engine/fp8_oracle.py: fp8_moe_oracle), and FP8 MoE checkpoints in both published formats.

Tolerance: the engine's CPU path and the oracle compute in float32 from the same fp8 values: an
expert weight dequantized on either side is the same product of an fp8 value and its float32 row
scale, and the dense projections' per-token activation quantization is the same function on the
same inputs. They differ only by float32 reassociation (the unquantized MoE oracle's 1e-4; measured
here: below 1.1e-6), and by what that noise could cause, an activation of a dense projection within
float32 noise of an fp8 rounding boundary rounding the other way: about one fp8 step of one
element's contribution, 1e-3 at these sizes, which does not happen on these seeded inputs (the test
would say so). Routing is compared implicitly: a token sent to another expert moves its logits by
far more than the tolerance. That quantization happened: every row is more than ten tolerances from
the unquantized oracle; and in the experts too: the batch is more than ten tolerances from the
oracle with only the dense projections quantized.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.quant import FP8_DTYPE
from shared.errors import LorafleetError
from shared.model_info import EXPERT_PROJECTIONS, MOE_BLOCK, ModelInfo
from shared.schema import JobStatus, SamplingParams
from tests.engine.engine_driver import BlockPool, make_kv_cache, prefill
from tests.engine.engines import load_engine, load_model
from tests.engine.fp8_oracle import BLOCK, fp8_moe_oracle, fp8_oracle, save_fp8_checkpoint
from tests.engine.test_engine_generation import run_to_completion
from tests.engine.test_moe_oracle import NEW_TOKENS, SLOTS, moe_sequences
from tests.engine.tiny_hf import oracle_greedy, oracle_logits, saved_adapter_ref
from tests.engine.tiny_moe import MOE_FAMILIES, TinyMoE, build_tiny_moe
from worker.engine.engine import LLMEngine
from worker.engine.engine_request import EngineRequest
from worker.model.model import CausalLM
from worker.model.moe import MoEBlock

TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def tiny_moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyMoE:
    return build_tiny_moe(request.param, Path(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def oracle(tiny_moe: TinyMoE):
    return fp8_moe_oracle(tiny_moe.oracle, tiny_moe.info.moe_intermediate_size)


def fp8_moe_model(model_dir: Path, info: ModelInfo, tiny_moe: TinyMoE) -> CausalLM:
    """The model served with --quantization fp8, with SLOTS' adapters."""
    served = info.served(quantization="fp8", kv_cache_dtype="auto", source=model_dir)
    return load_model(model_dir, served, {slot: tiny_moe.adapters[name] for name, slot in SLOTS.items()})


def first_moe_block(model: CausalLM) -> MoEBlock:
    return next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoEBlock))


def test_fp8_moe_matches_the_quantized_oracle_in_a_mixed_batch(tiny_moe: TinyMoE, oracle) -> None:
    model = fp8_moe_model(tiny_moe.model_dir, tiny_moe.info, tiny_moe)
    block = first_moe_block(model)
    assert block.w13.dtype == block.w2.dtype == FP8_DTYPE
    dense_only = fp8_oracle(tiny_moe.oracle)  # attention and dense MLPs quantized, experts not
    seqs = moe_sequences()
    logits = prefill([seq for _, seq in seqs], model, make_kv_cache(model, num_blocks=64, block_size=4), BlockPool(64))
    from_dense_only = []
    for row, (adapter, seq) in enumerate(seqs):
        assert (logits[row] - oracle_logits(oracle, seq.token_ids, adapter)[-1]).abs().max() <= TOLERANCE, row
        plain = oracle_logits(tiny_moe.oracle, seq.token_ids, adapter)[-1]
        assert (logits[row] - plain).abs().max() > 10 * TOLERANCE  # the base really ran in fp8
        from_dense_only.append((logits[row] - oracle_logits(dense_only, seq.token_ids, adapter)[-1]).abs().max())
    # and its experts too (a short prompt's last token may weigh them little: measured 1e-4 to 9e-3 a row)
    assert max(from_dense_only) > 10 * TOLERANCE


def fp8_moe_engine(tiny_moe: TinyMoE, **settings: object) -> LLMEngine:
    """The engine a worker started with --quantization fp8 runs for `tiny_moe`, its adapters on disk."""
    root = next(iter(tiny_moe.adapters.values())).parent
    settings = {"device": "cpu", "dtype": "float32", "max_loras": 4, "max_lora_rank": 8, **settings}
    return load_engine(tiny_moe.model_dir, root, name=tiny_moe.family, num_kv_blocks=64, block_size=4,
                       quantization="fp8", **settings)  # fmt: skip


def greedy_requests(tiny_moe: TinyMoE) -> tuple[list[EngineRequest], dict[str, tuple[str | None, list[int]]]]:
    """A greedy request for every sequence of MIXED (every adapter and the base model), and job id →
    (adapter, prompt)."""
    requests, jobs = [], {}
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for index, (adapter, seq) in enumerate(moe_sequences()):
        ref = None if adapter is None else saved_adapter_ref(adapter, tiny_moe.adapters[adapter])
        requests.append(EngineRequest(f"job-{index}", tuple(seq.token_ids), sampling, adapter=ref))
        jobs[f"job-{index}"] = (adapter, list(seq.token_ids))
    return requests, jobs


def test_the_fp8_moe_engine_generates_the_quantized_oracles_greedy_tokens(tiny_moe: TinyMoE, oracle) -> None:
    """Built as a worker builds it (the residency's memory plan and loader), with expert adapters
    brought in by the adapter pool."""
    engine = fp8_moe_engine(tiny_moe)
    assert first_moe_block(engine.runner.model).w13.dtype == FP8_DTYPE
    requests, jobs = greedy_requests(tiny_moe)
    results = run_to_completion(engine, requests)
    for job_id, (adapter, prompt) in jobs.items():
        assert results[job_id].status is JobStatus.SUCCEEDED, results[job_id].error
        assert list(results[job_id].output.token_ids) == oracle_greedy(oracle, prompt, adapter, NEW_TOKENS), job_id


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_experts_quantized_at_load_on_the_gpu_are_those_quantized_on_cpu(tiny_moe: TinyMoE) -> None:
    """The same fp8 values and scales on either device (max, division and the round-to-nearest cast
    are exact or correctly rounded on both), whatever dtype the activations are served in."""
    served = tiny_moe.info.served(quantization="fp8", kv_cache_dtype="auto", source=tiny_moe.model_dir)
    cuda = first_moe_block(load_model(tiny_moe.model_dir, served, dtype="bfloat16", device="cuda"))
    cpu = first_moe_block(load_model(tiny_moe.model_dir, served))
    for name in ("w13", "w2"):
        assert torch.equal(getattr(cuda, name).cpu().view(torch.uint8), getattr(cpu, name).view(torch.uint8)), name
        assert torch.equal(getattr(cuda, f"{name}_scale").cpu(), getattr(cpu, f"{name}_scale")), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_fp8_moe_engine_serves_every_adapter_on_the_gpu(tiny_moe: TinyMoE) -> None:
    """The serving path on CUDA in bf16: fp8 experts in the grouped GEMM, the expert LoRA beside it,
    decode steps in CUDA graphs. Its tokens are not compared with the oracle's: on these tiny random
    models bf16 alone moves the logits by 10-60% (the CPU path in bf16 against float32, measured),
    far past any useful tolerance; the kernels' numerics are checked at Qwen3-30B-A3B shapes in
    tests/kernels/test_moe_gpu.py, and the quantized values above."""
    engine = fp8_moe_engine(tiny_moe, device="cuda", dtype="bfloat16")
    requests, jobs = greedy_requests(tiny_moe)
    results = run_to_completion(engine, requests)
    for job_id in jobs:
        assert results[job_id].status is JobStatus.SUCCEEDED, results[job_id].error
        assert len(results[job_id].output.token_ids) == NEW_TOKENS


@pytest.mark.parametrize(("method", "scales"), [("fp8", "tensor"), ("compressed-tensors", "channel"), ("fp8", "block")])
def test_fp8_moe_checkpoint_loads_as_the_oracle_computes(
    tiny_moe: TinyMoE, tmp_path: Path, method: str, scales: str
) -> None:
    """Per-tensor and per-channel experts as they are; block-wise ones quantized again per row."""
    model_dir = save_fp8_checkpoint(tiny_moe.model_dir, tmp_path / "fp8", method=method, scales=scales)
    info = ModelInfo.from_pretrained(tiny_moe.family, model_dir)
    assert (info.checkpoint_quantization, info.quantization) == ("fp8", "fp8")
    assert info.weight_scale_block == (BLOCK if scales == "block" else None)
    model = fp8_moe_model(model_dir, info, tiny_moe)
    oracle = fp8_moe_oracle(tiny_moe.oracle, info.moe_intermediate_size, scales)
    seqs = moe_sequences()[:4]
    logits = prefill([seq for _, seq in seqs], model, make_kv_cache(model, num_blocks=32, block_size=4), BlockPool(32))
    for row, (adapter, seq) in enumerate(seqs):
        assert (logits[row] - oracle_logits(oracle, seq.token_ids, adapter)[-1]).abs().max() <= TOLERANCE


def expert_key(info: ModelInfo, layer: int, expert: int, projection: int) -> str:
    """The checkpoint name (without `.weight`) of `expert`'s projection (0 gate, 1 up, 2 down)."""
    name = EXPERT_PROJECTIONS[info.architecture][projection]
    return f"model.layers.{layer}.{MOE_BLOCK[info.architecture]}.experts.{expert}.{name}"


def test_fp8_moe_checkpoint_experts_are_not_requantized(tiny_moe: TinyMoE, tmp_path: Path) -> None:
    model_dir = save_fp8_checkpoint(tiny_moe.model_dir, tmp_path / "fp8", method="fp8", scales="tensor")
    info = ModelInfo.from_pretrained(tiny_moe.family, model_dir)
    block = first_moe_block(fp8_moe_model(model_dir, info, tiny_moe))
    saved = load_file(model_dir / "model.safetensors")
    layer, width = info.moe_layers[0], info.moe_intermediate_size
    for projection, (weight, scale) in enumerate(
        [(block.w13[3, :width], block.w13_scale[3, :width]), (block.w13[3, width:], block.w13_scale[3, width:]),
         (block.w2[3], block.w2_scale[3])]
    ):  # fmt: skip
        key = expert_key(info, layer, 3, projection)
        assert torch.equal(weight.view(torch.uint8), saved[f"{key}.weight"].view(torch.uint8)), key
        assert torch.all(scale == saved[f"{key}.weight_scale"]), key


def test_a_missing_expert_scale_names_the_checkpoint_and_tensor(tiny_moe: TinyMoE, tmp_path: Path) -> None:
    model_dir = save_fp8_checkpoint(tiny_moe.model_dir, tmp_path / "fp8", method="compressed-tensors", scales="channel")
    info = ModelInfo.from_pretrained(tiny_moe.family, model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    key = expert_key(info, info.moe_layers[-1], 5, 2)
    del tensors[f"{key}.weight_scale"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{info.name}: checkpoint lacks 1 tensors: {key}\.weight_scale"):
        fp8_moe_model(model_dir, info, tiny_moe)


def test_a_block_wise_expert_scale_under_a_per_channel_config_names_the_checkpoint_and_tensor(
    tiny_moe: TinyMoE, tmp_path: Path
) -> None:
    """A [N / 16, K / 16] scale (as block-wise FP8 stores one per 16 x 16 block) under a config
    that does not say so: refused at load, not read as per-channel."""
    model_dir = save_fp8_checkpoint(tiny_moe.model_dir, tmp_path / "fp8", method="compressed-tensors", scales="channel")
    info = ModelInfo.from_pretrained(tiny_moe.family, model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    key = expert_key(info, info.moe_layers[0], 1, 0)
    rows, columns = tensors[f"{key}.weight"].shape
    tensors[f"{key}.weight_scale"] = torch.full((rows // 16, columns // 16), 0.01)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{info.name}: {key}\.weight_scale: weight scale of shape .* block-wise"):
        fp8_moe_model(model_dir, info, tiny_moe)


def test_an_ignore_list_may_keep_attention_but_not_experts_unquantized(tiny_moe: TinyMoE, tmp_path: Path) -> None:
    """An ignore list may keep attention projections (or a router, never quantized) in the checkpoint's
    dtype; experts run in one grouped FP8 GEMM per block, so it may not keep experts."""
    config = json.loads((tiny_moe.model_dir / "config.json").read_text())
    block, expert_gate = MOE_BLOCK[tiny_moe.info.architecture], EXPERT_PROJECTIONS[tiny_moe.info.architecture][0]
    for name, ignore in (
        ("attention", [r"re:.*\.0\.self_attn\.", rf"re:.*{block}\.gate$"]),
        ("experts", [r"re:.*experts\.1\."]),
    ):
        model_dir = tmp_path / name
        model_dir.mkdir()
        weights = {"num_bits": 8, "type": "float", "strategy": "channel"}
        quantization = {
            "quant_method": "compressed-tensors",
            "config_groups": {"g": {"weights": weights}},
            "ignore": ignore,
        }
        (model_dir / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
        if name == "attention":
            left = ModelInfo.from_pretrained(tiny_moe.family, model_dir).unquantized
            assert left == tuple(f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
            continue
        with pytest.raises(LorafleetError, match=re.escape(f"{block}.experts.1.{expert_gate} is left unquantized")):
            ModelInfo.from_pretrained(tiny_moe.family, model_dir)
