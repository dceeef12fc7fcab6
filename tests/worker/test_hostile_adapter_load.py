"""The worker's own adapter load (disk → host) goes through the same confined, read-once validator as
registration: every hostile adapter of tests/shared/hostile_adapters.py fails that adapter's load
(ADAPTER_LOAD_FAILED naming the problem), and files swapped after registration are never served,
not even for identical bytes behind a symlink."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from shared import adapter_digest
from shared.adapter_format import WEIGHTS_FILE, read_adapter
from shared.errors import ErrorCode, LorafleetError
from shared.schema import AdapterRef
from tests.gateway.fleet import tiny_model
from tests.shared.hostile_adapters import (
    CONFIG_CASES,
    FILE_CASES,
    OTHER,
    SAFETENSORS_CASES,
    Hostile,
    Lab,
    piece_digest_of,
)
from worker.adapter_pool.host_adapter import fresh_buffers, read_host_adapter

MODEL = tiny_model("tiny")


@pytest.fixture
def lab(tmp_path: Path) -> Lab:
    return Lab(tmp_path / "adapters", tmp_path / "outside", MODEL)


def load(lab: Lab, path: str, digest: str = "sha256-pieces-8MiB:" + "0" * 64):
    """The worker's load, as its pool runs it: pieces hashed on threads of their own."""
    ref = AdapterRef("a", 1, path, digest)
    with ThreadPoolExecutor(2) as hasher:
        return read_host_adapter(
            ref,
            adapter_root=lab.root,
            info=MODEL,
            dtype=torch.float32,
            max_rank=8,
            max_bytes=1 << 22,
            take=fresh_buffers(pin=False),
            hasher=hasher,
        )


def digest_of(directory: Path, piece_bytes: int = 8 << 20) -> str:
    return piece_digest_of((directory / WEIGHTS_FILE).read_bytes(), piece_bytes)


@pytest.mark.parametrize("case", SAFETENSORS_CASES + CONFIG_CASES + FILE_CASES, ids=lambda c: c.name)
def test_a_hostile_adapter_fails_its_load_with_the_validators_reason(lab: Lab, case: Hostile):
    path = case.build(lab)
    with pytest.raises(LorafleetError) as validator:
        read_adapter(lab.root, path, MODEL, max_rank=8, max_bytes=1 << 22)

    with pytest.raises(LorafleetError) as worker:
        load(lab, path)
    assert worker.value.code is ErrorCode.ADAPTER_LOAD_FAILED
    assert worker.value.message == validator.value.message


def test_a_valid_adapter_is_served_from_the_bytes_it_hashed(lab: Lab):
    directory = lab.valid()
    adapter = load(lab, lab.rel(directory), digest_of(directory))
    data = (directory / WEIGHTS_FILE).read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    assert adapter.buffer.numpy().tobytes() == data[header_end:]


def test_weights_replaced_by_a_symlink_to_identical_bytes_of_another_tenant_are_refused(lab: Lab):
    """The hash alone would pass: the file's identity is also where it is."""
    directory = lab.valid()
    registered = digest_of(directory)
    theirs = lab.valid(OTHER)
    (theirs / WEIGHTS_FILE).write_bytes((directory / WEIGHTS_FILE).read_bytes())
    (directory / WEIGHTS_FILE).unlink()
    (directory / WEIGHTS_FILE).symlink_to(theirs / WEIGHTS_FILE)

    with pytest.raises(LorafleetError, match="symlink") as refused:
        load(lab, lab.rel(directory), registered)
    assert refused.value.code is ErrorCode.ADAPTER_LOAD_FAILED


def test_an_adapter_directory_replaced_by_a_symlink_after_registration_is_refused(lab: Lab):
    directory = lab.valid()
    registered = digest_of(directory)
    copy = lab.valid(OTHER)
    (copy / WEIGHTS_FILE).write_bytes((directory / WEIGHTS_FILE).read_bytes())
    directory.rename(directory.with_name("gone"))
    directory.symlink_to(copy)

    with pytest.raises(LorafleetError, match="symlink"):
        load(lab, lab.rel(directory), registered)


def test_weights_changed_after_registration_are_refused(lab: Lab):
    directory = lab.valid()
    registered = digest_of(directory)
    lab.weights(directory, lab.table(), bytes(len(lab.data())))

    with pytest.raises(LorafleetError, match="changed since registration"):
        load(lab, lab.rel(directory), registered)


PIECE = 64  # bytes: the test adapter's file (~330 bytes) spans several pieces


def _flip(offset: Callable[[bytes], int]) -> Callable[[bytes], bytes]:
    def change(content: bytes) -> bytes:
        at = offset(content)
        return content[:at] + bytes([content[at] ^ 1]) + content[at + 1 :]

    return change


def _data_start(content: bytes) -> int:
    return 8 + int.from_bytes(content[:8], "little")


# the weights file changed after registration, in the data section only (the header still validates)
CHANGES = {
    "the first data byte": _flip(_data_start),
    "a byte in the middle of the data": _flip(lambda content: (_data_start(content) + len(content)) // 2),
    "a piece's first byte": _flip(lambda content: -(-_data_start(content) // PIECE) * PIECE),
    "a piece's last byte": _flip(lambda content: -(-_data_start(content) // PIECE) * PIECE + PIECE - 1),
    "the last byte (in the short last piece)": _flip(lambda content: len(content) - 1),
}


@pytest.mark.parametrize("change", list(CHANGES.values()), ids=list(CHANGES))
def test_a_byte_changed_in_any_piece_after_registration_is_refused(lab: Lab, change, monkeypatch):
    monkeypatch.setattr(adapter_digest, "PIECE_BYTES", PIECE)
    directory = lab.valid()
    registered = digest_of(directory, PIECE)
    assert adapter_digest.file_digest(directory / WEIGHTS_FILE) == registered  # the oracle and the code agree
    weights = directory / WEIGHTS_FILE
    content = weights.read_bytes()
    assert len(content) > 4 * PIECE
    weights.write_bytes(change(content))

    with pytest.raises(LorafleetError, match="changed since registration") as refused:
        load(lab, lab.rel(directory), registered)
    assert refused.value.code is ErrorCode.ADAPTER_LOAD_FAILED


@pytest.mark.parametrize(
    "size_change", [-1, -PIECE, +1, +PIECE], ids=["truncated", "a piece shorter", "appended", "a piece longer"]
)
def test_weights_truncated_or_appended_to_after_registration_are_refused(lab: Lab, size_change: int, monkeypatch):
    """A shorter or longer file fails the safetensors table (its data must end where the table says)
    before the digest: either way that load fails and nothing of it is served."""
    monkeypatch.setattr(adapter_digest, "PIECE_BYTES", PIECE)
    directory = lab.valid()
    registered = digest_of(directory, PIECE)
    weights = directory / WEIGHTS_FILE
    content = weights.read_bytes()
    weights.write_bytes(content[:size_change] if size_change < 0 else content + b"\0" * size_change)

    with pytest.raises(LorafleetError) as refused:
        load(lab, lab.rel(directory), registered)
    assert refused.value.code is ErrorCode.ADAPTER_LOAD_FAILED


def test_an_adapter_registered_with_a_plain_sha256_is_refused_naming_the_scheme(lab: Lab):
    """A registry record from before piece digests names a plain sha256, which this worker does not
    check: the load fails asking for the adapter to be registered again, never serves unchecked bytes."""
    directory = lab.valid()

    with pytest.raises(LorafleetError, match=r"scheme 'sha256'.*register it again"):
        load(lab, lab.rel(directory), "sha256:" + "0" * 64)
