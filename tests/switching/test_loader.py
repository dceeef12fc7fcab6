"""Cold loads (streamed to the model, or read into host buffers) and warm fills of a model, against
what the safetensors library reads."""

from __future__ import annotations

import errno
import itertools
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.errors import LorafleetError
from shared.model_info import ModelInfo
from tests.engine.tiny_hf import save_tiny_model
from worker.model.model import CausalLM
from worker.model.weights import SINGLE_FILE, checkpoint_files
from worker.switching import shard_reader
from worker.switching.loader import checkpoint_bytes, copy_to_model, read_to_host, stream_to_model
from worker.switching.shard_reader import CheckpointReadError, StagingRing


def filled_by_safetensors(info: ModelInfo, model_dir: Path, device: str = "cpu") -> CausalLM:
    """The reference: a model filled from the tensors the safetensors library reads from every shard."""
    model = CausalLM(info, max_loras=1, max_lora_rank=2, dtype=torch.float32, device=device)
    tensors = itertools.chain.from_iterable(load_file(str(path)).items() for path in checkpoint_files(model_dir))
    model.load_tensors(tensors, source="safetensors")
    return model


def test_host_tensors_equal_what_safetensors_reads(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(3, 5, dtype=torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(2, 2, 2, dtype=torch.float32),
        "scalar": torch.tensor(1.5, dtype=torch.float16),
    }
    save_file(tensors, str(tmp_path / SINGLE_FILE))
    host = read_to_host("m", tmp_path, pin=False)
    reference = load_file(str(tmp_path / SINGLE_FILE))
    assert host.tensors.keys() == reference.keys()
    for name, tensor in reference.items():
        assert host.tensors[name].dtype == tensor.dtype and torch.equal(host.tensors[name], tensor), name
    assert host.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_a_tensor_at_an_unaligned_offset_is_read_correctly(tmp_path: Path) -> None:
    # one odd-sized uint8 tensor first puts the fp32 tensor after it at an offset not divisible by 4
    odd, wide = torch.arange(3, dtype=torch.uint8), torch.randn(4)
    header = {
        "odd": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "wide": {"dtype": "F32", "shape": [4], "data_offsets": [3, 19]},
    }
    raw = json.dumps(header).encode()
    data = odd.numpy().tobytes() + wide.numpy().tobytes()
    (tmp_path / SINGLE_FILE).write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    host = read_to_host("m", tmp_path, pin=False)
    assert torch.equal(host.tensors["odd"], odd) and torch.equal(host.tensors["wide"], wide)


def test_offsets_outside_the_file_are_refused(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (tmp_path / SINGLE_FILE).write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(
        LorafleetError, match=r"model\.safetensors: the tensors take 16 bytes of data, the file holds 8"
    ):
        read_to_host("m", tmp_path, pin=False)


@pytest.mark.parametrize(("shard_size", "segment_bytes"), [(None, 256 << 20), ("20KB", 256 << 20), (None, 4096)])
def test_a_model_filled_from_host_memory_equals_one_filled_by_safetensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard_size: str | None, segment_bytes: int
) -> None:
    monkeypatch.setattr(shard_reader, "SEGMENT_BYTES", segment_bytes)  # 4096: many host buffers per file
    save_tiny_model("qwen2", tmp_path, seed=3, max_shard_size=shard_size)  # q/k/v biases and a tied head
    info = ModelInfo.from_pretrained("m", tmp_path)
    from_disk = filled_by_safetensors(info, tmp_path)
    from_host = CausalLM(info, max_loras=1, max_lora_rank=2, dtype=torch.float32)
    host = read_to_host("m", tmp_path, pin=False)
    copy_to_model(from_host, host, stream=None)
    assert checkpoint_bytes(tmp_path) > host.nbytes  # files also hold their headers
    disk_state = from_disk.state_dict()
    for name, tensor in from_host.state_dict().items():
        assert torch.equal(tensor, disk_state[name]), name


@pytest.mark.parametrize("shard_size", [None, "20KB"])
def test_a_model_streamed_from_its_files_equals_one_filled_by_safetensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard_size: str | None
) -> None:
    monkeypatch.setattr(shard_reader, "SEGMENT_BYTES", 4096)  # the staging buffers reused many times over
    save_tiny_model("qwen2", tmp_path, seed=4, max_shard_size=shard_size)
    info = ModelInfo.from_pretrained("m", tmp_path)
    streamed = CausalLM(info, max_loras=1, max_lora_rank=2, dtype=torch.float32)
    stream_to_model(streamed, "m", tmp_path, StagingRing(pin=False), stream=None)
    disk_state = filled_by_safetensors(info, tmp_path).state_dict()
    for name, tensor in streamed.state_dict().items():
        assert torch.equal(tensor, disk_state[name]), name


def test_a_disk_error_fails_the_streamed_load_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_reader, "SEGMENT_BYTES", 4096)  # reads past the first page
    save_tiny_model("llama", tmp_path, seed=0)
    model = CausalLM(ModelInfo.from_pretrained("m", tmp_path), max_loras=1, max_lora_rank=2)
    real_preadv = os.preadv

    def fails_past_the_header(fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset > 0:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", fails_past_the_header)
    with pytest.raises(
        CheckpointReadError, match=r"model\.safetensors: read failed at byte \d+ \(Input/output error\)"
    ):
        stream_to_model(model, "m", tmp_path, StagingRing(pin=False), stream=None)


def test_a_host_checkpoint_missing_a_tensor_is_refused(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path, seed=0)
    host = read_to_host("m", tmp_path, pin=False)
    del host.tensors["model.norm.weight"]
    model = CausalLM(ModelInfo.from_pretrained("m", tmp_path), max_loras=1, max_lora_rank=2)
    with pytest.raises(ValueError, match=r"lacks 1 tensors: model\.norm\.weight"):
        copy_to_model(model, host, stream=None)


@pytest.mark.gpu
def test_pinned_host_copy_on_a_side_stream_fills_the_device_model(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path, seed=1)
    info = ModelInfo.from_pretrained("m", tmp_path)
    host = read_to_host("m", tmp_path, pin=True)
    assert all(t.is_pinned() for t in host.tensors.values())
    model = CausalLM(info, max_loras=1, max_lora_rank=2, dtype=torch.float32, device="cuda")
    copy_to_model(model, host, torch.cuda.Stream())
    reference = filled_by_safetensors(info, tmp_path, device="cuda")
    for (name, tensor), expected in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(tensor, expected), name


@pytest.mark.gpu
def test_a_model_streamed_through_page_locked_staging_fills_the_device_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shard_reader, "SEGMENT_BYTES", 4096)  # every staging buffer reused behind its copies
    save_tiny_model("llama", tmp_path, seed=2)
    info = ModelInfo.from_pretrained("m", tmp_path)
    model = CausalLM(info, max_loras=1, max_lora_rank=2, dtype=torch.float32, device="cuda")
    stream_to_model(model, "m", tmp_path, StagingRing(pin=True), torch.cuda.Stream())
    reference = filled_by_safetensors(info, tmp_path, device="cuda")
    for (name, tensor), expected in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(tensor, expected), name
