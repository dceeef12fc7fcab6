"""A checkpoint's quantization_config read at start: the FP8 formats accepted, everything else
refused with the file named (shared/quantization.py); bitsandbytes 4-bit's codebook named; the
modules an FP8 checkpoint leaves unquantized, matched as the format's own reader matches them."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.errors import LorafleetError
from shared.model_info import PROJECTIONS, decoder_projection_name
from shared.quantization import (
    checkpoint_quantization,
    checkpoint_scale_block,
    checkpoint_unquantized,
    served_quantization,
)

PATH = Path("/models/m/config.json")


def weight_spec(**weights: object) -> dict:
    return {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, **weights}


def fp8_group(*specs: dict, **weights: object) -> dict:
    """A compressed-tensors quantization_config: one group of `weights` over the defaults, or a group per spec."""
    groups = {f"group_{i}": {"weights": spec} for i, spec in enumerate(specs or (weight_spec(**weights),))}
    return {"quant_method": "compressed-tensors", "config_groups": groups}


BLOCK_WISE = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize(
    ("quant", "block"),
    [
        (None, None),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, None),
        (fp8_group(), None),
        (fp8_group(strategy="tensor"), None),
        (BLOCK_WISE, (128, 128)),
        (fp8_group(strategy="block", block_structure=[128, 64]), (128, 64)),
    ],
)
def test_plain_and_fp8_checkpoints_are_accepted(quant: dict | None, block: tuple[int, int] | None) -> None:
    config = {} if quant is None else {"quantization_config": quant}
    assert checkpoint_quantization(config, PATH) == ("none" if quant is None else "fp8")
    assert checkpoint_scale_block(config, PATH) == block


@pytest.mark.parametrize(("quant_type", "expected"), [(None, "fp4"), ("nf4", "nf4"), ("fp4", "fp4")])
def test_bitsandbytes_4bit_checkpoints_are_their_codebook(quant_type: str | None, expected: str) -> None:
    quant = {"quant_method": "bitsandbytes", "load_in_4bit": True}  # transformers' default quant type: fp4
    if quant_type is not None:
        quant["bnb_4bit_quant_type"] = quant_type
    assert checkpoint_quantization({"quantization_config": quant}, PATH) == expected


@pytest.mark.parametrize(
    ("quant", "problem"),
    [
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "8-bit bitsandbytes weights"),
        ({"quant_method": "gguf"}, "quant_method 'gguf' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"FP8 weight block \[128\] is not two positive integers"),
        ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "is not two positive integers"),
        (fp8_group(strategy="block"), "FP8 weight block None is not two positive integers"),
        (
            fp8_group(weight_spec(strategy="block", block_structure=[128, 128]), weight_spec()),
            "mix block-wise and other FP8 weight scales",
        ),
        (
            fp8_group(*(weight_spec(strategy="block", block_structure=[side, side]) for side in (128, 64))),
            "groups disagree on the FP8 weight block",
        ),
        (fp8_group(type="int", num_bits=4), "holds int 4-bit weights"),
        (fp8_group(strategy="group"), "weight strategy 'group'"),
        (fp8_group(symmetric=False), "asymmetric"),
        ({"quant_method": "compressed-tensors", "config_groups": {}}, "no config_groups"),
    ],
)
def test_unsupported_formats_are_refused_naming_the_file(quant: dict, problem: str) -> None:
    with pytest.raises(LorafleetError, match=f"^{PATH}: .*{problem}"):
        checkpoint_quantization({"quantization_config": quant}, PATH)


def test_served_quantization_is_the_checkpoints_or_the_requested() -> None:
    assert served_quantization("none", None, PATH) == "none"
    assert served_quantization("none", "fp8", PATH) == "fp8"
    assert served_quantization("fp8", None, PATH) == "fp8"
    with pytest.raises(LorafleetError, match="cannot be served as --quantization none"):
        served_quantization("fp8", "none", PATH)


NAMES = [decoder_projection_name(layer, projection) for layer in range(12) for projection in PROJECTIONS]


def not_converted(entries: list[str]) -> list[str]:
    config = {"quantization_config": {"quant_method": "fp8", "modules_to_not_convert": entries}}
    return list(checkpoint_unquantized(config, PATH, NAMES))


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("model.layers.1", [n for n in NAMES if n.startswith("model.layers.1.")]),  # not layers 10 and 11
        (
            "model.layers.1.mlp",
            ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"],
        ),
        (r"model\.layers\.\d+\.self_attn\.o_proj", [n for n in NAMES if n.endswith("o_proj")]),
        ("down_proj", [n for n in NAMES if n.endswith("down_proj")]),  # a suffix
        ("layers.0.self_attn.q_proj", ["model.layers.0.self_attn.q_proj"]),  # not layer 10's
        ("mlp.gate", []),  # a router, not gate_proj
        ("lm_head", []),
    ],
)
def test_modules_to_not_convert_match_from_the_start_to_a_module_boundary_or_as_a_suffix(
    entry: str, expected: list[str]
) -> None:
    assert not_converted([entry]) == expected


def test_modules_to_not_convert_are_matched_as_transformers_matches_them() -> None:
    quantizers_utils = pytest.importorskip("transformers.quantizers.quantizers_utils")
    if not hasattr(quantizers_utils, "should_convert_module"):
        pytest.skip("this transformers matches modules_to_not_convert as substrings (before 5.0)")
    entries = ["lm_head", "model.layers.1", "layers.2.mlp", r"model\.layers\.[3-4]\.self_attn\.[qkv]_proj", "up_proj"]
    for entry in entries:
        expected = [name for name in NAMES if not quantizers_utils.should_convert_module(name, [entry])]
        assert not_converted([entry]) == expected, entry


def test_a_modules_to_not_convert_entry_that_is_no_regular_expression_is_refused() -> None:
    with pytest.raises(LorafleetError, match=rf"^{PATH}: .*entry 'layers\.\(' is not a regular expression"):
        not_converted(["layers.("])
