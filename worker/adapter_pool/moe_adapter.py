"""An adapter's LoRAs of MoE experts, read into per-expert (A, B) stacks that host_adapter.py packs for
the slot writer: from the per-expert form or from PEFT's fused-parameter form
(shared/expert_adapter_keys.py describes both and validates them first)."""

from __future__ import annotations

import torch

from shared.expert_adapter_keys import FusedExperts, FusedKey, expert_key, fused_parameter_of, parse_fused_key
from shared.model_info import EXPERT_PROJECTIONS, ModelInfo

ExpertLoRAPair = tuple[torch.Tensor, torch.Tensor]  # (A [E, r, in_features], B [E, out_features, r])


def stack_expert_loras(tensors: dict[str, torch.Tensor], info: ModelInfo) -> dict[tuple[int, str], ExpertLoRAPair]:
    """(layer, expert projection) → (A [E, r, in], B [E, out, r]) from an adapter's validated
    per-expert tensors (shared/expert_adapter_keys.py checked names, shapes and completeness)."""
    stacked: dict[tuple[int, str], ExpertLoRAPair] = {}
    if not info.is_moe:
        return stacked
    for layer in info.moe_layers:
        for projection in EXPERT_PROJECTIONS[info.architecture]:
            keys = [expert_key(info, layer, e, projection, "A") for e in range(info.num_experts)]
            if keys[0] not in tensors:
                continue
            b_keys = [expert_key(info, layer, e, projection, "B") for e in range(info.num_experts)]
            stacked[(layer, projection)] = (
                torch.stack([tensors[k] for k in keys]),
                torch.stack([tensors[k] for k in b_keys]),
            )
    return stacked


def expert_loras(
    tensors: dict[str, torch.Tensor], info: ModelInfo, fused: FusedExperts | None, scaling: float
) -> dict[tuple[int, str], ExpertLoRAPair]:
    """(layer, expert projection) → (A [E, r, in], B [E, out, r]) of a validated adapter, per-expert or
    fused: a fused gate_up LoRA (rank 2r, A [E·2r, H], B [2I, 2r·E]) serves both gate (B's first I
    rows) and up (the rest) with the same A; its scale, where it differs from the adapter's
    `scaling` (rsLoRA with PEFT's doubled rank), is folded into B."""
    if fused is None:
        return stack_expert_loras(tensors, info)
    experts = info.num_experts
    gate, up, down = EXPERT_PROJECTIONS[info.architecture]
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        key = parse_fused_key(name, info)
        if key is not None:
            pairs.setdefault((key.layer, key.wrapper), {})[key.which] = tensor
    loras: dict[tuple[int, str], ExpertLoRAPair] = {}
    for (layer, _), pair in pairs.items():
        a, b = pair["A"], pair["B"]
        parameter = fused_parameter_of(list(a.shape), FusedKey(layer, "", "A"), fused, info)
        rank = fused.rank(parameter)
        stacked_a = a.view(experts, rank, a.shape[1])  # PEFT: A rows are expert-major
        stacked_b = b.view(b.shape[0], rank, experts).permute(2, 0, 1)  # B columns are rank-major
        stacked_b = stacked_b * (fused.scale(parameter) / scaling)
        if parameter == "down_proj":
            loras[(layer, down)] = (stacked_a, stacked_b)
        else:
            width = info.moe_intermediate_size
            loras[(layer, gate)] = (stacked_a, stacked_b[:, :width])
            loras[(layer, up)] = (stacked_a, stacked_b[:, width:])
    return loras
