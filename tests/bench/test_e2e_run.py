"""bench/e2e end to end on the CPU with the tiny preset: Redis, a gateway and a CPU worker as real
processes, calibration, six open-loop runs and the engine-alone replay (heated first); then the
results agree with what the worker itself counted, and every run kept its once-a-second readings."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from bench.e2e.__main__ import main
from bench.e2e.presets import PRESETS

pytestmark = pytest.mark.slow

PRESET = PRESETS["tiny"]


def test_the_tiny_preset_runs_every_phase_and_its_numbers_add_up(tmp_path: Path):
    out = tmp_path / "out"
    argv = ["--preset", "tiny", "--out", str(out), "--workdir", str(tmp_path / "work"), "--budget-s", "150"]
    assert main([*argv, "--heat-alone"]) == 0

    lines = [json.loads(line) for line in (out / "e2e.jsonl").read_text().splitlines()]
    assert lines[0]["engine_heat_s"] >= 2 * PRESET.calibration_s  # the engine kept busy before its replay
    runs = [line for line in lines if line["kind"] == "run"]
    assert [(r["phase"], r["mode"]) for r in runs] == [
        ("calibration", "zipf"), ("calibration", "base"),
        *[("load", mode) for _ in range(3) for mode in ("base", "zipf")],
        ("engine-alone", "base"),
    ]  # fmt: skip
    # a closed loop keeps max_num_seqs jobs in the streams, adapter jobs on the worker's routed stream
    assert all(r["peak_queue"] > 0 for r in runs if r["phase"] == "calibration"), runs
    loads = [r for r in runs if r["phase"] == "load"]
    assert [r["offered_rps"] for r in loads] == sorted(r["offered_rps"] for r in loads)
    for run in loads:
        assert run["requests"] > 0 and run["failed"] == 0, run
        # the worker's own token counter over the run equals what the client received
        assert run["worker"]["generated_tokens"] == run["requests"] * PRESET.output_tokens
        assert run["ttft_p50_ms"] <= run["latency_p50_ms"]
        assert run["queue_p50_ms"] >= 0 and run["submit_p50_ms"] > 0
        if run["mode"] == "zipf":
            assert run["distinct_adapters"] > 1 and run["worker"]["adapter_loads"] >= 0
            assert 0 < run["worker"]["adapter_gpu_hit_pct"] <= 100
            assert 0 < run["worker"]["batch_adapters"] <= min(PRESET.num_adapters, run["worker"]["batch_seqs"])
        else:
            assert run["distinct_adapters"] == 0 and run["worker"]["adapter_loads"] == 0
            assert run["worker"]["batch_adapters"] == 0
    alone = runs[-1]
    assert alone["requests"] == loads[0]["requests"] and alone["failed"] == 0  # the lowest base load, replayed
    # the replay's steps, counted as the stack's worker counts its own
    assert alone["worker"]["generated_tokens"] == alone["requests"] * PRESET.output_tokens
    assert alone["worker"]["steps"] > 0 and alone["worker"]["step_ms"] > 0
    assert [line["met"] is not None for line in lines if line["kind"] == "target"] == [True] * 4
    # every run's once-a-second readings, the replay's too, on the run's own clock (a CPU has no clocks to read)
    probes = [line for line in lines if line["kind"] == "probe"]
    assert {(p["phase"], p["mode"], p["offered_rps"]) for p in probes} == {
        (r["phase"], r["mode"], r["offered_rps"]) for r in runs
    }
    replayed = [p["t_s"] for p in probes if p["phase"] == "engine-alone"]
    assert abs(replayed[0]) < 1.0 and replayed[-1] <= alone["duration_s"] + 2.0  # the first read as it starts
    assert all(run["clocks"] is None for run in runs)

    with (out / "e2e_requests.csv").open() as f:
        requests = list(csv.DictReader(f))
    assert len(requests) == sum(r["requests"] for r in runs)
    succeeded = [r for r in requests if r["status"] == "succeeded"]
    assert all(int(r["completion_tokens"]) == PRESET.output_tokens for r in succeeded)
    for name in ("e2e_load.png", "e2e_timeline.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
