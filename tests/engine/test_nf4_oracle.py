"""The W4A16 engine over bitsandbytes 4-bit weights (NF4, FP4, double quantization) against
transformers + PEFT over the dequantized checkpoint (tests/engine/nf4_oracle.py), with adapters;
--quantization nf4 quantizes a plain checkpoint onto the same codes; bad checkpoints are refused at
start naming the file.

Tolerance: on CPU both sides compute in float32 from the same dequantized weights (each weight is
one float32 product, level times absmax, the same on both sides; with double quantization the
absmax is one product and one sum, also the same), and the activations are not quantized (A16): the
two differ only by float32 reassociation, the unquantized oracle's 1e-4, as for int4
(tests/engine/test_int4_oracle.py). The check that quantization happened at all: every row is more
than ten tolerances from the unquantized oracle.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.quant.int4_reference import dequantize_int4
from shared.errors import LorafleetError
from shared.model_info import ModelInfo
from tests.engine.engines import load_model
from tests.engine.int4_oracle import INT4_SHAPE
from tests.engine.nf4_oracle import bnb_config, bnb_oracle, dequantize_bnb, projection_tensors, save_bnb_checkpoint
from tests.engine.test_int4_oracle import _checkpoint_config, check_mixed_batch, served_at_start
from tests.engine.test_model_oracle import SLOTS, assert_greedy_decode_matches
from tests.engine.tiny_hf import TinyCheckpoint, build_checkpoint
from worker.model.model import CausalLM

FORMATS = [("nf4", False), ("nf4", True), ("fp4", False)]  # (quant type, double quantization)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyCheckpoint]:
    """The tiny llama with widths of whole 64-input blocks (128, 256), and its adapters."""
    yield build_checkpoint("llama", tmp_path_factory.mktemp("nf4_llama"), **INT4_SHAPE)


@pytest.fixture(scope="module")
def checkpoints(wide_llama: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Path]:
    root = tmp_path_factory.mktemp("bnb")
    return {
        (quant_type, nested): save_bnb_checkpoint(
            wide_llama.model_dir, root / f"{quant_type}{'_nested' if nested else ''}", quant_type=quant_type,
            double_quant=nested,
        )
        for quant_type, nested in FORMATS
    }  # fmt: skip


def adapters(wide_llama: TinyCheckpoint) -> dict[int, Path]:
    return {slot: wide_llama.adapters[name] for name, slot in SLOTS.items()}


def served_bnb(model_dir: Path, wide_llama: TinyCheckpoint) -> CausalLM:
    """The bitsandbytes checkpoint in `model_dir` as a worker starting on it serves it, with SLOTS' adapters."""
    return load_model(model_dir, served_at_start(model_dir), adapters(wide_llama))


@pytest.mark.parametrize(("quant_type", "nested"), FORMATS)
def test_bnb_checkpoint_matches_the_dequantized_oracle_in_a_mixed_batch(
    wide_llama: TinyCheckpoint, checkpoints: dict, quant_type: str, nested: bool
) -> None:
    model_dir = checkpoints[(quant_type, nested)]
    info = served_at_start(model_dir)
    assert (info.checkpoint_quantization, info.quantization) == (quant_type, quant_type)
    assert (info.weight_group_size, info.weight_double_quant) == (64, nested)
    model = served_bnb(model_dir, wide_llama)
    assert model.model.layers[0].mlp.down_proj.scales.dtype == torch.float32
    check_mixed_batch(model, bnb_oracle(wide_llama.oracle, model_dir), wide_llama.oracle)


def test_nf4_greedy_decode_matches_the_dequantized_oracle(wide_llama: TinyCheckpoint, checkpoints: dict) -> None:
    model_dir = checkpoints[("nf4", True)]
    assert_greedy_decode_matches(served_bnb(model_dir, wide_llama), bnb_oracle(wide_llama.oracle, model_dir), steps=5)


@pytest.mark.parametrize(("quant_type", "nested"), FORMATS)
def test_each_packed_slice_holds_exactly_the_checkpoints_weight(
    wide_llama: TinyCheckpoint, checkpoints: dict, quant_type: str, nested: bool
) -> None:
    model_dir = checkpoints[(quant_type, nested)]
    qkv = load_model(model_dir, served_at_start(model_dir)).model.layers[1].self_attn.qkv_proj
    saved = load_file(model_dir / "model.safetensors")
    k = dequantize_bnb(projection_tensors(saved, "model.layers.1.self_attn.k_proj.weight"))
    assert torch.equal(dequantize_int4(qkv.base_weight)[128 : 128 + 64], k)  # after q's 128 rows


