"""Adapter validation: each kind of bad adapter is refused with the code that names it."""

from __future__ import annotations

import dataclasses
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from shared import adapter_digest
from shared.adapter_digest import file_digest
from shared.adapter_format import read_adapter
from shared.adapter_paths import adapter_relative_path
from shared.errors import ErrorCode, LorafleetError
from shared.model_info import ModelInfo

MODEL = ModelInfo(
    name="tiny",
    architecture="LlamaForCausalLM",
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    vocab_size=100,
    max_context=128,
    rope_theta=10000.0,
    rope_scaling=None,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=1,
    eos_token_ids=(2,),
    torch_dtype="float32",
)


def write_adapter(directory: Path, *, rank: int = 4, targets=("q_proj", "v_proj"), config_extra=None, tensors=None):
    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": list(targets), "bias": "none"}
    config.update(config_extra or {})
    (directory / "adapter_config.json").write_text(json.dumps(config))
    if tensors is None:
        tensors = {}
        for layer in range(MODEL.num_layers):
            for proj in targets:
                in_f, out_f = MODEL.projection_shape(proj)
                block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
                tensors[f"{prefix}.lora_A.weight"] = np.ones((rank, in_f), np.float32)
                tensors[f"{prefix}.lora_B.weight"] = np.ones((out_f, rank), np.float32)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def check(directory: Path, model: ModelInfo = MODEL, *, max_bytes: int = 1 << 20):
    return read_adapter(directory.parent, directory.name, model, max_rank=16, max_bytes=max_bytes).manifest


def refusal(directory: Path) -> ErrorCode:
    with pytest.raises(LorafleetError) as info:
        check(directory)
    return info.value.code


def test_valid_adapter_is_described(tmp_path):
    manifest = check(write_adapter(tmp_path / "a", rank=4, targets=("q_proj", "down_proj")))
    assert manifest.rank == 4
    assert manifest.target_modules == ("q_proj", "down_proj")
    assert manifest.scaling == 2.0
    assert manifest.digest.startswith("sha256-pieces-8MiB:") and len(manifest.digest) == len("sha256-pieces-8MiB:") + 64


def test_data_read_into_a_buffer_in_many_pieces_is_the_file_and_hashes_as_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(adapter_digest, "PIECE_BYTES", 300)  # each piece hashed while the next is read
    directory = write_adapter(tmp_path / "a", rank=4, targets=("q_proj", "down_proj"))
    buffers = []

    def allocate(n: int, *_: object) -> memoryview:
        buffers.append(bytearray(n))
        return memoryview(buffers[0])

    with ThreadPoolExecutor(3) as hasher:  # pieces finish out of order: combined in file order all the same
        files = read_adapter(tmp_path, "a", MODEL, max_rank=16, max_bytes=1 << 20, allocate=allocate, hasher=hasher)
    weights = directory / "adapter_model.safetensors"
    assert files.header + bytes(files.data) == weights.read_bytes()
    assert len(files.data) > 10 * 300
    assert files.manifest.digest == file_digest(weights) == check(directory).digest  # with and without a buffer


def test_rslora_scaling_uses_the_square_root_of_the_rank(tmp_path):
    manifest = check(write_adapter(tmp_path / "a", rank=4, config_extra={"use_rslora": True}))
    assert manifest.scaling == 4.0


def test_rank_over_the_limit_is_refused(tmp_path):
    assert refusal(write_adapter(tmp_path / "a", rank=32)) is ErrorCode.ADAPTER_RANK_TOO_LARGE


@pytest.mark.parametrize("feature", [{"use_dora": True}, {"modules_to_save": ["lm_head"]}, {"peft_type": "IA3"}])
def test_unsupported_peft_features_are_refused(tmp_path, feature):
    assert refusal(write_adapter(tmp_path / "a", config_extra=feature)) is ErrorCode.ADAPTER_UNSUPPORTED


def test_shapes_that_do_not_match_the_base_model_are_refused(tmp_path):
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.ones((4, 99), np.float32),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.ones((32, 4), np.float32),
    }
    assert refusal(write_adapter(tmp_path / "a", tensors=tensors)) is ErrorCode.ADAPTER_SHAPE_MISMATCH


def test_layer_beyond_the_base_model_is_refused(tmp_path):
    tensors = {
        "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": np.ones((4, 32), np.float32),
        "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight": np.ones((32, 4), np.float32),
    }
    assert refusal(write_adapter(tmp_path / "a", tensors=tensors)) is ErrorCode.ADAPTER_SHAPE_MISMATCH


def test_a_without_b_is_refused(tmp_path):
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.ones((4, 32), np.float32)}
    assert refusal(write_adapter(tmp_path / "a", tensors=tensors)) is ErrorCode.INVALID_ADAPTER


