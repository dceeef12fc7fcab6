"""bench/priorities end to end on the CPU with the tiny preset and a small batch: Redis, a gateway
and a CPU worker as real processes; every phase runs and the batch comes back complete, each line once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.priorities import main

pytestmark = pytest.mark.slow


def test_the_tiny_preset_runs_every_phase_and_the_batch_comes_back_whole(tmp_path: Path):
    out = tmp_path / "out"
    args = ["--preset", "tiny", "--batch-lines", "24", "--out", str(out), "--workdir", str(tmp_path / "work")]
    assert main([*args, "--budget-s", "100"]) == 0

    lines = [json.loads(line) for line in (out / "priorities.jsonl").read_text().splitlines()]
    [meta] = [line for line in lines if line["kind"] == "meta"]
    runs = {line["phase"]: line for line in lines if line["kind"] == "run"}
    assert set(runs) == {"saturation", "alone", "with-batch"}
    for name in ("alone", "with-batch"):
        assert runs[name]["requests"] > 0 and runs[name]["failed"] == 0, runs[name]
        assert runs[name]["total_output_tok_s"] > 0
    assert meta["batch"]["status"] == "completed" and meta["batch"]["exactly_once"] is True
    assert meta["batch"]["completed"] == 24 and meta["batch"]["lines_per_s"] > 0
    targets = [line for line in lines if line["kind"] == "target"]
    assert len(targets) == 3 and targets[-1]["met"] is True
