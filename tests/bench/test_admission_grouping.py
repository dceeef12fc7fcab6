"""bench/admission_grouping on the CPU, a few steps of a small closed loop: an engine built as a worker
builds it serves Zipf adapter traffic with grouping off and on, and the figures add up."""

from __future__ import annotations

import json
from pathlib import Path

from bench.admission_grouping import GROUPS, main


def test_a_small_closed_loop_runs_with_grouping_off_and_on(tmp_path: Path):
    out = tmp_path / "grouping.jsonl"
    args = ["--clients", "16", "--overtakes", "0", "4", "--warmup-steps", "8", "--steps", "24"]
    assert main([*args, "--workdir", str(tmp_path / "work"), "--out", str(out)]) == 0

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(row["clients"], row["overtakes"]) for row in rows] == [(16, 0), (16, 4)]
    for row in rows:
        assert row["steps"] == 24 and 0 < row["seqs_per_step"] <= 16
        assert 0 < row["adapters_per_step"] <= row["seqs_per_step"]
        groups = row["groups"]
        assert set(groups) == {*GROUPS, "all"}
        assert sum(groups[name]["requests"] for name in GROUPS) == groups["all"]["requests"] > 0
