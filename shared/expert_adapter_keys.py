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


# PEFT >= 0.18 on transformers 5 saves LoRAs of MoE experts on the fused 3-D parameters instead
# (`target_parameters`): per layer one A [E·r, in] and one B [out, r·E] for each of gate_up_proj
# [E, 2I, H] and down_proj [E, H, I], under `…mlp.experts.lora_A.weight` and, for the parameter
# wrapped second, `…mlp.experts.base_layer.lora_A.weight`. Targets named gate_proj/up_proj become
# gate_up_proj with rank and alpha doubled through rank_pattern / alpha_pattern.
FUSED_PARAMETERS = ("gate_up_proj", "down_proj")
_FUSED_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)lora_([AB])\.weight$"
)


@dataclass(frozen=True, slots=True)
class FusedExperts:
    """The fused expert parameters an adapter targets, with each one's rank and LoRA scale."""

    ranks: tuple[tuple[str, int], ...]  # (parameter, rank)
    scales: tuple[tuple[str, float], ...]  # (parameter, alpha/r or alpha/√r)

    def rank(self, parameter: str) -> int:
        return dict(self.ranks)[parameter]

    def scale(self, parameter: str) -> float:
        return dict(self.scales)[parameter]


@dataclass(frozen=True, slots=True)
class FusedKey:
    layer: int
    wrapper: str  # "" or "base_layer." …: which of the nested wrappers; pairs an A with its B
    which: str  # "A" or "B"


def fused_experts(config: dict) -> FusedExperts | None:
    """The fused-parameter targets of an adapter config, None if it has none. Raises LorafleetError
    for targets other than the experts' gate_up_proj / down_proj, or rank/alpha patterns on anything
    else (PEFT writes them only for the fused gate_up)."""
    targets = config.get("target_parameters") or []
    if not targets:
        return None
    unknown = sorted(set(targets) - set(FUSED_PARAMETERS))
    if unknown:
        raise LorafleetError(ErrorCode.ADAPTER_UNSUPPORTED, f"target_parameters {unknown}: not MoE expert parameters")
    rank, alpha = config["r"], float(config.get("lora_alpha", config["r"]))
    patterns: dict[str, dict[str, float]] = {"rank_pattern": {}, "alpha_pattern": {}}
    for field_name, values in patterns.items():
        for key, value in (config.get(field_name) or {}).items():
            parameter = next((p for p in targets if key.endswith(p)), None)
            if parameter is None:
                raise LorafleetError(ErrorCode.ADAPTER_UNSUPPORTED, f"{field_name} {key!r}: not an expert parameter")
            values[parameter] = value
    ranks = {p: int(patterns["rank_pattern"].get(p, rank)) for p in targets}
    alphas = {p: float(patterns["alpha_pattern"].get(p, alpha)) for p in targets}
    rslora = bool(config.get("use_rslora", False))
    scales = {p: alphas[p] / (ranks[p] ** 0.5 if rslora else ranks[p]) for p in targets}
    return FusedExperts(tuple(sorted(ranks.items())), tuple(sorted(scales.items())))


def parse_fused_key(name: str, info: ModelInfo) -> FusedKey | None:
    match = _FUSED_KEY.match(name)
    if match is None or not info.is_moe:
        return None
    return FusedKey(int(match[1]), match[2], match[3])


def fused_parameter_of(shape: list[int], key: FusedKey, fused: FusedExperts, info: ModelInfo) -> str:
    """Which fused parameter a tensor of this shape is the LoRA A or B of; raises if none fits."""
    experts, hidden, width = info.num_experts, info.hidden_size, info.moe_intermediate_size
    dims = {"gate_up_proj": (hidden, 2 * width), "down_proj": (width, hidden)}  # (in, out)
    for parameter, rank in fused.ranks:
        in_features, out_features = dims[parameter]
        expected = [experts * rank, in_features] if key.which == "A" else [out_features, rank * experts]
        if shape == expected:
            return parameter
    raise LorafleetError(
        ErrorCode.ADAPTER_SHAPE_MISMATCH,
        f"layers.{key.layer} experts lora_{key.which}: shape {shape} fits no targeted expert parameter",
    )
