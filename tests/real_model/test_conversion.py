"""Our GGUF → HF conversion of the demo model against transformers' own GGUF loader: the same tensors,
the same hyper-parameters, the same token ids; and our tokenizer round-trips any text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from shared.model_info import ModelInfo

TEXTS = [
    "What is the capital of France?",
    "  leading spaces, trailing  \n\n and tabs\there",
    "In 2024, 12345 people paid $3.50 each (10% off).",
    "café naïve Straße — “quotes” …",
    "日本語のテキスト and 中文 mixed with English",
    "emoji 🙂👍🏽 and a family 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # code",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def transformers_gguf(smollm2_gguf: Path, smollm2_dir: Path) -> dict:
    """transformers' reading of the GGUF: config, tokenizer metadata and dequantized tensors."""
    with torch.device("meta"):  # names and shapes only: the loader maps GGUF names onto this model's
        skeleton = LlamaForCausalLM(LlamaConfig.from_pretrained(smollm2_dir))
    return load_gguf_checkpoint(smollm2_gguf, return_tensors=True, model_to_load=skeleton)


def test_every_tensor_equals_transformers_dequantized_tensor(smollm2_dir: Path, transformers_gguf: dict) -> None:
    ours = load_file(smollm2_dir / "model.safetensors")
    theirs = transformers_gguf["tensors"]

    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, theirs[name].to(torch.float32)), name


def test_config_has_transformers_hyper_parameters_and_ties_the_lm_head(
    smollm2_info: ModelInfo, transformers_gguf: dict
) -> None:
    expected = transformers_gguf["config"]
    info = smollm2_info
    assert info.architecture == "LlamaForCausalLM" and info.torch_dtype == "float32"
    assert (info.hidden_size, info.intermediate_size, info.num_layers) == (
        expected["hidden_size"],
        expected["intermediate_size"],
        expected["num_hidden_layers"],
    )
    assert (info.num_heads, info.num_kv_heads, info.head_dim) == (9, 3, 64)
    assert (info.num_heads, info.num_kv_heads) == (expected["num_attention_heads"], expected["num_key_value_heads"])
    assert info.rope_theta == expected["rope_theta"] and info.rms_norm_eps == expected["rms_norm_eps"]
    assert (info.vocab_size, info.max_context) == (expected["vocab_size"], expected["max_position_embeddings"])
    assert info.tie_word_embeddings and expected["tie_word_embeddings"]
    assert (info.bos_token_id, info.eos_token_ids) == (expected["bos_token_id"], (expected["eos_token_id"],))


@pytest.fixture(scope="module")
def transformers_tokenizer(transformers_gguf: dict) -> Tokenizer:
    tokenizer, _ = convert_gguf_tokenizer("llama", transformers_gguf["tokenizer"])
    return tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_equal_transformers_gguf_tokenizer(
    text: str, smollm2_tokenizer: Tokenizer, transformers_tokenizer: Tokenizer
) -> None:
    assert smollm2_tokenizer.encode(text).ids == transformers_tokenizer.encode(text).ids


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips_through_the_tokenizer(text: str, smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode(text).ids
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_digits_are_single_tokens_and_control_tokens_are_whole(smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode("2024<|im_end|>").ids
    assert [smollm2_tokenizer.id_to_token(i) for i in ids] == ["2", "0", "2", "4", "<|im_end|>"]
    assert smollm2_tokenizer.decode(ids) == "2024"  # special tokens are skipped by default
