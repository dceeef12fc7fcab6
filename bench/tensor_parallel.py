"""Tensor-parallel decode on one host's GPUs (issue 26), run by `python -m bench.engine --tensor-parallel N`.

Llama-3-8B shapes at TP 1 and N, then a 70B shape (hidden 8192, 80 layers, 64/8 heads, intermediate
28672) at TP N, bf16 random weights; engine rows as bench.engine's (all requests added at once,
greedy, stepped to completion), by default batches 1 32 64, prompt 128, 0 and 8 rank-16 adapters
spread over the batch. Rank 0 is this process (the engine, its scheduler and adapter pool); ranks
1 … N-1 are spawned as a worker spawns them (worker/tensor_parallel.py), each with random weights of
its share, and run the steps rank 0 sends. A shape that does not fit (the memory plan's error) is
reported and skipped: the 70B shape needs two 141 GB GPUs in bf16.

Each row's roofline is one rank's: the bytes one rank reads per decode step (its share of every
projection and of the lm_head, and of the K/V at the mean decode context) over the measured
device-to-device copy bandwidth. The all-reduces' time is not in it, so dec/roof says what they and
everything else cost.

Targets: 8B decode at TP N >= 1.6x TP 1 at batch 1 (no adapters); LoRA overhead (1 - decode with 8
adapters / without) at TP N within 5 points of TP 1's, per batch; the 70B shape with 8 adapters
>= 70% of its roofline.

Before each shape's engine, the LoRA plans of one rank's projection shapes are tuned for the decode
buckets where no table has them (within TUNE_BUDGET_S, into the adapter directory's kernel-plans/),
as a worker tunes at start: TP N's shapes (halved widths) are not in the packaged tables. Once the
ranks have joined, every batch's decode all-reduces are timed alone (`collective_ms`: the step's
2 per layer + the embedding's, replayed from one graph), which says how much of TPOT minus the
roofline the collectives take.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
from pathlib import Path

import torch

from bench.engine_measure import EngineBench
from bench.engine_report import Row
from bench.random_adapters import adapter_dir
from bench.random_engine import LLAMA3_8B, engine_config, random_runner
from bench.roofline import copy_bandwidth
from shared.config import EngineConfig, ModelSpec, WorkerConfig
from shared.model_info import ModelInfo
from worker.engine.cuda_graphs import capture, capture_session
from worker.kernel_plans import ensure_tuned
from worker.memory_plan import MemoryPlanError
from worker.model.parallel.group import TensorParallel
from worker.model.parallel.sharding import shard_info
from worker.tensor_parallel import Followers, leave_group, start_follower

LLAMA_70B = dataclasses.replace(
    LLAMA3_8B,
    name="llama-70b-shape",
    hidden_size=8192,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    intermediate_size=28672,
)
SPEEDUP_TARGET = 1.6  # 8B decode at TP N over TP 1, batch 1
LORA_OVERHEAD_POINTS = 5.0  # TP N's LoRA overhead may exceed TP 1's by this many percentage points
ROOFLINE_TARGET = 0.70  # the 70B shape with 8 adapters
TUNE_BUDGET_S = 60.0  # per model shape: the decode buckets' LoRA plans (bench.tune_lora took 141 s for 8 buckets)


def rank_weight_bytes(info: ModelInfo, size: int) -> int:
    """Bytes one of `size` ranks reads per decode step: its share of every layer's projections, the
    layer norms, and its share of the lm_head (embedding rows are few); bf16."""
    local = shard_info(info, size) if size > 1 else info
    h, q = info.hidden_size, local.num_heads * local.head_dim
    kv, i = local.num_kv_heads * local.head_dim, local.intermediate_size
    projections = h * (q + 2 * kv) + q * h + 3 * h * i
    vocab = -(-info.vocab_size // size)
    return info.num_layers * 2 * (projections + 2 * h) + 2 * (vocab * h + h)


def rank_roofline(info: ModelInfo, size: int, batch: int, context: float, bandwidth: float) -> float:
    """Output tok/s if a decode step only moved one rank's weights and K/V at `bandwidth` bytes/s."""
    kv_heads = max(1, info.num_kv_heads // size)
    kv = 2 * 2 * info.num_layers * kv_heads * info.head_dim * context * batch
    return batch / ((rank_weight_bytes(info, size) + kv) / bandwidth)


def follow_random(
    info: ModelInfo, batches: tuple[int, ...], rank: int, size: int, port: int, config: WorkerConfig
) -> None:
    """A benchmark follower: its part of rank 0's `collective_ms` probes, random weights of its share
    of `info` (no checkpoint of this size is written), then rank 0's steps, as a worker's follower runs them."""
    config, channel = start_follower(rank, size, port, config)
    try:
        for batch in batches:
            collective_ms(channel.tp, info, batch)
        random_runner(info, config.engine, channel).follow(config.adapter_root)
    finally:
        leave_group(channel)


def collective_ms(tp: TensorParallel, info: ModelInfo, batch: int, replays: int = 20) -> float:
    """The device ms a decode step of `batch` sequences spends in its all-reduces alone: one per
    row-parallel projection (2 a layer) and the embedding's, of bf16 [batch, hidden], replayed from
    one CUDA graph as the decode graphs run them (every rank calls it, in the same order)."""
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.zeros(batch, info.hidden_size, dtype=torch.bfloat16, device=device)
    tp.all_reduce(x)  # eager first: the communicator's first use is never inside a capture

    def all_reduces() -> None:
        for _ in range(2 * info.num_layers + 1):
            tp.all_reduce(x)

    with capture_session(device):  # as the decode graphs are captured (thread-local: NCCL's watchdog polls)
        graph = capture(all_reduces, torch.cuda.graph_pool_handle())
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    graph.reset()  # before the group is ever left: NCCL waits for every graph holding its collectives
    return start.elapsed_time(end) / replays


def measure(
    info: ModelInfo, size: int, args: argparse.Namespace, root: Path, bandwidth: float, rows: list[Row]
) -> None:
    """Rows of `info` at `size` ranks (1: one process), appended to `rows` as they are measured."""
    system = f"{info.name} tp{size}"
    max_seqs, max_context, max_adapters = max(args.batches), max(args.prompts) + args.new_tokens, max(args.adapters)
    config = engine_config(info, max_adapters, max_seqs, max_context, tensor_parallel=size)
    plans = root / "kernel-plans"
    tune_decode_plans(shard_info(info, size) if size > 1 else info, config, plans)
    followers = None
    if size > 1:
        worker = WorkerConfig(
            redis_url="redis://unused",
            models=(ModelSpec(info.name, root),),
            adapter_root=root,
            engine=config,
            kernel_plans_dir=plans,  # the followers look plans up where rank 0 tuned them
        )
        followers = Followers(worker, functools.partial(follow_random, info, tuple(args.batches)))
        followers.watch(lambda exc: print(f"{system}: {exc}; the benchmark ends", flush=True))
        for batch in args.batches:  # what the all-reduces alone cost a step: TPOT minus roofline, explained
            ms = collective_ms(followers.channel.tp, info, batch)
            print(f"{system} batch {batch}: the step's {2 * info.num_layers + 1} all-reduces alone, "
                  f"in one graph: {ms:.2f} ms", flush=True)  # fmt: skip
    finished = False  # the followers are told to stop only between steps (after a failed step they are killed)
    try:
        measure_rows(info, size, args, root, bandwidth, rows, followers)
        finished = True
    finally:
        if followers is not None:
            followers.stop(tell=finished)
        gc.collect()
        torch.cuda.empty_cache()


def tune_decode_plans(local: ModelInfo, config: EngineConfig, plans: Path) -> None:
    """Tune into `plans` (within TUNE_BUDGET_S) the LoRA plans of `local`'s projection shapes, one
    rank's, at the decode steps' token buckets, where neither the packaged table nor `plans` has
    them; this process's lookups search `plans` from now on. A worker tunes its ranks' shapes at
    start (worker/service.py); without this, the bench's TP N ran every LoRA projection on the
    untuned default plan while TP 1 ran the packaged table's (issue #26's first run: 8 adapters
    cost 1.13 ms a step at TP 2, batch 1, against 0.51 ms at TP 1)."""
    decode = dataclasses.replace(config, max_num_batched_tokens=config.max_num_seqs)  # the buckets the rows time
    try:
        run = ensure_tuned(local, decode, plans, TUNE_BUDGET_S)
    except Exception as exc:  # as a worker does: measure on the tables and defaults rather than not at all
        print(f"{local.name}: the LoRA plan tune failed ({type(exc).__name__}: {exc}); default plans", flush=True)
        run = None
    if run is not None:
        tuned = [result.num_tokens for result in run.results]
        print(f"{local.name} LoRA plans tuned for its rank's shapes: buckets {tuned}, not reached "
              f"{list(run.not_reached)}, {run.elapsed_s:.0f} s", flush=True)  # fmt: skip
    torch.cuda.empty_cache()


def measure_rows(
    info: ModelInfo,
    size: int,
    args: argparse.Namespace,
    root: Path,
    bandwidth: float,
    rows: list[Row],
    followers: Followers | None,
) -> None:
    """measure's rows, on rank 0 of `followers` (None: one process)."""
    system = f"{info.name} tp{size}"
    max_seqs, max_context, max_adapters = max(args.batches), max(args.prompts) + args.new_tokens, max(args.adapters)
    try:
        bench = EngineBench(info, max_adapters, max_seqs, max_context, root, followers=followers)
    except MemoryPlanError as exc:
        print(f"{system}: does not fit: {exc}", flush=True)
        return
    print(f"{system} engine ready in {bench.setup_s:.1f} s", flush=True)
    for prompt in args.prompts:  # every shape once untimed: compiles and first-use stalls stay out of the rows
        for batch in args.batches:
            bench.run(batch, prompt, 2, max_adapters)
    for prompt in args.prompts:
        for batch in args.batches:
            for adapters in args.adapters:
                wall, ttft, tpot = bench.run(batch, prompt, args.new_tokens, adapters)
                roof = rank_roofline(info, size, batch, prompt + args.new_tokens / 2, bandwidth)
                row = Row(system, batch, prompt, args.new_tokens, adapters, batch * args.new_tokens / wall,
                          ttft * 1e3, tpot * 1e3, batch / tpot, roof)  # fmt: skip
                rows.append(row)
                print(f"{system} batch {batch} prompt {prompt} adapters {adapters}: decode {row.decode_tok_s:.0f} "
                      f"tok/s ({row.decode_tok_s / roof:.2f} of roofline)", flush=True)  # fmt: skip


def run(args: argparse.Namespace) -> None:
    size = args.tensor_parallel
    if torch.cuda.device_count() < size:
        raise SystemExit(f"--tensor-parallel {size} needs {size} GPUs; {torch.cuda.device_count()} are visible")
    root = adapter_dir(args.adapter_dir)
    bandwidth = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()} x{size}  copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows: list[Row] = []
    for info, ranks in ((LLAMA3_8B, 1), (LLAMA3_8B, size)):
        measure(info, ranks, args, root, bandwidth, rows)
    print_table(rows)  # before the 70B shape, whose load may end the run where it does not fit every rank
    print_targets(rows, size)
    big: list[Row] = []
    measure(LLAMA_70B, size, args, root, bandwidth, big)
    if big:
        print_table(big)
        print_targets(big, size)


