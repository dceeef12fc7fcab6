"""bench.engine's command line and its LoRA-off comparison (the engine rows themselves need a GPU):
the base-only rows of the LoRA-enabled engine over those of an engine started without LoRA, against
issue 20's target of 2%."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.engine import build_parser, parse_args
from bench.engine_measure import EngineBench
from bench.engine_report import LORAFLEET, NO_LORA, Row, kernel_split_table, lora_off_ratios
from bench.random_engine import LLAMA3_8B
from bench.roofline import weight_bytes
from bench.tensor_parallel import LLAMA_70B, rank_roofline, rank_weight_bytes


def row(system: str, batch: int, adapters: int, tok_s: float, decode: float, ttft_ms: float) -> Row:
    return Row(system, batch, 128, 16, adapters, tok_s, ttft_ms, 1.0, decode, 10_000.0)


def test_help_runs_as_a_module_and_tells_of_the_lora_off_rows():
    done = subprocess.run([sys.executable, "-m", "bench.engine", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m bench.engine") and "--max-loras 0" in done.stdout


def test_the_grid_flags_parse_into_their_lists():
    args = parse_args(["--batches", "8", "32", "--prompts", "128", "--adapters", "0", "8"])
    assert (args.batches, args.prompts, args.adapters, args.new_tokens) == ([8, 32], [128], [0, 8], 128)
    assert parse_args([]).adapters == [0, 8, 32]  # 0 by default: the LoRA-off rows run


def test_the_tensor_parallel_rows_take_their_own_grid_unless_given_one():
    args = parse_args(["--tensor-parallel", "2"])
    assert (args.batches, args.prompts, args.adapters) == ([1, 32, 64], [128], [0, 8])
    assert parse_args(["--tensor-parallel", "2", "--batches", "8"]).batches == [8]


def test_a_malformed_flag_exits_2():
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--batches", "many"])
    assert exited.value.code == 2


def test_base_rows_of_the_lora_engine_are_compared_with_the_engine_without_lora_at_the_same_shape():
    rows = [
        row(LORAFLEET, 8, 0, tok_s=990.0, decode=1980.0, ttft_ms=11.0),
        row(LORAFLEET, 8, 8, tok_s=900.0, decode=1800.0, ttft_ms=20.0),  # adapters: not compared
        row(LORAFLEET, 32, 0, tok_s=950.0, decode=2000.0, ttft_ms=10.0),
        row(LORAFLEET, 64, 0, tok_s=950.0, decode=2000.0, ttft_ms=10.0),  # no LoRA-off row at this shape
        row(NO_LORA, 8, 0, tok_s=1000.0, decode=2000.0, ttft_ms=10.0),
        row(NO_LORA, 32, 0, tok_s=1000.0, decode=2000.0, ttft_ms=10.0),
    ]

    small, large = lora_off_ratios(rows)

    assert (small.batch, small.tok_s, small.decode_tok_s, small.ttft) == (8, 0.99, 0.99, 1.1)
    assert small.met  # within 2%
    assert (large.batch, large.tok_s, large.decode_tok_s) == (32, 0.95, 1.0)
    assert not large.met  # 5% slower end to end, though its decode steps keep up


def test_an_engine_without_lora_takes_no_adapters(tmp_path: Path):
    with pytest.raises(ValueError, match="without LoRA takes no adapters"):
        EngineBench(LLAMA3_8B, 8, 8, 256, tmp_path, lora=False)


def test_a_ranks_roofline_reads_its_share_of_the_weights():
    assert rank_weight_bytes(LLAMA3_8B, 1) == weight_bytes(LLAMA3_8B)
    assert 0.49 < rank_weight_bytes(LLAMA3_8B, 2) / weight_bytes(LLAMA3_8B) < 0.51
    assert 69e9 < rank_weight_bytes(LLAMA_70B, 2) < 70e9  # bf16, half of 70B parameters
    assert rank_roofline(LLAMA3_8B, 2, 1, 192, 3e12) > 1.9 * rank_roofline(LLAMA3_8B, 1, 1, 192, 3e12)


def test_the_kernel_split_gives_each_kind_its_column_and_lora_its_share_of_the_rest():
    split = {"wall": 20.0, "gpu": 24.0, "gemm": 12.0, "lora shrink": 1.0, "lora expand": 2.0, "lora metadata": 1.0,
             "attention": 8.0}  # fmt: skip
    table = kernel_split_table(96, [(0, 0, {"wall": 10.0, "gpu": 9.0, "gemm": 9.0}), (256, 40, split)])
    header, separator, decode, mixed = table.splitlines()[1:]
    assert header.count("|") == separator.count("|") == decode.count("|") == mixed.count("|")
    cells = [c.strip() for c in mixed.strip("|").split("|")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert cells[columns.index("lora expand ms")] == "2.000"
    assert cells[columns.index("other ms")] == "0.000"
    assert cells[-1] == "20.0%"  # 4 ms of LoRA kernels over the other 20
    assert decode.strip("| ").endswith("0.0%")
