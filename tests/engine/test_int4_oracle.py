"""The W4A16 engine against transformers + PEFT over the dequantized 4-bit base
(tests/engine/int4_oracle.py), with adapters: quantized at load (--quantization int4), and loaded
from AWQ and GPTQ checkpoints as published; bad 4-bit checkpoints are refused naming the file.

Tolerance: on CPU both sides compute in float32 from the same dequantized weights ((q - zero) *
scale of the same 4-bit values, float16 scales and integer zero points, each product exact in
float32 up to one rounding, the same on both sides), and the activations are not quantized (A16):
the two differ only by float32 reassociation, the unquantized oracle's 1e-4. Unlike W8A8 there is
no rounding boundary an activation could cross, so nothing larger can appear. The check that
quantization happened at all: every row is more than ten tolerances from the unquantized oracle.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.config import EngineConfig, ModelSpec
from shared.errors import LorafleetError
from shared.model_info import ModelInfo
from tests.engine.engine_driver import BlockPool, make_kv_cache, prefill
from tests.engine.engines import load_model
from tests.engine.int4_oracle import INT4_SHAPE, int4_oracle, quantization_config, save_int4_checkpoint
from tests.engine.test_model_oracle import SLOTS, assert_greedy_decode_matches, mixed_sequences
from tests.engine.tiny_hf import TinyCheckpoint, build_checkpoint, oracle_logits
from worker.model.model import CausalLM
from worker.switching.loader import served_info

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyCheckpoint]:
    """The tiny llama with widths of whole 128-input groups, and its adapters."""
    yield build_checkpoint("llama", tmp_path_factory.mktemp("int4_llama"), **INT4_SHAPE)


@pytest.fixture(scope="module")
def oracle(wide_llama: TinyCheckpoint):
    return int4_oracle(wide_llama.oracle)


def int4_model(model_dir: Path, info: ModelInfo, adapters: dict[str, Path] | None = None) -> CausalLM:
    """The model served with --quantization int4, with SLOTS' adapters when given."""
    served = info.served(quantization="int4", kv_cache_dtype="auto", source=model_dir)
    slots = {slot: adapters[name] for name, slot in SLOTS.items()} if adapters else {}
    return load_model(model_dir, served, slots)


def check_mixed_batch(model: CausalLM, oracle, plain) -> None:
    seqs = mixed_sequences()
    logits = prefill([seq for _, seq in seqs], model, make_kv_cache(model, num_blocks=64, block_size=4), BlockPool(64))
    for row, (adapter, seq) in enumerate(seqs):
        assert (logits[row] - oracle_logits(oracle, seq.token_ids, adapter)[-1]).abs().max() <= TOLERANCE
        unquantized = oracle_logits(plain, seq.token_ids, adapter)[-1]
        assert (logits[row] - unquantized).abs().max() > 10 * TOLERANCE  # the base really ran in 4 bits


def test_int4_at_load_matches_the_dequantized_oracle_in_a_mixed_batch(wide_llama: TinyCheckpoint, oracle) -> None:
    model = int4_model(wide_llama.model_dir, wide_llama.info, wide_llama.adapters)
    assert model.info.quantization == "int4" and model.info.weight_group_size == 128
    assert model.model.layers[0].mlp.down_proj.qweight.dtype == torch.int32
    check_mixed_batch(model, oracle, wide_llama.oracle)


def test_int4_greedy_decode_matches_the_dequantized_oracle(wide_llama: TinyCheckpoint, oracle) -> None:
    model = int4_model(wide_llama.model_dir, wide_llama.info, wide_llama.adapters)
    assert_greedy_decode_matches(model, oracle, steps=5)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_published_4bit_checkpoint_matches_the_same_oracle(
    wide_llama: TinyCheckpoint, oracle, tmp_path: Path, method: str
) -> None:
    model_dir = save_int4_checkpoint(wide_llama.model_dir, tmp_path / method, method=method)
    info = ModelInfo.from_pretrained("llama", model_dir)
    assert (info.checkpoint_quantization, info.weight_group_size) == (method, 128)
    served = info.served(quantization=None, kv_cache_dtype="auto", source=model_dir)
    assert served.quantization == method
    model = load_model(model_dir, served, {slot: wide_llama.adapters[name] for name, slot in SLOTS.items()})
    check_mixed_batch(model, oracle, wide_llama.oracle)


def test_gptq_weights_are_copied_as_published(wide_llama: TinyCheckpoint, tmp_path: Path) -> None:
    model_dir = save_int4_checkpoint(wide_llama.model_dir, tmp_path / "gptq", method="gptq")
    model = int4_model(model_dir, ModelInfo.from_pretrained("llama", model_dir))
    saved = load_file(model_dir / "model.safetensors")
    qkv = model.model.layers[0].self_attn.qkv_proj
    k_columns = slice(128, 128 + 64)  # after q's 128 columns
    assert torch.equal(qkv.qweight[:, k_columns], saved["model.layers.0.self_attn.k_proj.qweight"])
    assert torch.equal(qkv.scales[:, k_columns], saved["model.layers.0.self_attn.k_proj.scales"])


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"bits": 8}, "8-bit weights: only 4-bit"),
        ({"group_size": 96}, "group_size 96 is not supported"),
        ({"group_size": -1}, "group_size -1 is not supported"),
        ({"desc_act": True}, "desc_act true"),
        ({"checkpoint_format": "gptq_v2"}, "checkpoint_format 'gptq_v2'"),
    ],
)
def test_unsupported_gptq_configs_are_refused_naming_the_file(
    wide_llama: TinyCheckpoint, tmp_path: Path, fields: dict, problem: str
) -> None:
    model_dir = _checkpoint_config(wide_llama.model_dir, tmp_path, quantization_config("gptq", **fields))
    with pytest.raises(LorafleetError, match=rf"{model_dir / 'config.json'}: .*{problem}"):
        ModelInfo.from_pretrained("llama", model_dir)


