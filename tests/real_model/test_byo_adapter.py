"""docs/bring-your-own-adapter.md as written: after `lorafleet up`, examples/byo_adapter.py fine-tunes a
LoRA with peft on the demo model, registers it through the admin API and streams an answer through
the openai client (a couple of training steps here: the walkthrough's flow, not its quality).

`up` starts on a state dir that already holds the session's converted SmolLM2, as every `up` after the
first does: the conversion (seconds; tests/e2e/test_up.py covers a first start) is not the walkthrough's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli.demo import SMOLLM2_MODEL, demo_model_dir
from cli.redis_server import free_port
from tests.e2e.processes import REPO_ROOT, lorafleet_process, wait_until

pytestmark = pytest.mark.slow


def test_the_walkthrough_trains_registers_and_calls_an_adapter(tmp_path: Path, smollm2_dir: Path) -> None:
    state_dir, log = tmp_path / "state", tmp_path / "up.log"
    model_dir = demo_model_dir(state_dir, SMOLLM2_MODEL)
    model_dir.parent.mkdir(parents=True)
    model_dir.symlink_to(smollm2_dir, target_is_directory=True)
    command = ["up", "--state-dir", str(state_dir), "--port", str(free_port()), "--worker-metrics-port", "0"]
    with lorafleet_process(command, log):
        wait_until(lambda: "ready in" in log.read_text(), timeout_s=240, what="lorafleet up to be ready", logs=[log])
        assert json.loads((state_dir / "demo.json").read_text())["models"] == ["smollm2"]
        example = subprocess.run(
            [sys.executable, "examples/byo_adapter.py", "--state-dir", str(state_dir), "--steps", "2"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert example.returncode == 0, example.stderr[-3000:]
    lines = example.stdout.splitlines()
    assert lines[:2] == [line for line in lines if line.startswith("step ")]
    assert "registered my-adapter version 1 for tenant mycorp" in lines
    answer = lines[-1]
    assert answer.strip() and "\ufffd" not in answer
    assert (state_dir / "adapters" / "mycorp" / "my-adapter" / "adapter_model.safetensors").is_file()
