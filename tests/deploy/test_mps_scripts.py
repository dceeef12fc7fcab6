"""deploy/mps/: the MPS control daemon's start and stop scripts, as far as a machine without the
NVIDIA driver can check them (bench/model_switch.py's GPU run starts and stops the real daemon)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

MPS = Path(__file__).resolve().parents[2] / "deploy" / "mps"
SCRIPTS = [MPS / "start.sh", MPS / "stop.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_script_is_executable_bash_that_parses(script: Path) -> None:
    assert os.access(script, os.X_OK)
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is not None, reason="the real daemon is here")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_without_the_driver_the_script_fails_naming_the_missing_binary(script: Path, tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe")}
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert result.returncode == 1
    assert "nvidia-cuda-mps-control is not on PATH" in result.stderr
    assert not (tmp_path / "pipe").exists()  # nothing created before the check


def test_both_scripts_default_to_the_same_pipe_directory() -> None:
    defaults = [
        next(line for line in s.read_text().splitlines() if line.startswith("export CUDA_MPS_PIPE_DIRECTORY="))
        for s in SCRIPTS
    ]
    assert defaults[0] == defaults[1]
