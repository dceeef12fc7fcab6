"""The FP8 engine against transformers + PEFT computing the same quantized arithmetic
(tests/engine/fp8_oracle.py), with adapters, for every dense family: W8A16 in batches of up to
W8A16_MAX_TOKENS tokens, W8A8 in a longer prompt; FP8 checkpoints in both published formats load as
they are, and block-wise ones with their weights quantized again per row.

Tolerance: on CPU both sides compute in float32 from the same fp8 values (the engine dequantizes,
the oracle's weights are dequantized and its activations quantized then dequantized), so they differ
only by float32 reassociation: the unquantized oracle's 1e-4 (measured: below 5e-7). What that noise
could cause, an activation within float32 noise of an fp8 rounding boundary rounding the other way,
would move a logit by about one fp8 step of one element's contribution, 1e-3 at these sizes: it does
not happen on these seeded inputs, and if it did the test would say so. The check that quantization
happened at all: every row is more than ten tolerances from the unquantized oracle (measured:
2.5e-3 and more).
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.quant import W8A16_MAX_TOKENS, quantize_weight
from kernels.quant.reference import dequantize_blocks
from shared.errors import LorafleetError
from shared.model_info import ModelInfo
from tests.engine.engine_driver import BlockPool, PagedSequence, make_kv_cache, prefill
from tests.engine.engines import load_model
from tests.engine.fp8_oracle import BLOCK, fp8_oracle, quantize_blocks, save_fp8_checkpoint
from tests.engine.test_model_oracle import SLOTS, assert_greedy_decode_matches, mixed_sequences, random_prompt
from tests.engine.tiny_hf import TinyCheckpoint, oracle_logits
from worker.model import fp8_weights
from worker.model.fp8_weights import BlockScaledFP8
from worker.model.model import CausalLM

TOLERANCE = 1e-4


def fp8_model(model_dir: Path, info: ModelInfo, adapters: dict[str, Path] | None = None) -> CausalLM:
    """The model served with --quantization fp8, with SLOTS' adapters when given."""
    served = info.served(quantization="fp8", kv_cache_dtype="auto", source=model_dir)
    slots = {slot: adapters[name] for name, slot in SLOTS.items()} if adapters else {}
    return load_model(model_dir, served, slots)


def test_fp8_engine_matches_the_quantized_oracle_in_a_mixed_batch(checkpoint: TinyCheckpoint) -> None:
    model = fp8_model(checkpoint.model_dir, checkpoint.info, checkpoint.adapters)
    oracle = fp8_oracle(checkpoint.oracle)
    seqs = mixed_sequences()
    logits = prefill([seq for _, seq in seqs], model, make_kv_cache(model, num_blocks=64, block_size=4), BlockPool(64))
    for row, (adapter, seq) in enumerate(seqs):
        assert (logits[row] - oracle_logits(oracle, seq.token_ids, adapter)[-1]).abs().max() <= TOLERANCE
        plain = oracle_logits(checkpoint.oracle, seq.token_ids, adapter)[-1]
        assert (logits[row] - plain).abs().max() > 10 * TOLERANCE  # the base really ran in fp8


def test_a_long_prefill_takes_w8a8_as_the_oracle_does(llama: TinyCheckpoint) -> None:
    model = fp8_model(llama.model_dir, llama.info, llama.adapters)
    oracle, weight_only_oracle = fp8_oracle(llama.oracle), fp8_oracle(llama.oracle, quantize_activations=False)
    for adapter in (None, "all_r8"):
        seq = PagedSequence(random_prompt(W8A16_MAX_TOKENS + 9, seed=3), slot=-1 if adapter is None else SLOTS[adapter])
        logits = prefill([seq], model, make_kv_cache(model, num_blocks=32, block_size=4), BlockPool(32))
        assert (logits[0] - oracle_logits(oracle, seq.token_ids, adapter)[-1]).abs().max() <= TOLERANCE
        weight_only = oracle_logits(weight_only_oracle, seq.token_ids, adapter)[-1]
        assert (logits[0] - weight_only).abs().max() > 10 * TOLERANCE  # the activations really were quantized