def test_nf4_at_load_quantizes_onto_the_codes_bitsandbytes_saves(wide_llama: TinyCheckpoint, checkpoints: dict) -> None:
    served = wide_llama.info.served(quantization="nf4", kv_cache_dtype="auto", source=wide_llama.model_dir)
    assert (served.quantization, served.checkpoint_quantization, served.weight_group_size) == ("nf4", "none", 64)
    model = load_model(wide_llama.model_dir, served, adapters(wide_llama))
    check_mixed_batch(model, bnb_oracle(wide_llama.oracle, checkpoints[("nf4", False)]), wide_llama.oracle)


def test_nf4_at_load_refuses_widths_in_no_whole_block(llama: TinyCheckpoint) -> None:
    # the default tiny model's MLP is 96 wide
    with pytest.raises(
        LorafleetError, match=r"down_proj's input width 96 is not a multiple of the 4-bit group size 64"
    ):
        llama.info.served(quantization="nf4", kv_cache_dtype="auto", source=llama.model_dir)


def test_a_bnb_checkpoint_is_served_only_as_itself(checkpoints: dict) -> None:
    model_dir = checkpoints[("fp4", False)]
    info = ModelInfo.from_pretrained("llama", model_dir)
    for requested in ("int4", "nf4", "fp8"):
        with pytest.raises(LorafleetError, match="fp4-quantized; it cannot be served as --quantization"):
            info.served(quantization=requested, kv_cache_dtype="auto", source=model_dir)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"load_in_4bit": False, "_load_in_4bit": False, "load_in_8bit": True, "_load_in_8bit": True}, "8-bit"),
        ({"load_in_4bit": False, "_load_in_4bit": False}, "without load_in_4bit true"),
        ({"bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type 'int4' is not supported"),
        ({"bnb_4bit_quant_storage": "bfloat16"}, "bnb_4bit_quant_storage 'bfloat16' is not supported"),
    ],
)
def test_unsupported_bnb_configs_are_refused_naming_the_file(
    wide_llama: TinyCheckpoint, tmp_path: Path, fields: dict, problem: str
) -> None:
    model_dir = _checkpoint_config(wide_llama.model_dir, tmp_path, bnb_config(**fields))
    with pytest.raises(LorafleetError, match=rf"{model_dir / 'config.json'}: .*{problem}"):
        ModelInfo.from_pretrained("llama", model_dir)


def rewritten(model_dir: Path, directory: Path, change) -> Path:
    """A copy of the checkpoint in `model_dir` whose tensors `change` (a function of the dict) rewrote."""
    directory.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (directory / name).write_bytes((model_dir / name).read_bytes())
    tensors = load_file(model_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors")
    return directory


def _state(tensors: dict, name: str) -> dict:
    return json.loads(bytes(tensors[name].tolist()).decode())


def _set_state(tensors: dict, name: str, **fields: object) -> None:
    state = {**_state(tensors, name), **fields}
    tensors[name] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)


UP = "model.layers.1.mlp.up_proj.weight"  # K 128, N 256: 512 blocks of 64
UP_STATE = f"{UP}.quant_state.bitsandbytes__nf4"


@pytest.mark.parametrize(
    ("nested", "change", "problem"),
    [
        (False, lambda t: t.pop(f"{UP}.absmax"), f"{UP}.absmax is missing: a bitsandbytes nf4 checkpoint holds"),
        (True, lambda t: t.pop(f"{UP}.nested_quant_map"), f"{UP}.nested_quant_map is missing: a bitsandbytes nf4 "
                                                           "checkpoint with double quantization holds"),
        (False, lambda t: t.pop(UP_STATE), f"{UP_STATE} is missing"),
    ],
)  # fmt: skip
def test_a_missing_bnb_tensor_is_refused_at_start_naming_it(
    checkpoints: dict, tmp_path: Path, nested: bool, change, problem: str
) -> None:
    model_dir = rewritten(checkpoints[("nf4", nested)], tmp_path / "bad", change)
    with pytest.raises(LorafleetError, match=f"^{re.escape(f'{model_dir}: {problem}')}"):
        served_at_start(model_dir)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda t: t.update({UP: t[UP].reshape(1, -1)}), f"{UP} is U8 [1, 16384]; a bitsandbytes nf4 checkpoint in "
                                                         "blocks of 64 needs U8 [16384, 1]"),
        (lambda t: t.update({f"{UP}.absmax": t[f"{UP}.absmax"].half()}),
         f"{UP}.absmax is F16 [512]; a bitsandbytes nf4 checkpoint in blocks of 64 needs F32 [512]"),
        (lambda t: _set_state(t, UP_STATE, blocksize=128), f"{UP_STATE}: blocksize 128, but the checkpoint's first "
                                                           "quant state has 64"),
        (lambda t: _set_state(t, UP_STATE, blocksize=96), f"{UP_STATE}: blocksize 96 is not supported"),
        (lambda t: _set_state(t, UP_STATE, shape=[128, 256]), f"{UP_STATE}: shape [128, 256], but the model's "
                                                              "projection is [256, 128]"),
        (lambda t: _set_state(t, UP_STATE, nested_blocksize=256), f"{UP_STATE} is double-quantized, against "
                                                                  "config.json's bnb_4bit_use_double_quant"),
    ],
)  # fmt: skip
def test_a_misshapen_bnb_tensor_is_refused_at_start_naming_its_file(
    checkpoints: dict, tmp_path: Path, change, problem: str
) -> None:
    model_dir = rewritten(checkpoints[("nf4", False)], tmp_path / "bad", change)
    message = f"{model_dir / 'model.safetensors'}: {problem}"
    with pytest.raises(LorafleetError, match=f"^{re.escape(message)}"):
        served_at_start(model_dir)