def print_table(rows: list[Row]) -> None:
    print(f"\n{'system':<24}{'batch':>6}{'prompt':>7}{'adapt':>6}{'TTFT ms':>9}{'TPOT ms':>9}"
          f"{'decode tok/s':>13}{'roofline':>10}{'dec/roof':>9}")  # fmt: skip
    for r in rows:
        print(f"{r.system:<24}{r.batch:>6}{r.prompt:>7}{r.adapters:>6}{r.ttft_ms:>9.1f}{r.tpot_ms:>9.2f}"
              f"{r.decode_tok_s:>13.0f}{r.roofline_tok_s:>10.0f}{r.decode_tok_s / r.roofline_tok_s:>9.2f}")  # fmt: skip


def print_targets(rows: list[Row], size: int) -> None:
    """Each target's measured figure beside its bound, for the rows this run has."""
    decode = {(r.system, r.batch, r.prompt, r.adapters): r.decode_tok_s for r in rows}
    one, many, big = f"{LLAMA3_8B.name} tp1", f"{LLAMA3_8B.name} tp{size}", f"{LLAMA_70B.name} tp{size}"
    print("\ntargets")
    for system, batch, prompt, adapters in sorted(decode):
        if system != many:
            continue
        single = decode.get((one, batch, prompt, adapters))
        if batch == 1 and adapters == 0 and single:
            speedup = decode[system, batch, prompt, adapters] / single
            print(f"  8B batch 1 prompt {prompt}: TP {size} {speedup:.2f}x TP 1 (>= {SPEEDUP_TARGET})")
        base_one, base_many = decode.get((one, batch, prompt, 0)), decode.get((many, batch, prompt, 0))
        if adapters == 8 and single and base_one and base_many:
            over_one = 100 * (1 - single / base_one)
            over_many = 100 * (1 - decode[system, batch, prompt, adapters] / base_many)
            print(f"  8B batch {batch} prompt {prompt}: LoRA overhead TP {size} {over_many:.1f}% vs TP 1 "
                  f"{over_one:.1f}% ({over_many - over_one:+.1f} points, <= +{LORA_OVERHEAD_POINTS})")  # fmt: skip
    for r in rows:
        if r.system == big and r.adapters == 8:
            share = r.decode_tok_s / r.roofline_tok_s
            label = f"70B batch {r.batch} prompt {r.prompt} 8 adapters"
            print(f"  {label}: {share:.2f} of its roofline (>= {ROOFLINE_TARGET})")