def test_pickled_weights_are_never_loaded(tmp_path):
    directory = write_adapter(tmp_path / "a")
    (directory / "adapter_model.safetensors").rename(directory / "adapter_model.bin")
    with pytest.raises(LorafleetError, match="pickled weights are never loaded") as info:
        check(directory)
    assert info.value.code is ErrorCode.ADAPTER_FILE_MISSING


def test_corrupt_safetensors_is_refused(tmp_path):
    directory = write_adapter(tmp_path / "a")
    (directory / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    assert refusal(directory) is ErrorCode.INVALID_SAFETENSORS


def test_oversized_adapter_is_refused(tmp_path):
    directory = write_adapter(tmp_path / "a")
    with pytest.raises(LorafleetError) as info:
        check(directory, max_bytes=10)
    assert info.value.code is ErrorCode.ADAPTER_TOO_LARGE


def test_paths_are_confined_to_the_adapter_root(tmp_path):
    root = tmp_path / "root"
    inside = write_adapter(root / "tenant" / "a")
    outside = write_adapter(tmp_path / "elsewhere")
    os.symlink(outside, root / "escape")
    assert adapter_relative_path(root, "tenant/a") == "tenant/a"
    assert adapter_relative_path(root, str(inside)) == "tenant/a"
    for bad in ("../elsewhere", str(outside), "tenant/../../elsewhere"):
        with pytest.raises(LorafleetError) as info:
            adapter_relative_path(root, bad)
        assert info.value.code is ErrorCode.ADAPTER_PATH_OUTSIDE_ROOT, bad
    with pytest.raises(LorafleetError) as info:
        read_adapter(root, "escape", MODEL, max_rank=16, max_bytes=1 << 20)
    assert info.value.code is ErrorCode.ADAPTER_SYMLINK


@pytest.mark.parametrize(
    "config_extra",
    [{"rank_pattern": {"q_proj": 8}}, {"alpha_pattern": {"q_proj": 8}}, {"fan_in_fan_out": True}, {"bias": "all"}],
)
def test_more_unsupported_peft_features_are_refused(tmp_path, config_extra):
    assert refusal(write_adapter(tmp_path / "a", config_extra=config_extra)) is ErrorCode.ADAPTER_UNSUPPORTED


def test_a_tensor_that_is_not_a_lora_matrix_is_refused(tmp_path):
    tensors = {"base_model.model.lm_head.weight": np.ones((100, 32), np.float32)}  # modules_to_save's weights
    assert refusal(write_adapter(tmp_path / "a", tensors=tensors)) is ErrorCode.ADAPTER_UNSUPPORTED


def test_a_weight_dtype_other_than_f16_bf16_f32_is_refused(tmp_path):
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{prefix}.lora_A.weight": np.ones((4, 32), np.float64), f"{prefix}.lora_B.weight": np.ones((32, 4))}
    with pytest.raises(LorafleetError, match="dtype") as info:
        check(write_adapter(tmp_path / "a", tensors=tensors))
    assert info.value.code is ErrorCode.ADAPTER_DTYPE_UNSUPPORTED


@pytest.mark.parametrize(
    ("config_text", "message", "code"),
    [
        (None, "missing", ErrorCode.ADAPTER_FILE_MISSING),
        ("{", "not valid JSON", ErrorCode.INVALID_ADAPTER_CONFIG),
        ("[]", "object", ErrorCode.INVALID_ADAPTER_CONFIG),
    ],
)
def test_a_missing_or_unreadable_config_is_refused(tmp_path, config_text, message, code):
    directory = write_adapter(tmp_path / "a")
    config = directory / "adapter_config.json"
    if config_text is None:
        config.unlink()
    else:
        config.write_text(config_text)
    with pytest.raises(LorafleetError, match=message) as info:
        check(directory)
    assert info.value.code is code


@pytest.mark.parametrize("rank", [0, "8", None, True, 4.0, -4])
def test_a_rank_that_is_not_a_positive_integer_is_refused(tmp_path, rank):
    assert refusal(write_adapter(tmp_path / "a", config_extra={"r": rank})) is ErrorCode.INVALID_ADAPTER_CONFIG


def test_an_adapter_without_lora_matrices_is_refused(tmp_path):
    assert refusal(write_adapter(tmp_path / "a", tensors={})) is ErrorCode.INVALID_ADAPTER


def test_an_adapter_for_another_base_model_is_refused_by_its_shapes(tmp_path):
    wider = dataclasses.replace(MODEL, name="wider", hidden_size=64)
    directory = write_adapter(tmp_path / "a")  # made for MODEL (hidden 32)
    with pytest.raises(LorafleetError) as info:
        check(directory, wider)
    assert info.value.code is ErrorCode.ADAPTER_SHAPE_MISMATCH
