"""A Llama GGUF file → a Hugging Face checkpoint directory the worker loads like any other:
config.json, model.safetensors (float32, dequantized), tokenizer.json and tokenizer_config.json.

Why our own converter rather than transformers' GGUF loader: `lorafleet up` then needs only the
small `gguf` package (numpy; its `dequantize` is the reference implementation llama.cpp's Python
tools use), not transformers, and converts the demo model in seconds where transformers takes
~30 s. tests/real_model checks the result against transformers' loader tensor by tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, dequantize
from safetensors.numpy import save_file

from cli.gguf_tokenizer import write_tokenizer

# GGUF tensor name → HF parameter name, per decoder layer ("blk.{i}." → "model.layers.{i}.")
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class UnsupportedGGUF(ValueError):
    pass


def _field(reader: GGUFReader, name: str) -> Any:
    field = reader.fields.get(name)
    if field is None:
        raise UnsupportedGGUF(f"the GGUF file has no {name!r}")
    return field.contents()


def hf_config(reader: GGUFReader) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM with the GGUF's hyper-parameters."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedGGUF(f"architecture {arch!r} (supported: llama)")
    heads = _field(reader, "llama.attention.head_count")
    hidden = _field(reader, "llama.embedding_length")
    tensor_names = {tensor.name for tensor in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _field(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _field(reader, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, "llama.attention.head_count_kv"),
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": _field(reader, "llama.context_length"),
        "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        # a GGUF without an output matrix reuses the token embedding as the LM head
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def _unpermute_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows: it interleaves each head's two RoPE halves
    (rows [h, 2, d/2] → [h, d/2, 2]) for its own rotation kernel; HF's rotate_half wants them apart.
    weight: [heads * head_dim, in_features]."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    if len(parts) == 1 and parts[0] in _MODEL_TENSORS:
        return f"{_MODEL_TENSORS[parts[0]]}.{suffix}"
    raise UnsupportedGGUF(f"unexpected tensor {gguf_name!r}")


def hf_tensors(reader: GGUFReader, config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) per tensor; linear weights are [out_features, in_features]."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for tensor in reader.tensors:
        # dequantize gives ggml's shape reversed, i.e. numpy's [rows, columns] = [out, in]
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        kind = tensor.name.split(".")[-2]
        if kind in heads:
            weight = _unpermute_rope(weight, heads[kind])
        yield _hf_name(tensor.name), np.ascontiguousarray(weight)


def convert_gguf(gguf_path: Path, model_dir: Path, progress: Callable[[int, int], None] | None = None) -> None:
    """Write the HF checkpoint of the Llama GGUF at `gguf_path` into `model_dir` (which must exist).
    `progress(done, total)` is called after each tensor."""
    reader = GGUFReader(gguf_path)
    config = hf_config(reader)
    tensors = {}
    for name, weight in hf_tensors(reader, config):
        tensors[name] = weight
        if progress is not None:
            progress(len(tensors), len(reader.tensors))
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(reader, model_dir)
