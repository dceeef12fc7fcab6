"""Every hostile adapter of the corpus (tests/shared/hostile_adapters.py) is refused by the one
validator gateways and workers share, with the code that names its problem; a valid adapter read
through any equivalent path form is accepted; the bytes it hands back are the bytes it hashed."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.adapter_format import WEIGHTS_FILE, read_adapter
from shared.adapter_paths import adapter_relative_path
from shared.errors import LorafleetError
from tests.gateway.fleet import tiny_model
from tests.shared.hostile_adapters import (
    CONFIG_CASES,
    EQUIVALENT_PATHS,
    FILE_CASES,
    OWNER,
    PATH_CASES,
    SAFETENSORS_CASES,
    Hostile,
    Lab,
    piece_digest_of,
)

MODEL = tiny_model("tiny")


@pytest.fixture
def lab(tmp_path: Path) -> Lab:
    return Lab(tmp_path / "adapters", tmp_path / "outside", MODEL)


def read(lab: Lab, path: str, *, owner: str | None = OWNER):
    """What registration does: the path checked for `owner`, then the files read."""
    relative = adapter_relative_path(lab.root, path, owner=owner) if owner else path
    return read_adapter(lab.root, relative, MODEL, max_rank=8, max_bytes=4 << 20)


@pytest.mark.parametrize("case", SAFETENSORS_CASES + CONFIG_CASES + FILE_CASES + PATH_CASES, ids=lambda c: c.name)
def test_a_hostile_adapter_is_refused_with_its_code(lab: Lab, case: Hostile):
    path = case.build(lab)
    with pytest.raises(LorafleetError) as refused:
        read(lab, path)
    assert refused.value.code == case.code, refused.value.message
    assert len(refused.value.message) <= 400  # names the problem without echoing the input at length


@pytest.mark.parametrize("case", FILE_CASES, ids=lambda c: c.name)
def test_the_files_of_an_adapter_are_confined_on_the_workers_path_too(lab: Lab, case: Hostile):
    """A worker reads the registry's relative path without an owner check: the walk itself refuses."""
    with pytest.raises(LorafleetError) as refused:
        read(lab, case.build(lab), owner=None)
    assert refused.value.code == case.code


@pytest.mark.parametrize("form", range(len(EQUIVALENT_PATHS)))
def test_every_spelling_of_an_own_adapters_path_is_accepted_as_one_path(lab: Lab, form: int):
    relative = lab.rel(lab.valid(name="ädäpter-ü"))
    files = read(lab, EQUIVALENT_PATHS[form](relative, lab.root))
    assert files.relative_path == relative


def test_the_bytes_served_are_the_bytes_hashed_and_validated(lab: Lab):
    directory = lab.valid()
    files = read_adapter(
        lab.root,
        lab.rel(directory),
        MODEL,
        max_rank=8,
        max_bytes=1 << 20,
        allocate=lambda n, *_: memoryview(bytearray(n)),
    )
    on_disk = (directory / WEIGHTS_FILE).read_bytes()
    assert files.weights_file() == on_disk
    assert files.manifest.digest == piece_digest_of(on_disk)
    assert files.manifest.size_bytes == len(on_disk)
    streamed = read_adapter(lab.root, lab.rel(directory), MODEL, max_rank=8, max_bytes=1 << 20)
    assert streamed.data is None and streamed.manifest == files.manifest


def test_lora_alpha_defaults_to_pefts_and_scales_finitely(lab: Lab):
    directory = lab.valid()
    lab.config(directory, {"lora_alpha": 3})
    assert read(lab, lab.rel(directory)).manifest.scaling == 1.5
    text = (directory / "adapter_config.json").read_text().replace('"lora_alpha": 3, ', "")
    (directory / "adapter_config.json").write_text(text)
    assert read(lab, lab.rel(directory)).manifest.lora_alpha == 8
