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

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.model_info import EXPERT_PROJECTIONS, MOE_BLOCK, ModelInfo
from tests.engine.engine_driver import BlockPool, build_step, make_kv_cache, prefill
from tests.engine.engines import load_model
from tests.engine.fp8_oracle import fp8_moe_oracle, fp8_oracle, save_fp8_checkpoint
from tests.engine.test_moe_oracle import SLOTS, moe_sequences
from tests.engine.tiny_hf import oracle_greedy, oracle_logits
from tests.engine.tiny_moe import MOE_FAMILIES, TinyMoE, build_tiny_moe
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
    assert block.w13.dtype == block.w2.dtype == torch.float8_e4m3fn
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


def test_fp8_moe_greedy_decode_matches_the_quantized_oracle(tiny_moe: TinyMoE, oracle) -> None:
    steps = 4
    model = fp8_moe_model(tiny_moe.model_dir, tiny_moe.info, tiny_moe)
    kv_cache = make_kv_cache(model, num_blocks=64, block_size=4)
    pool = BlockPool(64, seed=1)
    seqs = moe_sequences()[:4]
    prompts = [list(seq.token_ids) for _, seq in seqs]
    tokens = prefill([seq for _, seq in seqs], model, kv_cache, pool).argmax(-1).tolist()
    for _ in range(steps - 1):
        for (_, seq), token in zip(seqs, tokens, strict=True):
            seq.token_ids.append(token)
        tokens = model(build_step([(seq, 1) for _, seq in seqs], model, kv_cache, pool), kv_cache).argmax(-1).tolist()
    for (_, seq), token in zip(seqs, tokens, strict=True):
        seq.token_ids.append(token)
    for prompt, (adapter, seq) in zip(prompts, seqs, strict=True):
        assert seq.token_ids[len(prompt) :] == oracle_greedy(oracle, prompt, adapter, steps)


@pytest.mark.parametrize(("method", "scales"), [("fp8", "tensor"), ("compressed-tensors", "channel")])
def test_fp8_moe_checkpoint_loads_as_it_is(tiny_moe: TinyMoE, tmp_path: Path, method: str, scales: str) -> None:
    model_dir = save_fp8_checkpoint(tiny_moe.model_dir, tmp_path / "fp8", method=method, scales=scales)
    info = ModelInfo.from_pretrained(tiny_moe.family, model_dir)
    assert (info.checkpoint_quantization, info.quantization) == ("fp8", "fp8")
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


def test_a_block_wise_expert_scale_names_the_checkpoint_and_tensor(tiny_moe: TinyMoE, tmp_path: Path) -> None:
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