def test_fp8_greedy_decode_matches_the_quantized_oracle(llama: TinyCheckpoint) -> None:
    model = fp8_model(llama.model_dir, llama.info, llama.adapters)
    assert_greedy_decode_matches(model, fp8_oracle(llama.oracle), steps=5)


@pytest.mark.parametrize(
    ("method", "scales"), [("fp8", "tensor"), ("compressed-tensors", "channel"), ("compressed-tensors", "tensor")]
)
def test_fp8_checkpoint_loads_as_it_is(llama: TinyCheckpoint, tmp_path: Path, method: str, scales: str) -> None:
    model_dir = save_fp8_checkpoint(llama.model_dir, tmp_path / "fp8", method=method, scales=scales)
    info = ModelInfo.from_pretrained("llama", model_dir)
    assert (info.checkpoint_quantization, info.quantization) == ("fp8", "fp8")
    model = fp8_model(model_dir, info, llama.adapters)
    oracle = fp8_oracle(llama.oracle, scales)
    seqs = mixed_sequences()[:3]
    logits = prefill([seq for _, seq in seqs], model, make_kv_cache(model, num_blocks=32, block_size=4), BlockPool(32))
    for row, (adapter, seq) in enumerate(seqs):
        assert (logits[row] - oracle_logits(oracle, seq.token_ids, adapter)[-1]).abs().max() <= TOLERANCE


LEFT_UNQUANTIZED = (
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.k_proj",
    "model.layers.0.self_attn.v_proj",
    "model.layers.1.mlp.down_proj",
)
# the same four projections, as each format's config names them
IGNORE_ENTRIES = {
    "compressed-tensors": {"ignore": ["lm_head", r"re:model\.layers\.0\.self_attn\.[qkv]_proj", LEFT_UNQUANTIZED[3]]},
    "fp8": {
        "ignored_layers": [LEFT_UNQUANTIZED[3]],
        # transformers' matching: a suffix, and a regular expression from the name's start to a module boundary
        "modules_to_not_convert": ["lm_head", "layers.0.self_attn.q_proj", r"model\.layers\.0\.self_attn\.[kv]_proj"],
    },
}


@pytest.mark.parametrize("method", ["fp8", "compressed-tensors"])
def test_projections_a_checkpoint_leaves_unquantized_serve_in_its_dtype(
    llama: TinyCheckpoint, tmp_path: Path, method: str
) -> None:
    """Mixed precision as published: the listed projections keep the checkpoint's weights and run
    unquantized (activations too, past W8A16_MAX_TOKENS tokens), the others in FP8."""
    model_dir = save_fp8_checkpoint(
        llama.model_dir, tmp_path / "fp8", method=method, scales="channel",
        unquantized=LEFT_UNQUANTIZED, ignore=IGNORE_ENTRIES[method],
    )  # fmt: skip
    info = ModelInfo.from_pretrained("llama", model_dir)
    assert info.unquantized == LEFT_UNQUANTIZED
    assert info.unquantized_summary() == list(LEFT_UNQUANTIZED)  # none is kept in every layer: each by name
    assert ModelInfo.from_json(info.to_json()) == info  # as a tensor-parallel follower receives it
    model = fp8_model(model_dir, info, llama.adapters)
    layers = model.model.layers
    assert layers[0].self_attn.qkv_proj.weight_scale is None and layers[1].mlp.down_proj.weight_scale is None
    assert layers[0].self_attn.o_proj.weight_scale is not None and layers[1].mlp.gate_up_proj.weight_scale is not None
    oracle = fp8_oracle(llama.oracle, unquantized=LEFT_UNQUANTIZED)
    all_fp8 = fp8_oracle(llama.oracle)
    short = [seq for _, seq in mixed_sequences()[:3]]
    long = PagedSequence(random_prompt(W8A16_MAX_TOKENS + 9, seed=3), slot=SLOTS["all_r8"])
    for seqs, adapters in ((short, [adapter for adapter, _ in mixed_sequences()[:3]]), ([long], ["all_r8"])):
        logits = prefill(seqs, model, make_kv_cache(model, num_blocks=64, block_size=4), BlockPool(64))
        for row, (adapter, seq) in enumerate(zip(adapters, seqs, strict=True)):
            assert (logits[row] - oracle_logits(oracle, seq.token_ids, adapter)[-1]).abs().max() <= TOLERANCE
            fp8_everywhere = oracle_logits(all_fp8, seq.token_ids, adapter)[-1]
            # they really ran unquantized: measured 9.8e-4 to 2.9e-2 from the all-FP8 oracle
            assert (logits[row] - fp8_everywhere).abs().max() > 5 * TOLERANCE


