"""The overlap timeline lays the serving model's steps over the preparation's stretches."""

from __future__ import annotations

import pytest

from bench.overlap_timeline import (
    OUTSIDE,
    KindRow,
    Step,
    covering,
    format_table,
    percentile,
    split_by_kind,
    tok_s_over_time,
    whole,
)
from worker.engine.capture_pacer import REST, Interval


def test_the_window_is_covered_with_its_gaps_outside_the_timeline():
    timeline = [Interval(1.0, 2.0, "capture"), Interval(2.0, 5.0, REST), Interval(6.0, 9.0, "capture")]
    assert covering(timeline, 0.0, 7.0) == [
        Interval(0.0, 1.0, OUTSIDE),
        Interval(1.0, 2.0, "capture"),
        Interval(2.0, 5.0, REST),
        Interval(5.0, 6.0, OUTSIDE),
        Interval(6.0, 7.0, "capture"),
    ]


def test_a_step_across_two_stretches_shares_its_tokens_by_overlap():
    timeline = [Interval(0.0, 1.0, "capture"), Interval(1.0, 4.0, REST)]
    steps = [Step(0.5, 1.5, 10), Step(1.5, 2.0, 10)]  # the first half in each, the second in the rest
    rows = {row.kind: row for row in split_by_kind(steps, timeline, 0.0, 4.0)}
    assert rows["capture"].tokens == pytest.approx(5.0)
    assert rows[REST].tokens == pytest.approx(15.0)
    assert rows["capture"].tok_s == pytest.approx(5.0)
    assert rows[REST].tok_s == pytest.approx(5.0)


def test_a_step_time_goes_to_the_stretch_of_its_midpoint():
    timeline = [Interval(0.0, 1.0, "capture"), Interval(1.0, 4.0, REST)]
    steps = [Step(0.2, 1.4, 1), Step(1.4, 1.5, 1)]  # midpoints 0.8 and 1.45
    rows = {row.kind: row for row in split_by_kind(steps, timeline, 0.0, 4.0)}
    assert (rows["capture"].steps, rows["capture"].step_p50_ms) == (1, pytest.approx(1200.0))
    assert (rows[REST].steps, rows[REST].step_p50_ms) == (1, pytest.approx(100.0))


def test_the_kinds_add_up_to_the_window_and_its_tokens():
    timeline = [Interval(0.1, 0.3, "warm-up"), Interval(0.3, 0.9, REST), Interval(0.9, 1.1, "capture")]
    steps = [Step(0.01 * i, 0.01 * (i + 1), 32) for i in range(120)]
    rows = split_by_kind(steps, timeline, 0.0, 1.2)
    assert [row.kind for row in rows] == [OUTSIDE, "warm-up", REST, "capture"]
    assert sum(row.seconds for row in rows) == pytest.approx(1.2)
    assert sum(row.tokens for row in rows) == pytest.approx(120 * 32)
    assert sum(row.steps for row in rows) == 120


def test_a_kind_no_step_falls_in_has_no_step_times():
    rows = split_by_kind([Step(0.0, 1.0, 4)], [Interval(0.4, 0.45, "gc.collect")], 0.0, 1.0)
    gc_row = next(row for row in rows if row.kind == "gc.collect")
    assert gc_row.steps == 0
    assert gc_row.step_p50_ms is None
    assert gc_row.tokens == pytest.approx(0.2)


def test_percentiles_are_nearest_rank():
    values = list(range(1, 101))
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile([7.0], 99) == 7.0


def test_whole_spans_its_steps():
    row = whole([Step(1.0, 1.5, 32), Step(1.5, 3.0, 32)], "alone")
    assert row.seconds == pytest.approx(2.0)
    assert row.tok_s == pytest.approx(32.0)
    assert row.step_p99_ms == pytest.approx(1500.0)


def test_the_table_gives_each_kind_against_the_model_alone():
    alone = KindRow("alone", 1.0, 100.0, 10, 1.0, 2.0)
    rows = [KindRow(REST, 3.0, 240.0, 30, 1.2, 3.0), KindRow("capture", 1.0, 30.0, 5, 4.0, 9.0)]
    lines = format_table(rows, alone).splitlines()
    assert lines[2].startswith("| alone | 1.00 | – | 100 | 1.00 |")
    assert lines[3] == "| rest | 3.00 | 75.0% | 80 | 0.80 | 30 | 1.20 | 3.00 |"
    assert lines[4] == "| capture | 1.00 | 25.0% | 30 | 0.30 | 5 | 4.00 | 9.00 |"
    assert lines[5] == "| whole preparation | 4.00 | 100.0% | 68 | 0.68 | 35 | – | – |"


def test_tok_s_over_time_shares_a_step_between_the_slices_it_spans():
    steps = [Step(0.0, 1.0, 10), Step(1.0, 3.0, 10), Step(3.0, 4.0, 0)]
    assert tok_s_over_time(steps, 0.0, 4.0, 2) == pytest.approx([7.5, 2.5])