@pytest.mark.parametrize(
    ("fields", "problem"), [({"version": "gemv"}, "version 'gemv'"), ({"zero_point": False}, "zero_point false")]
)
def test_unsupported_awq_configs_are_refused_naming_the_file(
    wide_llama: TinyCheckpoint, tmp_path: Path, fields: dict, problem: str
) -> None:
    model_dir = _checkpoint_config(wide_llama.model_dir, tmp_path, quantization_config("awq", **fields))
    with pytest.raises(LorafleetError, match=rf"{model_dir / 'config.json'}: .*{problem}"):
        ModelInfo.from_pretrained("llama", model_dir)


def test_int4_at_load_takes_smaller_groups_for_narrow_widths_and_matches_their_oracle(llama: TinyCheckpoint) -> None:
    # the default tiny model's widths are 64 and 96: whole groups of 32, not of 128 or 64
    served = llama.info.served(quantization="int4", kv_cache_dtype="auto", source=llama.model_dir)
    assert served.weight_group_size == 32
    model = load_model(llama.model_dir, served, {slot: llama.adapters[name] for name, slot in SLOTS.items()})
    check_mixed_batch(model, int4_oracle(llama.oracle, group_size=32), llama.oracle)


def test_int4_at_load_refuses_widths_in_no_whole_group(llama: TinyCheckpoint) -> None:
    info = dataclasses.replace(llama.info, intermediate_size=100)
    with pytest.raises(LorafleetError, match=r"whole groups of 32 or more; this model has down_proj 100"):
        info.served(quantization="int4", kv_cache_dtype="auto", source=llama.model_dir)


def served_at_start(model_dir: Path) -> ModelInfo:
    """The model as a worker starting on it serves it (worker/switching/loader.served_info)."""
    return served_info(ModelSpec("llama", model_dir), EngineConfig())


@pytest.mark.parametrize(
    ("method", "tensor"),
    [("awq", "model.layers.1.mlp.down_proj.qzeros"), ("gptq", "model.layers.0.self_attn.o_proj.scales")],
)
def test_a_missing_4bit_tensor_is_refused_at_start_naming_it(
    wide_llama: TinyCheckpoint, tmp_path: Path, method: str, tensor: str
) -> None:
    model_dir = save_int4_checkpoint(wide_llama.model_dir, tmp_path / method, method=method)
    assert served_at_start(model_dir).quantization == method
    tensors = load_file(model_dir / "model.safetensors")
    del tensors[tensor]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(LorafleetError, match=rf"^{model_dir}: {re.escape(tensor)} is missing: a {method} checkpoint"):
        served_at_start(model_dir)


@pytest.mark.parametrize(
    ("method", "change", "problem"),
    [
        ("awq", "transpose", "I32 [32, 128]; a awq checkpoint in groups of 128 needs I32 [128, 32]"),
        ("gptq", "transpose", "I32 [256, 16]; a gptq checkpoint in groups of 128 needs I32 [16, 256]"),
        ("gptq", "float", "F32 [16, 256]; a gptq checkpoint in groups of 128 needs I32 [16, 256]"),
    ],
)
def test_a_misshapen_4bit_tensor_is_refused_at_start_naming_its_file(
    wide_llama: TinyCheckpoint, tmp_path: Path, method: str, change: str, problem: str
) -> None:
    model_dir = save_int4_checkpoint(wide_llama.model_dir, tmp_path / method, method=method)
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.qweight"  # up_proj: K 128, N 256
    tensors[name] = tensors[name].T.contiguous() if change == "transpose" else tensors[name].float()
    save_file(tensors, model_dir / "model.safetensors")
    message = f"{model_dir / 'model.safetensors'}: {name} is {problem}"
    with pytest.raises(LorafleetError, match=f"^{re.escape(message)}$"):
        served_at_start(model_dir)


def test_a_4bit_checkpoint_served_unquantized_is_refused(wide_llama: TinyCheckpoint, tmp_path: Path) -> None:
    model_dir = save_int4_checkpoint(wide_llama.model_dir, tmp_path / "awq", method="awq")
    info = ModelInfo.from_pretrained("llama", model_dir)
    with pytest.raises(LorafleetError, match="awq-quantized"):
        info.served(quantization="fp8", kv_cache_dtype="auto", source=model_dir)


def _checkpoint_config(model_dir: Path, directory: Path, quant: dict) -> Path:
    """`directory` holding only `model_dir`'s config.json, with `quant` as its quantization_config."""
    config = json.loads((model_dir / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return directory
