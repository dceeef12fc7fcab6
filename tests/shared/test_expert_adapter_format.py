"""Validation of MoE adapters: per-expert LoRAs are accepted with their shapes checked against the
base model (incomplete experts and dense-MLP LoRAs on MoE layers are refused with a code naming the
problem), and PEFT's own fused-parameter form is accepted at its ranks."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from shared.adapter_format import WEIGHTS_FILE, AdapterManifest, read_adapter
from shared.errors import ErrorCode, LorafleetError
from shared.model_info import ModelInfo
from tests.engine.tiny_moe import MOE_ADAPTERS, save_expert_adapter, save_tiny_moe


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelInfo, object]:
    directory = tmp_path_factory.mktemp("moe")
    base = save_tiny_moe("qwen3_moe", directory / "model", seed=0)
    return directory, ModelInfo.from_pretrained("moe", directory / "model"), base


def adapter(moe: tuple[Path, ModelInfo, object], name: str) -> Path:
    directory, info, _ = moe
    path = directory / name
    if not path.exists():
        save_expert_adapter(info, path, seed=1, **MOE_ADAPTERS["experts_r8"])
    return path


def inspect(path: Path, info: ModelInfo, *, max_rank: int = 64) -> AdapterManifest:
    return read_adapter(path.parent, path.name, info, max_rank=max_rank, max_bytes=1 << 30).manifest


def refused(path: Path, info: ModelInfo) -> LorafleetError:
    with pytest.raises(LorafleetError) as caught:
        inspect(path, info)
    return caught.value


def test_per_expert_adapter_is_accepted_with_its_expert_targets(moe) -> None:
    _, info, _ = moe
    manifest = inspect(adapter(moe, "ok"), info)
    assert manifest.rank == 8
    assert manifest.target_modules == ("q_proj", "o_proj", "experts.gate_proj", "experts.up_proj", "experts.down_proj")


def test_an_adapter_missing_an_expert_is_refused(moe) -> None:
    _, info, _ = moe
    path = adapter(moe, "missing")
    tensors = load_file(path / WEIGHTS_FILE)
    layer = info.moe_layers[0]
    for which in "AB":
        del tensors[f"base_model.model.model.layers.{layer}.mlp.experts.3.down_proj.lora_{which}.weight"]
    save_file(tensors, path / WEIGHTS_FILE)
    assert refused(path, info).code is ErrorCode.INVALID_ADAPTER


def test_an_expert_lora_of_the_wrong_shape_is_refused(moe) -> None:
    _, info, _ = moe
    path = adapter(moe, "shape")
    tensors = load_file(path / WEIGHTS_FILE)
    key = f"base_model.model.model.layers.{info.moe_layers[0]}.mlp.experts.0.gate_proj.lora_B.weight"
    tensors[key] = torch.zeros(info.intermediate_size, 8)  # the dense MLP's width, not the expert's
    save_file(tensors, path / WEIGHTS_FILE)
    assert refused(path, info).code is ErrorCode.ADAPTER_SHAPE_MISMATCH


def test_a_dense_mlp_lora_on_an_moe_layer_is_refused(moe) -> None:
    _, info, _ = moe
    path = adapter(moe, "dense")
    tensors = load_file(path / WEIGHTS_FILE)
    prefix = f"base_model.model.model.layers.{info.moe_layers[0]}.mlp.gate_proj"
    tensors[f"{prefix}.lora_A.weight"] = torch.zeros(8, info.hidden_size)
    tensors[f"{prefix}.lora_B.weight"] = torch.zeros(info.intermediate_size, 8)
    save_file(tensors, path / WEIGHTS_FILE)
    assert refused(path, info).code is ErrorCode.ADAPTER_SHAPE_MISMATCH


def test_peft_fused_expert_parameters_are_accepted_at_their_own_ranks(moe, tmp_path: Path) -> None:
    _, info, base = moe
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    get_peft_model(copy.deepcopy(base), config).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["target_parameters"]  # the experts' form
    # PEFT 0.22 also adapts the dense first layer's MLP for those names (0.21 dropped it): listed if saved
    dense_mlp = ("gate_proj", "up_proj", "down_proj")
    saved = load_file(tmp_path / WEIGHTS_FILE)
    dense = tuple(p for p in dense_mlp if f"base_model.model.model.layers.0.mlp.{p}.lora_A.weight" in saved)

    manifest = inspect(tmp_path, info, max_rank=8)

    assert dense in ((), dense_mlp)
    assert manifest.target_modules == ("q_proj", *dense, "experts.gate_up_proj", "experts.down_proj")
    assert manifest.fused_experts is not None
    assert dict(manifest.fused_experts.ranks) == {"gate_up_proj": 8, "down_proj": 4}  # gate and up fused: 2r
    assert manifest.rank == 4 and manifest.serving_rank == 8
    with pytest.raises(LorafleetError) as caught:  # the doubled rank counts against the slot rank
        inspect(tmp_path, info, max_rank=4)
    assert caught.value.code is ErrorCode.ADAPTER_RANK_TOO_LARGE


def test_fused_targets_other_than_the_experts_are_refused(moe, tmp_path: Path) -> None:
    directory = adapter(moe, "fused_ok")
    config = json.loads((directory / "adapter_config.json").read_text())
    (tmp_path / "adapter_model.safetensors").write_bytes((directory / WEIGHTS_FILE).read_bytes())
    (tmp_path / "adapter_config.json").write_text(json.dumps(config | {"target_parameters": ["mlp.gate.weight"]}))
    error = refused(tmp_path, moe[1])
    assert error.code is ErrorCode.ADAPTER_UNSUPPORTED and "target_parameters" in error.message
