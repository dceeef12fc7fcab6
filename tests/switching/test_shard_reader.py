"""The shard reader against the safetensors library's own loader, and each way a read can fail: a
short read, a file changing under the reader, a disk error mid-read, each failing that load alone."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.switching import shard_reader
from worker.switching.shard_reader import CheckpointReadError, KeptBuffers, StagingRing, read_tensors

SMALL_SEGMENT = 3 * shard_reader.ALIGN  # many segments (and ring reuse) from a few hundred KB
SMALL_CHUNK = shard_reader.ALIGN  # several reads in flight per segment


@pytest.fixture(autouse=True)
def small_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_reader, "SEGMENT_BYTES", SMALL_SEGMENT)
    monkeypatch.setattr(shard_reader, "CHUNK_BYTES", SMALL_CHUNK)


def random_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Every dtype safetensors defines, in shapes from a scalar and an empty tensor to one larger than
    a segment, with an odd-sized byte tensor first so that what follows is not ALIGN-aligned."""
    gen = torch.Generator().manual_seed(seed)

    def ints(shape: tuple[int, ...], dtype: torch.dtype, high: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=gen, dtype=torch.int64).to(dtype)

    def floats(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    return {
        "odd": ints((13,), torch.uint8, 256),
        "bool": ints((7, 3), torch.bool, 2),
        "i8": ints((5, 11), torch.int8, 127),
        "f8_e4m3": floats((17,), torch.float8_e4m3fn),
        "f8_e5m2": floats((2, 9), torch.float8_e5m2),
        "u16": ints((33,), torch.uint16, 65535),
        "i16": ints((3, 3, 3), torch.int16, 30000),
        "f16": floats((40, 40), torch.float16),
        "bf16": floats((128, 100), torch.bfloat16),  # 25 KB: larger than a segment, alone in its read
        "u32": ints((6,), torch.uint32, 1 << 31),
        "i32": ints((1, 1, 1, 5), torch.int32, 1 << 31),
        "f32": floats((300, 7), torch.float32),
        "u64": ints((4,), torch.uint64, 1 << 62),
        "i64": ints((9,), torch.int64, 1 << 62),
        "f64": floats((2, 50), torch.float64),
        "scalar": floats((), torch.float32),
        "empty": floats((0, 4), torch.float16),
    }


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def two_shards(tmp_path: Path) -> list[Path]:
    tensors = random_tensors(seed=0)
    names = list(tensors)
    paths = [tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"]
    save_file({n: tensors[n] for n in names[::2]}, str(paths[0]))
    save_file({n: tensors[n] for n in names[1::2]}, str(paths[1]))
    return paths


def read_all(paths: list[Path], buffers: shard_reader.SegmentBuffers, window: int = 3) -> dict[str, torch.Tensor]:
    """Every tensor, cloned as it is handed out (a staging buffer is reused behind it)."""
    with contextlib.closing(read_tensors("m", paths, buffers, window=window)) as tensors:
        return {name: tensor.clone() for name, tensor in tensors}


def reference(paths: list[Path]) -> dict[str, torch.Tensor]:
    return {name: tensor for path in paths for name, tensor in load_file(str(path)).items()}


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
@pytest.mark.parametrize("buffers", ["staging_ring", "kept"])
def test_every_dtype_and_shape_reads_as_safetensors_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool, buffers: str
) -> None:
    if not direct:  # a file system that refuses O_DIRECT
        monkeypatch.setattr(shard_reader, "_direct_fd", lambda path: None)
    paths = two_shards(tmp_path)
    target = StagingRing(pin=False) if buffers == "staging_ring" else KeptBuffers(pin=False)
    read = read_all(paths, target)
    expected = reference(paths)
    assert read.keys() == expected.keys()
    for name, tensor in expected.items():
        assert same_bytes(read[name], tensor), name


def test_kept_buffers_hold_their_tensors_after_the_read(tmp_path: Path) -> None:
    paths = two_shards(tmp_path)
    with contextlib.closing(read_tensors("m", paths, KeptBuffers(pin=False))) as tensors:
        kept = dict(tensors)  # views, not clones
    for name, tensor in reference(paths).items():
        assert same_bytes(kept[name], tensor), name


def test_kept_tensors_view_whole_aligned_buffers_as_their_storage(tmp_path: Path) -> None:
    """torch's is_pinned asks about a tensor's storage's first byte: for the warm tier's tensors to
    read as pinned, that byte must be the first of a buffer a PageLock registers (ALIGN-aligned)."""
    buffers = KeptBuffers(pin=False)
    with contextlib.closing(read_tensors("m", two_shards(tmp_path), buffers)) as tensors:
        kept = dict(tensors)
    starts = {buffer.data_ptr() for buffer in buffers.buffers}
    for buffer in buffers.buffers:
        storage = buffer.untyped_storage()
        assert storage.data_ptr() == buffer.data_ptr() and storage.nbytes() == buffer.numel()
        assert buffer.data_ptr() % shard_reader.ALIGN == 0
    assert all(tensor.untyped_storage().data_ptr() in starts for tensor in kept.values())


def test_partial_reads_are_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_reader, "_direct_fd", lambda path: None)
    real_preadv = os.preadv

    def at_most_1000_bytes(fd: int, buffers: list[memoryview], offset: int) -> int:
        return real_preadv(fd, [buffers[0][:1000]], offset)

    monkeypatch.setattr(os, "preadv", at_most_1000_bytes)
    paths = two_shards(tmp_path)
    read = read_all(paths, StagingRing(pin=False))
    for name, tensor in reference(paths).items():
        assert same_bytes(read[name], tensor), name


