"""RoPE frequencies against transformers' own initialisers."""

from __future__ import annotations

import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.engine.tiny_hf import LLAMA3_ROPE
from worker.model.rope import RotaryEmbedding, rope_type


def test_llama3_frequencies_match_transformers() -> None:
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=LLAMA3_ROPE)  # head_dim 128
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config)

    rope = RotaryEmbedding(128, LLAMA3_ROPE["rope_theta"], LLAMA3_ROPE, device="cpu")

    assert torch.equal(rope.inv_freq, expected)


def test_old_and_new_spellings_of_the_rope_type_are_both_read() -> None:
    assert rope_type({"type": "llama3"}) == rope_type({"rope_type": "llama3"}) == "llama3"
    assert rope_type(None) == rope_type({"rope_type": "default"}) == "default"
