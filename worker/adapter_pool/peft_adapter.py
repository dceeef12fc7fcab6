"""Where PEFT puts a LoRA adapter's tensors: the names host_adapter.py reads a validated file by
(shared/adapter_format.py validates it first; moe_adapter.py reads the experts' forms)."""

from __future__ import annotations

ATTENTION_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})


def peft_key(layer: int, projection: str, matrix: str) -> str:
    """PEFT's tensor name for LoRA matrix `matrix` ("A" or "B") of one projection."""
    block = "self_attn" if projection in ATTENTION_PROJECTIONS else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{projection}.lora_{matrix}.weight"