def test_a_read_that_ends_early_fails_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = two_shards(tmp_path)
    real_preadv = os.preadv
    cut = paths[1].stat().st_size // 2

    def file_ends_at_cut(fd: int, buffers: list[memoryview], offset: int) -> int:
        if (
            os.path.samefile(f"/proc/self/fd/{fd}", paths[1])
            and offset >= cut // shard_reader.ALIGN * shard_reader.ALIGN
        ):
            return 0
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", file_ends_at_cut)
    with pytest.raises(CheckpointReadError, match=rf"{paths[1]}: the file ended \d+ bytes early"):
        read_all(paths, StagingRing(pin=False))


def test_a_file_changed_under_the_reader_fails_naming_it(tmp_path: Path) -> None:
    paths = two_shards(tmp_path)
    tensors = read_tensors("m", paths, StagingRing(pin=False), window=1)
    with contextlib.closing(tensors), pytest.raises(CheckpointReadError, match=rf"{paths[1]}: the file changed"):
        for _ in tensors:
            with paths[1].open("ab") as f:  # appended to while the first shard is still being read
                f.write(b"\0")


def test_a_disk_error_mid_read_fails_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = two_shards(tmp_path)
    real_preadv = os.preadv
    calls = []

    def fails_on_the_fifth_read(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(offset)
        if len(calls) == 5:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", fails_on_the_fifth_read)
    with pytest.raises(CheckpointReadError, match=r"\.safetensors: read failed at byte \d+ \(Input/output error\)"):
        read_all(paths, StagingRing(pin=False))


def test_a_failed_load_leaves_no_reads_running_and_the_next_load_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = two_shards(tmp_path)
    staging = StagingRing(pin=False)
    real_preadv = os.preadv

    def fails(fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset > 0:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_preadv(fd, buffers, offset)

    with monkeypatch.context() as patch:
        patch.setattr(os, "preadv", fails)
        with pytest.raises(CheckpointReadError):
            read_all(paths, staging)
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpoint-")]
    read = read_all(paths, staging)  # the same buffers, the disk healthy again
    for name, tensor in reference(paths).items():
        assert same_bytes(read[name], tensor), name


def test_a_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    for path in paths:
        save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(CheckpointReadError, match=r"b\.safetensors: tensor 'w' is also in .*a\.safetensors"):
        read_all(paths, StagingRing(pin=False))
