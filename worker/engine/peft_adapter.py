"""A PEFT LoRA adapter's tensors, from the bytes shared/adapter_format read once and validated."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load

from shared.adapter_format import read_adapter
from shared.model_info import ModelInfo
from worker.engine.moe_adapter import expert_loras

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


def _buffer(nbytes: int) -> memoryview:
    return memoryview(bytearray(nbytes))


def load_adapter_weights(adapter_dir: Path, info: ModelInfo, *, max_rank: int, max_bytes: int) -> AdapterWeights:
    """Read `adapter_dir` once, confined to its parent directory, validate it against the base model
    (raising LorafleetError naming the problem), and give its matrices on the CPU in the file's dtype."""
    adapter_dir = Path(adapter_dir)
    files = read_adapter(
        adapter_dir.parent, adapter_dir.name, info, max_rank=max_rank, max_bytes=max_bytes, allocate=_buffer
    )
    manifest = files.manifest
    tensors = load(files.weights_file())
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
