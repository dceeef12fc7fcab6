"""The entry point refuses to start when another package answers to one of our packages' names (Hugging
Face's `kernels`, which transformers >= 5.25 installs), naming it, instead of failing deep in an import."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.own_packages import ROOT, shadowed_packages


def test_this_checkout_finds_its_own_packages():
    assert shadowed_packages() == []


def test_a_package_this_install_lacks_is_not_shadowed(monkeypatch: pytest.MonkeyPatch):
    # the gateway image ships no worker or kernels: the commands that need them say so themselves
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "worker" else real_find_spec(name))
    assert shadowed_packages() == []


def test_a_foreign_kernels_package_first_on_the_path_is_named_before_anything_runs(tmp_path: Path):
    foreign = tmp_path / "kernels"
    foreign.mkdir()
    (foreign / "__init__.py").write_text("")  # what `import kernels` finds first, as a console script would
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    result = subprocess.run(
        [sys.executable, "-c", "from cli.main import main; raise SystemExit(main(['--help']))"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"`import kernels` finds {foreign.resolve()}, not {ROOT / 'kernels'}" in result.stderr
    assert "pip uninstall kernels" in result.stderr and "Traceback" not in result.stderr
    assert "usage:" not in result.stdout  # refused before parsing
