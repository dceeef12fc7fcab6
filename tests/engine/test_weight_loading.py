"""Loading HF safetensors checkpoints into the model's packed layers, the way a worker loads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.model_info import ModelInfo
from tests.engine.engine_driver import BlockPool, PagedSequence, make_kv_cache, prefill
from tests.engine.engines import load_model
from tests.engine.tiny_hf import TinyCheckpoint, make_tiny_model, save_tiny_model
from worker.model.model import CausalLM
from worker.model.weights import INDEX_FILE, SINGLE_FILE


def load(model_dir: Path, family: str, *, dtype: str | None = "float32") -> CausalLM:
    """The model as a worker loads it: the checkpoint read into host memory, then copied in."""
    return load_model(
        model_dir, ModelInfo.from_pretrained(family, model_dir), max_loras=2, max_lora_rank=4, dtype=dtype
    )


def test_packed_projections_hold_each_checkpoint_matrix_in_order(llama: TinyCheckpoint) -> None:
    model = load(llama.model_dir, "llama")
    checkpoint = load_file(llama.model_dir / SINGLE_FILE)
    layer = "model.layers.1"
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    gate_up = model.model.layers[1].mlp.gate_up_proj.weight

    assert torch.equal(
        qkv,
        torch.cat([checkpoint[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"]),
    )
    assert torch.equal(
        gate_up,
        torch.cat([checkpoint[f"{layer}.mlp.{p}_proj.weight"] for p in ("gate", "up")]),
    )


def test_sharded_checkpoint_gives_the_same_logits_as_hf(tmp_path: Path) -> None:
    hf = save_tiny_model("llama", tmp_path, seed=3, max_shard_size="40KB")
    assert (tmp_path / INDEX_FILE).is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    model = load(tmp_path, "llama")
    prompt = list(range(20, 29))

    logits = prefill([PagedSequence(prompt)], model, make_kv_cache(model, num_blocks=8, block_size=4), BlockPool(8))

    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert (logits[0] - expected).abs().max() <= 1e-4


def test_tied_embeddings_use_the_embedding_table_as_the_head(tiny_checkpoints) -> None:
    qwen2 = tiny_checkpoints("qwen2")
    model = load(qwen2.model_dir, "qwen2")

    assert "lm_head.weight" not in load_file(qwen2.model_dir / SINGLE_FILE)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_weights_keep_the_checkpoint_dtype_unless_one_is_given(tmp_path: Path) -> None:
    make_tiny_model("mistral", seed=4).to(torch.bfloat16).save_pretrained(tmp_path)

    assert load(tmp_path, "mistral", dtype=None).model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert load(tmp_path, "mistral", dtype="float32").model.layers[0].mlp.down_proj.weight.dtype == torch.float32


def test_pickled_checkpoint_is_refused(tmp_path: Path, llama: TinyCheckpoint) -> None:
    (tmp_path / "config.json").write_bytes((llama.model_dir / "config.json").read_bytes())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")

    with pytest.raises(FileNotFoundError, match="pickled weights are never loaded"):
        load(tmp_path, "llama")


def test_a_missing_tensor_is_named(tmp_path: Path, llama: TinyCheckpoint) -> None:
    (tmp_path / "config.json").write_bytes((llama.model_dir / "config.json").read_bytes())
    tensors = load_file(llama.model_dir / SINGLE_FILE)
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    save_file(tensors, tmp_path / SINGLE_FILE)

    with pytest.raises(ValueError, match=r"lacks 1 tensors: model\.layers\.0\.self_attn\.v_proj\.weight"):
        load(tmp_path, "llama")


def test_a_tensor_the_model_has_no_place_for_is_named(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path, seed=5, mlp_bias=True)  # not a layout the engine builds

    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.bias' is not a parameter of this model"):
        load(tmp_path, "llama")


def test_unsupported_rope_scaling_is_refused(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path, seed=6, rope_parameters={"rope_type": "linear", "factor": 2.0})

    with pytest.raises(ValueError, match="rope_scaling type 'linear' is not supported"):
        load(tmp_path, "llama")
