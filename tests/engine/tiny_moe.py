"""Tiny random Qwen3-MoE and Mixtral checkpoints with per-expert PEFT adapters, and their
transformers+PEFT oracle.

transformers 5 keeps experts fused in 3-D parameters but saves (and reads) checkpoints with the hub's
per-expert names (`mlp.experts.{e}.gate_proj.weight`). PEFT 0.21 on transformers 5 reads per-expert
LoRA adapters (the form hub adapters trained on transformers 4 have) by converting them to LoRAs on
the fused parameters. The adapters here are written in that per-expert form with safetensors (as
cli/demo_adapters.py writes its adapters), with random A and B, then loaded by PEFT for the oracle.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM

from shared.expert_adapter_keys import expert_key
from shared.model_info import EXPERT_PROJECTIONS, ModelInfo
from tests.engine.tiny_hf import word_tokenizer

VOCAB_SIZE = 300
_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": VOCAB_SIZE, "num_experts_per_tok": 2}  # fmt: skip
MOE_FAMILIES = {
    # a dense first layer (mlp_only_layers) and renormalised top-k, as Qwen3-30B-A3B's config has it
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {
        "intermediate_size": 80, "moe_intermediate_size": 32, "num_experts": 6, "head_dim": 16,
        "norm_topk_prob": True, "mlp_only_layers": [0], "num_hidden_layers": 3}),
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"intermediate_size": 32, "num_local_experts": 6}),
}  # fmt: skip


def save_tiny_moe(family: str, directory: Path, *, seed: int, **overrides: object) -> PreTrainedModel:
    """A random fp32 model of `family` saved in HF format; `overrides` change config fields."""
    config_cls, model_cls, fields = MOE_FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**_SHAPE, **fields, **overrides})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # HF inits norms to ones: randomise them too
                param.add_(torch.randn_like(param) * 0.1)
            elif "gate.weight" in name:  # sharper routing than the init's, so top-k choices differ per token
                param.normal_(0.0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def save_expert_adapter(
    info: ModelInfo, directory: Path, *, rank: int, alpha: float, attention: list[str], experts: bool, seed: int
) -> None:
    """A PEFT LoRA adapter with per-expert tensors on every MoE layer's experts (if `experts`) and
    the `attention` projections of every layer."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}

    def pair(a_key: str, b_key: str, in_features: int, out_features: int) -> None:
        tensors[a_key] = torch.randn(rank, in_features, generator=gen) * in_features**-0.5
        tensors[b_key] = torch.randn(out_features, rank, generator=gen) * 0.3

    targets = set(attention)
    for layer in range(info.num_layers):
        for projection in attention:
            in_f, out_f = info.projection_shape(projection)
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{projection}"
            pair(f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight", in_f, out_f)
        if not experts:
            continue
        if layer not in info.moe_layers:
            # a dense layer's MLP is left alone: PEFT 0.21 on transformers 5 turns the targets
            # gate_proj/up_proj/down_proj into the experts' fused parameters and then drops the dense
            # layer's LoRA, so the oracle would not apply it
            continue
        for projection in EXPERT_PROJECTIONS[info.architecture]:
            targets.add(projection)
            in_f, out_f = info.expert_projection_shape(projection)
            for e in range(info.num_experts):
                a_key, b_key = (expert_key(info, layer, e, projection, which) for which in "AB")
                pair(a_key, b_key, in_f, out_f)
    directory.mkdir(parents=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(targets),
              "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config))


def save_peft_moe_adapter(base: PreTrainedModel, info: ModelInfo, directory: Path, *, rank: int, alpha: float,
                          seed: int, use_rslora: bool = False) -> None:  # fmt: skip
    """An adapter on q/v and every expert as PEFT saves it for a transformers-5 MoE model: LoRA on the
    fused expert parameters (target_parameters, gate_up at rank 2r and alpha 2·alpha via rank_pattern
    and alpha_pattern, as PEFT sets them when gate_proj and up_proj are targeted by name), random A and B.
    The parameters are named, not the projections: PEFT 0.22 also puts LoRA on a dense layer's MLP
    for those names, and then drops it again when the adapter is loaded as a second adapter."""
    gate_up = r".*\.gate_up_proj"
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["gate_up_proj", "down_proj"],
        rank_pattern={gate_up: 2 * rank},
        alpha_pattern={gate_up: 2 * alpha},
        use_rslora=use_rslora,
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.2)
    peft_model.save_pretrained(directory)


MOE_ADAPTERS = {
    "experts_r8": {"rank": 8, "alpha": 16, "attention": ["q_proj", "o_proj"], "experts": True},
    "experts_only_r4": {"rank": 4, "alpha": 12, "attention": [], "experts": True},
    "attn_r4": {"rank": 4, "alpha": 8, "attention": ["k_proj", "v_proj"], "experts": False},
}
FUSED = "fused_r4_rslora"  # saved by PEFT itself, in its fused-parameter form


@dataclass(frozen=True)
class TinyMoE:
    family: str
    model_dir: Path
    info: ModelInfo
    adapters: dict[str, Path]
    oracle: PeftModel


def build_tiny_moe(family: str, directory: Path) -> TinyMoE:
    model_dir = directory / "model"
    base = save_tiny_moe(family, model_dir, seed=0)
    word_tokenizer(VOCAB_SIZE).save(str(model_dir / "tokenizer.json"))
    info = ModelInfo.from_pretrained(family, model_dir)
    adapters = {}
    for seed, (name, spec) in enumerate(MOE_ADAPTERS.items(), start=1):
        adapters[name] = directory / name
        save_expert_adapter(info, adapters[name], seed=seed, **spec)
    # rsLoRA: PEFT's doubled rank and alpha on gate_up give it another scale than attention's
    adapters[FUSED] = directory / FUSED
    save_peft_moe_adapter(base, info, adapters[FUSED], rank=4, alpha=8, seed=9, use_rslora=True)
    (first, first_dir), *rest = adapters.items()
    oracle = PeftModel.from_pretrained(copy.deepcopy(base), first_dir, adapter_name=first)
    for name, path in rest:
        oracle.load_adapter(path, adapter_name=name)
    return TinyMoE(family, model_dir, info, adapters, oracle.eval())