def config_with(model_dir: Path, directory: Path, quantization_config: dict) -> Path:
    """A checkpoint directory holding `model_dir`'s config.json with `quantization_config` (what
    ModelInfo reads at start, before any tensor)."""
    directory.mkdir()
    config = json.loads((model_dir / "config.json").read_text()) | {"quantization_config": quantization_config}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


CT = {
    "quant_method": "compressed-tensors",
    "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
}


@pytest.mark.parametrize(
    ("quantization_config", "problem"),
    [
        (CT | {"ignore": ["model.layers.1.self_attn.k_proj"]}, "self_attn.v_proj only some are left unquantized"),
        ({"quant_method": "fp8", "modules_to_not_convert": ["up_proj"]}, "mlp.up_proj only some are left unquantized"),
        (CT | {"ignore": ["re:model.layers.(["]}, "ignore entry 're:model.layers.([' is not a regular expression"),
        (CT | {"ignore": "lm_head"}, "quantization_config.ignore must be a list of module names"),
        ({"quant_method": "fp8", "ignored_layers": [3]}, "ignored_layers must be a list of module names"),
    ],
)
def test_an_ignore_list_the_worker_cannot_serve_is_refused_naming_the_file(
    llama: TinyCheckpoint, tmp_path: Path, quantization_config: dict, problem: str
) -> None:
    model_dir = config_with(llama.model_dir, tmp_path / "fp8", quantization_config)
    with pytest.raises(LorafleetError, match=re.escape(problem)) as refused:
        ModelInfo.from_pretrained("llama", model_dir)
    assert str(refused.value).startswith(f"{model_dir / 'config.json'}: ")


def test_ignore_entries_for_modules_never_quantized_change_nothing(llama: TinyCheckpoint, tmp_path: Path) -> None:
    model_dir = config_with(llama.model_dir, tmp_path / "fp8", CT | {"ignore": ["lm_head", "re:.*mlp\\.gate$"]})
    assert ModelInfo.from_pretrained("llama", model_dir).unquantized == ()


