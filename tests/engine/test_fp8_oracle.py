"""The FP8 engine against transformers + PEFT computing the same quantized arithmetic
(tests/engine/fp8_oracle.py), with adapters, for every dense family: W8A16 in batches of up to
W8A16_MAX_TOKENS tokens, W8A8 in a longer prompt; FP8 checkpoints in both published formats load as
they are.

Tolerance: on CPU both sides compute in float32 from the same fp8 values (the engine dequantizes,
the oracle's weights are dequantized and its activations quantized then dequantized), so they differ
only by float32 reassociation: the unquantized oracle's 1e-4 (measured: below 5e-7). What that noise
could cause, an activation within float32 noise of an fp8 rounding boundary rounding the other way,
would move a logit by about one fp8 step of one element's contribution, 1e-3 at these sizes: it does
not happen on these seeded inputs, and if it did the test would say so. The check that quantization
happened at all: every row is more than ten tolerances from the unquantized oracle (measured:
2.5e-3 and more).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.quant import W8A16_MAX_TOKENS
from shared.errors import LorafleetError
from shared.model_info import ModelInfo
from tests.engine.engine_driver import BlockPool, PagedSequence, make_kv_cache, prefill
from tests.engine.engines import load_model
from tests.engine.fp8_oracle import fp8_oracle, save_fp8_checkpoint
from tests.engine.test_model_oracle import SLOTS, assert_greedy_decode_matches, mixed_sequences, random_prompt
from tests.engine.tiny_hf import TinyCheckpoint, oracle_logits
from worker.model.model import CausalLM

TOLERANCE = 1e-4


def fp8_model(model_dir: Path, info: ModelInfo, adapters: dict[str, Path] | None = None) -> CausalLM:
    """The model served with --quantization fp8, with SLOTS' adapters when given."""
    served = info.served(quantization="fp8", kv_cache_dtype="auto", source=model_dir)
    slots = {slot: adapters[name] for name, slot in SLOTS.items()} if adapters else {}
    return load_model(model_dir, served, slots)


def test_fp8_engine_matches_the_quantized_oracle_in_a_mixed_batch(checkpoint: TinyCheckpoint) -> None:
    model = fp8_model(checkpoint.model_dir, checkpoint.info, checkpoint.adapters)
    oracle = fp8_oracle(checkpoint.oracle)
    seqs = mixed_sequences()
    logits = prefill([seq for _, seq in seqs], model, make_kv_cache(model, num_blocks=64, block_size=4), BlockPool(64))
    for row, (adapter, seq) in enumerate(seqs):
        assert (logits[row] - oracle_logits(oracle, seq.token_ids, adapter)[-1]).abs().max() <= TOLERANCE
        plain = oracle_logits(checkpoint.oracle, seq.token_ids, adapter)[-1]
        assert (logits[row] - plain).abs().max() > 10 * TOLERANCE  # the base really ran in fp8


def test_a_long_prefill_takes_w8a8_as_the_oracle_does(llama: TinyCheckpoint) -> None:
    model = fp8_model(llama.model_dir, llama.info, llama.adapters)
    oracle, weight_only_oracle = fp8_oracle(llama.oracle), fp8_oracle(llama.oracle, quantize_activations=False)
    for adapter in (None, "all_r8"):
        seq = PagedSequence(random_prompt(W8A16_MAX_TOKENS + 9, seed=3), slot=-1 if adapter is None else SLOTS[adapter])
        logits = prefill([seq], model, make_kv_cache(model, num_blocks=32, block_size=4), BlockPool(32))
        assert (logits[0] - oracle_logits(oracle, seq.token_ids, adapter)[-1]).abs().max() <= TOLERANCE
        weight_only = oracle_logits(weight_only_oracle, seq.token_ids, adapter)[-1]
        assert (logits[0] - weight_only).abs().max() > 10 * TOLERANCE  # the activations really were quantized


def test_fp8_greedy_decode_matches_the_quantized_oracle(llama: TinyCheckpoint) -> None:
    model = fp8_model(llama.model_dir, llama.info, llama.adapters)
    assert_greedy_decode_matches(model, fp8_oracle(llama.oracle), steps=5)


@pytest.mark.parametrize(
    ("method", "scales"), [("fp8", "tensor"), ("compressed-tensors", "channel"), ("compressed-tensors", "tensor")]
)
def test_fp8_checkpoint_loads_as_it_is(llama: TinyCheckpoint, tmp_path: Path, method: str, scales: str) -> None:
    model_dir = save_fp8_checkpoint(llama.model_dir, tmp_path / "fp8", method=method, scales=scales)
    info = ModelInfo.from_pretrained("llama", model_dir)
    assert (info.checkpoint_quantization, info.quantization) == ("fp8", "fp8")
    model = fp8_model(model_dir, info, llama.adapters)
    oracle = fp8_oracle(llama.oracle, scales)
    seqs = mixed_sequences()[:3]
    logits = prefill([seq for _, seq in seqs], model, make_kv_cache(model, num_blocks=32, block_size=4), BlockPool(32))
    for row, (adapter, seq) in enumerate(seqs):
        assert (logits[row] - oracle_logits(oracle, seq.token_ids, adapter)[-1]).abs().max() <= TOLERANCE


def test_fp8_checkpoint_weights_are_not_requantized(llama: TinyCheckpoint, tmp_path: Path) -> None:
    model_dir = save_fp8_checkpoint(llama.model_dir, tmp_path / "fp8", method="fp8", scales="tensor")
    model = fp8_model(model_dir, ModelInfo.from_pretrained("llama", model_dir))
    saved = load_file(model_dir / "model.safetensors")
    qkv = model.model.layers[0].self_attn.qkv_proj
    q_rows = model.info.num_heads * model.info.head_dim
    assert torch.equal(
        qkv.weight[:q_rows].view(torch.uint8), saved["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8)
    )
    assert torch.all(qkv.weight_scale[:q_rows] == saved["model.layers.0.self_attn.q_proj.weight_scale"])


def test_a_missing_scale_tensor_names_it(llama: TinyCheckpoint, tmp_path: Path) -> None:
    model_dir = save_fp8_checkpoint(llama.model_dir, tmp_path / "fp8", method="compressed-tensors", scales="channel")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"llama: checkpoint lacks 1 tensors: model\.layers\.1\.mlp\.down_proj\.weight_scale"
    ):
        fp8_model(model_dir, ModelInfo.from_pretrained("llama", model_dir))


def test_fp8_checkpoint_served_unquantized_is_refused(llama: TinyCheckpoint, tmp_path: Path) -> None:
    model_dir = save_fp8_checkpoint(llama.model_dir, tmp_path / "fp8", method="fp8", scales="tensor")
    info = ModelInfo.from_pretrained("llama", model_dir)
    with pytest.raises(LorafleetError, match="fp8-quantized"):
        info.served(quantization="none", kv_cache_dtype="auto", source=model_dir)