def test_a_quant_map_other_than_bitsandbytes_table_is_refused_at_load(
    wide_llama: TinyCheckpoint, checkpoints: dict, tmp_path: Path
) -> None:
    model_dir = rewritten(
        checkpoints[("nf4", False)],
        tmp_path / "bad",
        lambda t: t.update({f"{UP}.quant_map": torch.linspace(-1, 1, 16)}),
    )
    with pytest.raises(ValueError, match=f"{re.escape(UP)}.quant_map is not bitsandbytes' nf4 table"):
        served_bnb(model_dir, wide_llama)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
@pytest.mark.parametrize(("quant_type", "nested"), FORMATS)
def test_files_and_reader_agree_with_bitsandbytes(
    wide_llama: TinyCheckpoint, checkpoints: dict, quant_type: str, nested: bool
) -> None:
    """bitsandbytes itself (its CPU backend), where installed: it quantizes the plain weight into the
    same tensors the test writer saved, and dequantizes the saved ones into what the engine holds."""
    import bitsandbytes.functional as bnb

    model_dir = checkpoints[(quant_type, nested)]
    saved = load_file(model_dir / "model.safetensors")
    plain = load_file(wide_llama.model_dir / "model.safetensors")
    model = load_model(model_dir, served_at_start(model_dir))
    gate_up = model.model.layers[0].mlp.gate_up_proj
    for index, projection in enumerate(("gate_proj", "up_proj")):
        weight = f"model.layers.0.mlp.{projection}.weight"
        packed, state = bnb.quantize_4bit(
            plain[weight], blocksize=64, compress_statistics=nested, quant_type=quant_type
        )
        ours = projection_tensors(saved, weight)
        assert torch.equal(packed, ours[""])
        theirs = state.as_dict(packed=True)
        assert {f".{name}" for name in theirs} == set(ours) - {""}
        for name, tensor in theirs.items():
            if name.startswith("quant_state"):
                assert json.loads(bytes(ours[f".{name}"].tolist())) == json.loads(bytes(tensor.tolist()))
            else:
                assert torch.equal(ours[f".{name}"], tensor), name
        loaded = bnb.QuantState.from_dict({name.removeprefix("."): t for name, t in ours.items() if name}, "cpu")
        dequantized = bnb.dequantize_4bit(ours[""], loaded)
        assert torch.equal(dequantize_int4(gate_up.base_weight)[index * 256 : (index + 1) * 256], dequantized)


def test_double_quantized_absmax_differs_from_the_plain_one(checkpoints: dict) -> None:
    # the nested checkpoint really stores 8-bit absmax: its dequantized weights are not the plain one's
    plain = load_file(checkpoints[("nf4", False)] / "model.safetensors")
    nested = load_file(checkpoints[("nf4", True)] / "model.safetensors")
    assert nested[f"{UP}.absmax"].dtype == torch.uint8
    difference = dequantize_bnb(projection_tensors(nested, UP)) - dequantize_bnb(projection_tensors(plain, UP))
    assert 0 < difference.abs().max() < 1e-2


def test_model_info_round_trips_double_quantization(checkpoints: dict) -> None:
    info = ModelInfo.from_pretrained("llama", checkpoints[("nf4", True)])
    assert ModelInfo.from_json(info.to_json()) == info and info.weight_double_quant
    assert not dataclasses.replace(info, weight_double_quant=False).weight_double_quant