@pytest.mark.parametrize("method", ["fp8", "compressed-tensors"])
def test_block_wise_fp8_checkpoint_is_served_with_per_channel_scales(
    llama: TinyCheckpoint, tmp_path: Path, method: str
) -> None:
    """The block-wise weights dequantized by block and quantized again per row, and nothing else:
    the oracle's weights are those, and the loaded ones are bit for bit."""
    model_dir = save_fp8_checkpoint(llama.model_dir, tmp_path / "fp8", method=method, scales="block")
    info = ModelInfo.from_pretrained("llama", model_dir)
    assert (info.checkpoint_quantization, info.weight_scale_block) == ("fp8", BLOCK)
    assert ModelInfo.from_json(info.to_json()) == info  # as a tensor-parallel follower receives it
    model = fp8_model(model_dir, info, llama.adapters)
    saved = load_file(model_dir / "model.safetensors")
    block_scales = saved["model.layers.1.mlp.down_proj." + ("weight_scale_inv" if method == "fp8" else "weight_scale")]
    served = quantize_weight(dequantize_blocks(saved["model.layers.1.mlp.down_proj.weight"], block_scales, BLOCK))
    down = model.model.layers[1].mlp.down_proj
    assert torch.equal(down.weight.view(torch.uint8), served[0].view(torch.uint8))
    assert torch.equal(down.weight_scale, served[1])
    oracle = fp8_oracle(llama.oracle, "block")
    seqs = mixed_sequences()[:3]
    logits = prefill([seq for _, seq in seqs], model, make_kv_cache(model, num_blocks=32, block_size=4), BlockPool(32))
    for row, (adapter, seq) in enumerate(seqs):
        assert (logits[row] - oracle_logits(oracle, seq.token_ids, adapter)[-1]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("rows_at_once", [1024, 48])  # one pass; two passes of two block rows, the last short
def test_a_block_wise_slice_completes_with_whichever_tensor_comes_second(
    monkeypatch: pytest.MonkeyPatch, rows_at_once: int
) -> None:
    monkeypatch.setattr(fp8_weights, "_ROWS_AT_ONCE", rows_at_once)
    weight = torch.randn(50, 90, generator=torch.Generator().manual_seed(4))
    codes, block_scales = quantize_blocks(weight)
    served = quantize_weight(dequantize_blocks(codes, block_scales, BLOCK))
    for order in ("weight first", "scales first"):
        target = torch.zeros(50, 90, dtype=codes.dtype), torch.zeros(50)
        blocks = BlockScaledFP8(*target, BLOCK, name="p", split=None)
        loads = [partial(blocks.load_weight, codes), partial(blocks.load_scales, block_scales)]
        loads[0 if order == "weight first" else 1]()
        assert not target[0].view(torch.uint8).any() and not target[1].any()  # one tensor alone writes nothing
        loads[1 if order == "weight first" else 0]()
        assert torch.equal(target[0].view(torch.uint8), served[0].view(torch.uint8)), order
        assert torch.equal(target[1], served[1]), order


def test_block_scales_of_the_wrong_shape_name_the_tensor(llama: TinyCheckpoint, tmp_path: Path) -> None:
    model_dir = save_fp8_checkpoint(llama.model_dir, tmp_path / "fp8", method="compressed-tensors", scales="block")
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.weight_scale"
    tensors[name] = tensors[name][:, :1].contiguous()  # one block column short
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=rf"llama: {name}: block scales \(2, 1\) do not cover a \[32, 64\] weight"):
        fp8_model(model_dir, ModelInfo.from_pretrained("llama", model_dir))


def test_fp8_checkpoint_weights_are_not_requantized(llama: TinyCheckpoint, tmp_path: Path) -> None:
    model_dir = save_fp8_checkpoint(llama.model_dir, tmp_path / "fp8", method="fp8", scales="tensor")
    model = fp8_model(model_dir, ModelInfo.from_pretrained("llama", model_dir))
    saved = load_file(model_dir / "model.safetensors")
    qkv = model.model.layers[0].self_attn.qkv_proj
    q_rows = model.info.num_heads * model.info.head_dim
    assert torch.equal(
        qkv.weight[:q_rows].view(torch.uint8), saved["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8)
    )
    assert torch.all(qkv.weight_scale[:q_rows] == saved["model.layers.0.self_attn.q_proj.weight_scale"])


def test_a_missing_scale_tensor_names_it(llama: TinyCheckpoint, tmp_path: Path) -> None:
    model_dir = save_fp8_checkpoint(llama.model_dir, tmp_path / "fp8", method="compressed-tensors", scales="channel")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"llama: checkpoint lacks 1 tensors: model\.layers\.1\.mlp\.down_proj\.weight_scale"
    ):
        fp8_model(model_dir, ModelInfo.from_pretrained("llama", model_dir))


def test_fp8_checkpoint_served_unquantized_is_refused(llama: TinyCheckpoint, tmp_path: Path) -> None:
    model_dir = save_fp8_checkpoint(llama.model_dir, tmp_path / "fp8", method="fp8", scales="tensor")
    info = ModelInfo.from_pretrained("llama", model_dir)
    with pytest.raises(LorafleetError, match="fp8-quantized"):
        info.served(quantization="none", kv_cache_dtype="auto", source=model_dir)
