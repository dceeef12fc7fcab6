"""Per-expert LoRA tensors of an MoE adapter, without torch: their PEFT names and shape checks.

Adapters for Qwen3-MoE / Mixtral trained with per-expert targets (the hub's form, and what PEFT
reads back on any transformers version) name one LoRA per expert and projection:

    base_model.model.model.layers.{L}.mlp.experts.{e}.gate_proj.lora_A.weight              (Qwen3-MoE)
    base_model.model.model.layers.{L}.block_sparse_moe.experts.{e}.w1.lora_A.weight        (Mixtral)

with A [r, in_features] and B [out_features, r] like any projection. An adapter must give every
expert of a projection it targets (PEFT's target_modules match them all or none).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shared.errors import ErrorCode, LorafleetError
from shared.model_info import EXPERT_PROJECTIONS, MOE_BLOCK, ModelInfo

_EXPERT_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.lora_([AB])\.weight$"
)


@dataclass(frozen=True, slots=True)
class ExpertKey:
    layer: int
    expert: int
    projection: str  # the family's name: gate_proj / w1 …
    which: str  # "A" or "B"


def expert_key(info: ModelInfo, layer: int, expert: int, projection: str, which: str) -> str:
    """PEFT's tensor name for one expert's LoRA matrix."""
    block = MOE_BLOCK[info.architecture]
    return f"base_model.model.model.layers.{layer}.{block}.experts.{expert}.{projection}.lora_{which}.weight"


def parse_expert_key(name: str, info: ModelInfo) -> ExpertKey | None:
    """The expert LoRA `name` refers to, or None if it is not an expert key of this model's family."""
    match = _EXPERT_KEY.match(name)
    if match is None or not info.is_moe or match[2] != MOE_BLOCK[info.architecture]:
        return None
    return ExpertKey(int(match[1]), int(match[3]), match[4], match[5])


def check_expert_tensor(name: str, key: ExpertKey, shape: list[int], info: ModelInfo, rank: int) -> None:
    """Raise LorafleetError unless `name` is an expert LoRA matrix this model has, of the right shape."""
    if key.layer not in info.moe_layers:
        raise LorafleetError(ErrorCode.ADAPTER_SHAPE_MISMATCH, f"{name}: layer {key.layer} has no experts")
    if key.expert >= info.num_experts:
        raise LorafleetError(ErrorCode.ADAPTER_SHAPE_MISMATCH, f"{name}: the base model has {info.num_experts} experts")
    if key.projection not in EXPERT_PROJECTIONS[info.architecture]:
        raise LorafleetError(ErrorCode.ADAPTER_UNSUPPORTED, f"{name}: experts have no projection {key.projection!r}")
    in_features, out_features = info.expert_projection_shape(key.projection)
    expected = [rank, in_features] if key.which == "A" else [out_features, rank]
    if shape != expected:
        raise LorafleetError(
            ErrorCode.ADAPTER_SHAPE_MISMATCH, f"{name}: shape {shape} does not match the base model's {expected}"
        )


def check_experts_complete(experts_seen: dict[tuple[int, str], set[int]], info: ModelInfo) -> tuple[str, ...]:
    """Raise unless each (layer, projection) targeted has every expert, and gate/up come together
    (they share one packed LoRA); returns the targets as `experts.{projection}`, in family order."""
    for (layer, projection), experts in experts_seen.items():
        if len(experts) != info.num_experts:
            raise LorafleetError(
                ErrorCode.INVALID_ADAPTER,
                f"layers.{layer} {projection}: LoRA for {len(experts)} of {info.num_experts} experts",
            )
    gate, up, down = EXPERT_PROJECTIONS[info.architecture] if info.is_moe else ("", "", "")
    targets = {projection for _, projection in experts_seen}
    if (gate in targets) != (up in targets):
        raise LorafleetError(ErrorCode.ADAPTER_UNSUPPORTED, f"experts' {gate} and {up} must be adapted together")
    return tuple(f"experts.{p}" for p in (gate, up, down) if p in targets)
