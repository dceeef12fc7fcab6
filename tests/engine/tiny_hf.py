"""Tiny random HF checkpoints and PEFT adapters, and the transformers+PEFT logits they define: the
oracle the engine is checked against. transformers and peft are test-only dependencies."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import Tokenizer, models
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from shared.adapter_digest import file_digest
from shared.adapter_format import WEIGHTS_FILE
from shared.model_info import ModelInfo
from shared.schema import AdapterRef

VOCAB_SIZE = 300
_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB_SIZE,
}
# Llama 3.1's RoPE scaling with a short original context, so it changes angles at test lengths
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": LLAMA3_ROPE}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),  # q/k/v bias, tied head
}


def word_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Token i is the word "w{i}": what a tiny checkpoint saves as its tokenizer.json."""
    return Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))


def make_tiny_model(family: str, *, seed: int, **overrides: object) -> PreTrainedModel:
    """A random fp32 model of `family` in eval mode; `overrides` change config fields."""
    config_cls, model_cls, family_fields = FAMILIES[family]
    config = config_cls(**{**_SHAPE, **family_fields, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # HF inits these to constants: randomise them too
                param.add_(torch.randn_like(param) * 0.1)
    return model


def save_tiny_model(
    family: str, directory: Path, *, seed: int, max_shard_size: str | None = None, **overrides: object
) -> PreTrainedModel:
    """A random model of `family` saved as a worker serves it: HF config and weights, and tokenizer.json."""
    model = make_tiny_model(family, seed=seed, **overrides)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    word_tokenizer(model.config.vocab_size).save(str(Path(directory) / "tokenizer.json"))
    return model


def saved_adapter_ref(name: str, directory: Path) -> AdapterRef:
    """The registry's reference to the PEFT adapter saved in `directory`: version 1, its file's hash."""
    return AdapterRef(name, 1, directory.name, file_digest(directory / WEIGHTS_FILE))


def save_lora_adapter(
    base: PreTrainedModel,
    directory: Path,
    *,
    rank: int,
    alpha: float,
    targets: list[str],
    seed: int,
    use_rslora: bool = False,
) -> None:
    """Save a PEFT LoRA adapter for `base` with random A *and* B (PEFT starts B at zero, which would
    make every adapter a no-op). `base` itself is left untouched."""
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora, lora_dropout=0.0)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.2)
    peft_model.save_pretrained(directory)


def load_oracle(base: PreTrainedModel, adapters: dict[str, Path]) -> PeftModel:
    """transformers + PEFT over a copy of `base`, with each adapter loaded under its name."""
    (first_name, first_dir), *rest = adapters.items()
    oracle = PeftModel.from_pretrained(copy.deepcopy(base), first_dir, adapter_name=first_name)
    for name, path in rest:
        oracle.load_adapter(path, adapter_name=name)
    return oracle.eval()


@torch.no_grad()
def oracle_logits(oracle: PeftModel, token_ids: list[int], adapter: str | None) -> torch.Tensor:
    """float32 [len(token_ids), vocab]: HF's logits at every position, with `adapter` (None: base)."""
    ids = torch.tensor([token_ids])
    if adapter is None:
        with oracle.disable_adapter():
            return oracle(input_ids=ids).logits[0].float()
    oracle.set_adapter(adapter)
    return oracle(input_ids=ids).logits[0].float()


def oracle_greedy(oracle: PeftModel, prompt: list[int], adapter: str | None, steps: int) -> list[int]:
    """The `steps` tokens HF greedy decoding appends to `prompt`."""
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(oracle_logits(oracle, tokens, adapter)[-1].argmax()))
    return tokens[len(prompt) :]


ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# different ranks, alphas and target subsets, one rsLoRA: name → save_lora_adapter arguments
ADAPTERS = {
    "all_r8": {"rank": 8, "alpha": 16, "targets": ALL_PROJECTIONS},
    "attn_r4_rslora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "o_proj"], "use_rslora": True},
    "mlp_k_r4": {"rank": 4, "alpha": 6, "targets": ["k_proj", "gate_proj", "up_proj", "down_proj"]},
}


@dataclass(frozen=True)
class TinyCheckpoint:
    family: str
    model_dir: Path
    info: ModelInfo
    adapters: dict[str, Path]  # ADAPTERS name → PEFT directory
    oracle: PeftModel  # transformers + PEFT with every adapter loaded


def build_checkpoint(family: str, directory: Path, **overrides: object) -> TinyCheckpoint:
    """A saved tiny `family` model (`overrides` change config fields) with the ADAPTERS saved beside
    it, and its HF oracle."""
    model_dir = directory / "model"
    base = save_tiny_model(family, model_dir, seed=0, **overrides)
    adapters = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items(), start=1):
        adapters[name] = directory / name
        save_lora_adapter(base, adapters[name], seed=seed, **spec)
    info = ModelInfo.from_pretrained(family, model_dir)
    return TinyCheckpoint(family, model_dir, info, adapters, load_oracle(base, adapters))
