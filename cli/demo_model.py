"""The demo base model: a small randomly initialised Llama in Hugging Face format, made without transformers.

Its weights are noise from a fixed seed, so its text is gibberish, but every file is what a real
Llama checkpoint holds (config.json, model.safetensors under HF parameter names, tokenizer.json,
tokenizer_config.json), and transformers loads it as `LlamaForCausalLM`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from cli.demo_corpus import CORPUS

BOS, EOS = "<s>", "</s>"


@dataclass(frozen=True, slots=True)
class DemoModelShape:
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    max_position_embeddings: int = 2048
    target_vocab_size: int = 2048  # the BPE trainer stops earlier when the corpus has no more merges
    init_std: float = 0.02
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE (any text encodes) with `<s>` = 0 and `</s>` = 1; encoding prepends `<s>`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


def model_config(shape: DemoModelShape, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": shape.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def random_weights(shape: DemoModelShape, vocab_size: int) -> dict[str, np.ndarray]:
    """HF Llama parameters; linear weights are [out_features, in_features], as torch.nn.Linear stores them."""
    rng = np.random.default_rng(shape.seed)
    hidden, inter = shape.hidden_size, shape.intermediate_size
    q_width = shape.num_heads * shape.head_dim
    kv_width = shape.num_kv_heads * shape.head_dim

    def normal(*dims: int) -> np.ndarray:
        return rng.normal(0.0, shape.init_std, size=dims).astype(np.float32)

    def ones(dim: int) -> np.ndarray:
        return np.ones(dim, dtype=np.float32)

    weights = {"model.embed_tokens.weight": normal(vocab_size, hidden)}
    for i in range(shape.num_layers):
        layer = f"model.layers.{i}"
        weights |= {
            f"{layer}.self_attn.q_proj.weight": normal(q_width, hidden),
            f"{layer}.self_attn.k_proj.weight": normal(kv_width, hidden),
            f"{layer}.self_attn.v_proj.weight": normal(kv_width, hidden),
            f"{layer}.self_attn.o_proj.weight": normal(hidden, q_width),
            f"{layer}.mlp.gate_proj.weight": normal(inter, hidden),
            f"{layer}.mlp.up_proj.weight": normal(inter, hidden),
            f"{layer}.mlp.down_proj.weight": normal(hidden, inter),
            f"{layer}.input_layernorm.weight": ones(hidden),
            f"{layer}.post_attention_layernorm.weight": ones(hidden),
        }
    weights["model.norm.weight"] = ones(hidden)
    weights["lm_head.weight"] = normal(vocab_size, hidden)
    return weights


DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write_demo_model(model_dir: Path, shape: DemoModelShape = DemoModelShape()) -> None:
    """Write the four files of the demo model into `model_dir` (which must exist and be empty)."""
    tokenizer = train_tokenizer(shape.target_vocab_size)
    vocab_size = tokenizer.get_vocab_size()
    bos_id, eos_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": shape.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        # a plain role-prefixed template, so the OpenAI chat endpoint works on the demo model
        "chat_template": DEMO_CHAT_TEMPLATE,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    config = model_config(shape, vocab_size, bos_id, eos_id)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(random_weights(shape, vocab_size), str(model_dir / "model.safetensors"), metadata={"format": "pt"})
