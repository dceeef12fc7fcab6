"""What a worker's adapter pool can serve for a model, as the worker publishes it in the model's record
(shared/model_registry.AdapterLimits), for the gateway to refuse at once what it could not load: slot
ranks up to --max-lora-rank, on the projections the model has LoRA slots for, named as adapter
manifests name them (shared/adapter_format.py): q_proj … down_proj, and every expert's
`experts.gate_proj` … or, read into the same slots, PEFT's fused `experts.gate_up_proj` / `experts.down_proj`."""

from __future__ import annotations

from shared.config import EngineConfig
from shared.expert_adapter_keys import FUSED_PARAMETERS
from shared.model_info import PROJECTIONS, ModelInfo
from shared.model_registry import AdapterLimits
from worker.model.model import CausalLM
from worker.model.moe import MoEBlock


def adapter_limits(info: ModelInfo, config: EngineConfig) -> AdapterLimits:
    """The limits of `info`'s adapter slots under `config`, read off the model built on the meta device;
    without LoRA (--max-loras 0), none: rank 0 on no projection."""
    if not config.lora_enabled:
        return AdapterLimits(max_rank=0, target_modules=())
    model = CausalLM(info, max_loras=1, max_lora_rank=config.max_lora_rank, device="meta")
    dense: set[str] = set()
    experts: set[str] = set()
    for layer in model.model.layers:
        dense.update(name for linear in layer.lora_linears() for name in linear.projections)
        if isinstance(layer.mlp, MoEBlock):
            experts.update(layer.mlp.lora_slot_views())
            experts.update(f"experts.{parameter}" for parameter in FUSED_PARAMETERS)
    targets = tuple(p for p in PROJECTIONS if p in dense) + tuple(sorted(experts))
    return AdapterLimits(max_rank=config.max_lora_rank, target_modules=targets)
