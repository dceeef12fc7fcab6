"""The worker's own adapter load (disk → host) goes through the same confined, read-once validator as
registration: every hostile adapter of tests/shared/hostile_adapters.py fails that adapter's load
(ADAPTER_LOAD_FAILED naming the problem), and files swapped after registration are never served,
not even for identical bytes behind a symlink."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from shared.adapter_format import WEIGHTS_FILE, read_adapter
from shared.errors import ErrorCode, LorafleetError
from shared.schema import AdapterRef
from tests.gateway.fleet import tiny_model
from tests.shared.hostile_adapters import CONFIG_CASES, FILE_CASES, OTHER, SAFETENSORS_CASES, Hostile, Lab
from worker.adapter_pool.host_adapter import read_host_adapter

MODEL = tiny_model("tiny")


@pytest.fixture
def lab(tmp_path: Path) -> Lab:
    return Lab(tmp_path / "adapters", tmp_path / "outside", MODEL)


def load(lab: Lab, path: str, sha256: str = "0" * 64):
    ref = AdapterRef("a", 1, path, sha256)
    return read_host_adapter(
        ref, adapter_root=lab.root, info=MODEL, dtype=torch.float32, max_rank=8, max_bytes=1 << 22, pin=False
    )


def sha256_of(directory: Path) -> str:
    return hashlib.sha256((directory / WEIGHTS_FILE).read_bytes()).hexdigest()


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
    adapter = load(lab, lab.rel(directory), sha256_of(directory))
    data = (directory / WEIGHTS_FILE).read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    assert adapter.buffer.numpy().tobytes() == data[header_end:]


def test_weights_replaced_by_a_symlink_to_identical_bytes_of_another_tenant_are_refused(lab: Lab):
    """The hash alone would pass: the file's identity is also where it is."""
    directory = lab.valid()
    registered = sha256_of(directory)
    theirs = lab.valid(OTHER)
    (theirs / WEIGHTS_FILE).write_bytes((directory / WEIGHTS_FILE).read_bytes())
    (directory / WEIGHTS_FILE).unlink()
    (directory / WEIGHTS_FILE).symlink_to(theirs / WEIGHTS_FILE)

    with pytest.raises(LorafleetError, match="symlink") as refused:
        load(lab, lab.rel(directory), registered)
    assert refused.value.code is ErrorCode.ADAPTER_LOAD_FAILED


def test_an_adapter_directory_replaced_by_a_symlink_after_registration_is_refused(lab: Lab):
    directory = lab.valid()
    registered = sha256_of(directory)
    copy = lab.valid(OTHER)
    (copy / WEIGHTS_FILE).write_bytes((directory / WEIGHTS_FILE).read_bytes())
    directory.rename(directory.with_name("gone"))
    directory.symlink_to(copy)

    with pytest.raises(LorafleetError, match="symlink"):
        load(lab, lab.rel(directory), registered)


def test_weights_changed_after_registration_are_refused(lab: Lab):
    directory = lab.valid()
    registered = sha256_of(directory)
    lab.weights(directory, lab.table(), bytes(len(lab.data())))

    with pytest.raises(LorafleetError, match="changed since registration"):
        load(lab, lab.rel(directory), registered)
