"""A PEFT LoRA adapter's tensors, read from its directory after shared/adapter_format validated it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from shared.adapter_format import WEIGHTS_FILE, inspect_adapter
from shared.model_info import ModelInfo
from worker.adapter_pool.moe_adapter import expert_loras

ATTENTION_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """One adapter in host memory, ready to be copied into a model's adapter slot."""

    rank: int
    scaling: float  # what PEFT multiplies B·A·x by: alpha/r, or alpha/√r with rsLoRA
    # (layer, projection) → (A [rank, in_features], B [out_features, rank]); projection as PEFT names
    # it (q_proj … down_proj). A (layer, projection) absent here is not adapted.
    lora: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    sha256: str  # of adapter_model.safetensors: the weights' identity
    # MoE models: (layer, expert projection as the family names it) → (A [E, rank, in], B [E, out, rank])
    experts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def peft_key(layer: int, projection: str, matrix: str) -> str:
    """PEFT's tensor name for LoRA matrix `matrix` ("A" or "B") of one projection."""
    block = "self_attn" if projection in ATTENTION_PROJECTIONS else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{projection}.lora_{matrix}.weight"


def load_adapter_weights(adapter_dir: Path, info: ModelInfo, *, max_rank: int, max_bytes: int) -> AdapterWeights:
    """Validate `adapter_dir` against the base model (raising LorafleetError naming the problem),
    then read its matrices onto the CPU in the file's dtype."""
    manifest = inspect_adapter(Path(adapter_dir), info, max_rank=max_rank, max_bytes=max_bytes)
    tensors = load_file(Path(adapter_dir) / WEIGHTS_FILE)
    lora = {}
    # validation guarantees every tensor is a paired A/B of a target module; PEFT may still skip
    # layers (layers_to_transform), hence the membership test
    for layer in range(info.num_layers):
        for projection in manifest.target_modules:
            a_key = peft_key(layer, projection, "A")
            if a_key in tensors:
                lora[(layer, projection)] = (tensors[a_key], tensors[peft_key(layer, projection, "B")])
    return AdapterWeights(
        rank=manifest.rank,
        scaling=manifest.scaling,
        lora=lora,
        sha256=manifest.sha256,
        experts=expert_loras(tensors, info, manifest.fused_experts, manifest.scaling),
    )
