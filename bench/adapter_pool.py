"""The adapter pool on a CUDA GPU, Llama-3-8B shapes (random bf16 weights built in memory).

    python -m bench.adapter_pool [--requests 512] [--concurrency 32 64] [--backlogs 0 32]
                                 [--adapter-host-cache-gb G] [--cycles 10000] [--out FILE]
    python -m bench.adapter_pool --device cpu --model small [--layers 16]   # part 2 alone, on a CPU

1. Load latency of one adapter, rank 16 and 64 on all seven projections (PEFT files written here):
   pinned host -> GPU pages (SlotWriter: one H2D copy, device scatters, event) beside the floor
   nbytes / measured pinned H2D bandwidth, and the engine-thread (host) time of a write, once the
   pages' views are built and on the pages' first write of that rank; and disk -> GPU with
   the file's page cache dropped (read + piece digest + validation + packing on the host, then the same
   upload) beside the disk floor: a plain sequential read of the same file, cache dropped
   (bench/disk_floor.py). Reads land in blocks of a page-locked host arena, as the pool's do.
2. 1,000 registered adapters (rank 16; each its own identity, files shared by groups of them), Zipf(1.0)
   over adapters, a GPU pool of 32 max-rank (64) adapters' memory = 128 pages of 16 ranks, so 128
   rank-16 adapters; closed loop through LLMEngine of --concurrency running requests (max_num_seqs)
   plus a backlog of requests the engine holds beyond them (--backlogs; a loaded worker hands the
   engine every job it has read, and the pool prefetches their adapters; 0: a request arrives only
   when one finishes, so nothing can be prefetched): GPU and host hit rates per request, time a
   request waits for its adapter (add -> READY) p50/p99, all and cold (not READY when added), TTFT
   p50 of requests whose adapter was READY when added and of the others (the issue's "a cold
   adapter's first request waits <= 50 ms more"), the mean time of one disk read on its loader
   thread (beside part 1's disk -> GPU of one adapter alone: how much the engine running beside
   slows a read), the most loads the pool had under way at once and the time torch's host allocator
   spent page-locking new memory in the pass (~0: the host tier is one arena page-locked when the
   pool starts; that one-time cost is the "arena s" column, waited for before the pass, as a worker's
   start-up overlaps it), and output tok/s beside the same request stream
   with every adapter resident (adapter i mapped onto preloaded adapter i mod 128: the same batch
   shapes, no loads).
   The pool runs the stream twice through one engine: "pool cold" starts from an empty host tier (in
   512 requests ~45% name an adapter not seen before, so it measures compulsory first reads from
   disk); "pool steady" runs it again right after, host tier warm (if --adapter-host-cache-gb holds
   the working set; a worker's default holds ~250 rank-16 8B adapters) and GPU pages as the cold
   pass left them: the pool's serving, what the 0.9x-of-all-resident target is about.
   On a CPU (--device cpu, --model small: Llama-3-8B's widths cut down, --layers of them) only this
   part runs: it measures the pool's scheduling and loader threads against an engine thread that
   holds the GIL, not a GPU's pages or copies.
3. --cycles load/evict cycles through the pool (small model, two max-rank adapters' pages, a new
   identity per cycle, ranks 8/16/24 so adapters of one and two pages take each other's pages):
   device memory allocated/reserved, host RSS and pinned host memory before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.disk_floor import drop_page_cache, read_floor
from bench.random_adapters import load_adapters
from bench.random_adapters import write_adapter as write_bench_adapter
from bench.random_engine import LLAMA3_8B, prompts, random_engine, random_model, random_runner, word_tokenizer
from shared.adapter_digest import HASH_THREADS
from shared.adapter_format import WEIGHTS_FILE
from shared.config import EngineConfig
from shared.model_info import ModelInfo
from shared.schema import AdapterRef, SamplingParams
from worker.adapter_pool.host_adapter import HostAdapter, max_adapter_bytes, read_host_adapter
from worker.adapter_pool.host_arena import Carving, HostArena
from worker.adapter_pool.slot_writer import SlotWriter
from worker.engine.engine import LLMEngine
from worker.engine.engine_request import EngineRequest
from worker.engine.model_runner import ModelRunner
from worker.metrics import WorkerMetrics
from worker.model.model import CausalLM

MAX_LORAS = 32  # the GPU pool's memory, in adapters of MAX_RANK: 128 pages of 16 ranks
MAX_RANK = 64
SMALL = dataclasses.replace(LLAMA3_8B, name="small", hidden_size=1024, intermediate_size=2816, num_layers=2,
                            num_heads=8, num_kv_heads=2, vocab_size=32000)  # fmt: skip


def write_adapter(directory: Path, info: ModelInfo, rank: int, seed: int) -> str:
    """A PEFT adapter of `rank` on every projection (bf16); returns its digest."""
    return write_bench_adapter(directory, info, rank, seed).digest


def pinned_h2d_bandwidth() -> float:
    """Pinned host -> device bytes/s (median of 20 copies of 256 MiB)."""
    host = torch.empty(1 << 27, dtype=torch.int16, pin_memory=True).random_()
    device = torch.empty_like(host, device="cuda")
    times = []
    for _ in range(22):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return host.numel() * host.element_size() / statistics.median(times[2:])


def read(ref: AdapterRef, model: CausalLM, root: Path, hasher: Executor, arena: HostArena) -> HostAdapter:
    """Disk -> a block of the page-locked `arena`, as the pool's loader threads do it (pieces hashed on
    `hasher`, its threads). Give the block back with arena.free(adapter.buffer)."""
    carving = Carving(arena)
    adapter = read_host_adapter(ref, adapter_root=root, info=model.info, dtype=model.dtype, max_rank=MAX_RANK,
                                max_bytes=2 << 30, take=carving.take, hasher=hasher)  # fmt: skip
    carving.keep(adapter.buffer)
    return adapter


@dataclass
class LatencyRow:
    rank: int
    mbytes: float
    floor_ms: float
    pinned_ms: float
    pinned_host_ms: float  # host time inside SlotWriter.write (launches)
    first_host_ms: float  # the same for the pages' first write of this rank: their views are built then
    disk_ms: float
    disk_read_ms: float  # read + hash + validate + pack, on the host
    disk_floor_ms: float  # a plain sequential read of the same file, its page cache dropped (bench/disk_floor.py)
    cache_drop: str


def load_latency(model: CausalLM, root: Path, bandwidth: float) -> list[LatencyRow]:
    writer = SlotWriter(model)
    hasher = ThreadPoolExecutor(HASH_THREADS)
    largest = max_adapter_bytes(model.info, max_rank=MAX_RANK, dtype=model.dtype)
    arena = HostArena(2 * largest, largest, page_locked=True)  # the adapter kept, and each fresh read
    rows = []
    for rank in (16, 64):
        directory = root / f"latency-r{rank}"
        sha = write_adapter(directory, model.info, rank, seed=rank)
        ref = AdapterRef(f"latency-r{rank}", 1, directory.name, sha)

        adapter = read(ref, model, root, hasher, arena)
        size = model.pages_for_rank(rank)
        stretches = model.num_pages // size
        pages = [tuple(range(first, first + size)) for first in range(0, stretches * size, size)]
        pinned, host = [], []
        for i in range(stretches + 20):  # the first write into each page builds its views: timed apart
            torch.cuda.synchronize()
            start = time.perf_counter()
            upload = writer.write(pages[i % stretches], adapter)
            launched = time.perf_counter()
            upload.wait()
            pinned.append(time.perf_counter() - start)
            host.append(launched - start)
        disk, reads = [], []
        for i in range(5):
            how = drop_page_cache([directory / WEIGHTS_FILE])
            torch.cuda.synchronize()
            start = time.perf_counter()
            fresh = read(ref, model, root, hasher, arena)
            reads.append(time.perf_counter() - start)
            writer.write(pages[i % stretches], fresh).wait()
            disk.append(time.perf_counter() - start)
            arena.free(fresh.buffer)
        weights = directory / WEIGHTS_FILE
        floor_s = statistics.median(weights.stat().st_size / read_floor([weights]) for _ in range(5))
        rows.append(LatencyRow(rank, adapter.nbytes / 1e6, adapter.nbytes / bandwidth * 1e3,
                               statistics.median(pinned[stretches:]) * 1e3,
                               statistics.median(host[stretches:]) * 1e3, statistics.median(host[:stretches]) * 1e3,
                               statistics.median(disk) * 1e3, statistics.median(reads) * 1e3, floor_s * 1e3,
                               how))  # fmt: skip
        print(rows[-1], flush=True)
        arena.free(adapter.buffer)
    hasher.shutdown()
    arena.close()
    return rows


@dataclass
class ZipfRow:
    mode: str  # all-resident, pool cold (host tier empty at the start), pool steady (the same stream again)
    concurrency: int
    backlog: int  # requests held by the engine beyond the running ones
    requests: int
    host_cache_gb: float  # the pool's host tier budget (GiB)
    tok_s: float
    gpu_hit_rate: float  # requests whose adapter had GPU pages (READY or loading) when added
    host_hit_rate: float  # GPU misses (of adapters not already on their way up) found on the host tier
    wait_p50_ms: float
    wait_p99_ms: float
    cold_wait_p50_ms: float  # requests whose adapter was not READY when added
    cold_wait_p99_ms: float
    warm_ttft_p50_ms: float  # requests whose adapter was READY when added
    cold_ttft_p50_ms: float  # the others
    disk_loads: int
    disk_load_ms_mean: float  # one disk -> host read on a loader thread, timed there: beside the latency part's
    loads_in_flight_max: int  # reads and copies the pool had under way at once (sampled each step)
    pinned_alloc_ms: float  # in CUDA's page-locked allocations of torch's host allocator (a lock other calls wait on)
    arena_s: float  # the pool's host arena allocated and page-locked, once, when it started (before every pass)
    gpu_evictions: int
    host_evictions: int


def pinned_alloc_ms(device: str) -> float:
    """Milliseconds torch's caching host allocator has spent in CUDA allocations so far (0 on a CPU)."""
    if torch.device(device).type != "cuda":
        return 0.0
    return torch.cuda.host_memory_stats().get("host_alloc_time.total", 0) / 1e3


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class ZipfEngine:
    """One LLMEngine on `runner` (its KV cache and graphs reused) that request streams are run through,
    one pass after another: a pass starts with the pool's tiers as the previous one left them."""

    def __init__(self, runner: ModelRunner, root: Path, refs: list[AdapterRef], args: argparse.Namespace,
                 *, all_resident: bool) -> None:  # fmt: skip
        info = runner.model.info
        self.metrics = WorkerMetrics(device=runner.config.device)
        tokenizer = word_tokenizer(info.vocab_size)
        self.engine = LLMEngine(runner, tokenizer, runner.config, root, self.metrics.engine(info.name))
        self.refs, self.args, self.all_resident = refs, args, all_resident
        self.token_ids = prompts(64, args.prompt, info.vocab_size)
        self.passes = 0
        self.engine.adapter_pool.arena.buffer  # noqa: B018 - allocated before any pass: a worker's start overlaps it
        # all resident: as many adapters as the pages hold (rank 16: one page each), brought up through
        # the pool before any pass, so no load happens in one
        self.resident = runner.model.num_pages
        if all_resident:
            load_adapters(self.engine, refs[: self.resident])

    def counters(self) -> dict[str, float]:
        """The pool's cumulative counters, as "{tier}_{count}" (a pass reports their differences)."""
        registry, model = self.metrics.registry, self.engine.runner.model.info.name
        counts = {"hits": "hits_total", "misses": "misses_total", "evictions": "evictions_total",
                  "loads": "load_seconds_count", "load_seconds": "load_seconds_sum"}  # fmt: skip
        sample = registry.get_sample_value
        return {
            f"{tier}_{count}": sample(f"lorafleet_worker_adapter_{name}", {"model": model, "tier": tier}) or 0.0
            for count, name in counts.items()
            for tier in ("gpu", "cpu", "disk")
        }

    def run(self, order: list[int], mode: str, backlog: int) -> ZipfRow:
        """One closed-loop pass of `order` (adapter indices) with max_num_seqs + `backlog` requests in flight."""
        engine, concurrency = self.engine, self.engine.config.max_num_seqs
        params = SamplingParams(max_tokens=self.args.new_tokens, temperature=0.0, ignore_eos=True)
        prefix = f"p{self.passes}-"
        self.passes += 1
        waits: dict[str, float] = {}  # job → seconds from add to its adapter READY
        cold_jobs: list[str] = []  # whose adapter was not READY when added
        added_ms: dict[str, float] = {}  # job → unix ms it was added
        ttft_ms: dict[str, float] = {}
        waiting: dict[str, tuple[float, str]] = {}  # job → (time added, adapter uid), until its adapter is READY
        next_request, done, tokens, in_flight_max = 0, 0, 0, 0

        def add_one() -> None:
            nonlocal next_request
            index = order[next_request]
            ref = self.refs[index % self.resident] if self.all_resident else self.refs[index]
            job = f"{prefix}{next_request}"
            ready = engine.adapter_slots.slot_of(ref.uid) is not None
            request = EngineRequest(job, self.token_ids[next_request % 64], params, tenant=job, adapter=ref)
            added_ms[job] = time.time() * 1000
            engine.add(request)
            if ready:
                waits[job] = 0.0
            else:
                cold_jobs.append(job)
                waiting[job] = (time.perf_counter(), ref.uid)
            next_request += 1

        before = self.counters()
        pinned_before = pinned_alloc_ms(engine.config.device)
        synchronize(engine.config.device)
        start = time.perf_counter()
        while next_request < min(concurrency + backlog, len(order)):
            add_one()
        while done < len(order):
            results = engine.step()
            if engine.adapter_pool is not None:
                in_flight_max = max(in_flight_max, engine.adapter_pool.loads_in_flight)
            now = time.perf_counter()
            for job, (at, uid) in list(waiting.items()):
                if engine.adapter_slots.slot_of(uid) is not None:
                    waits[job] = now - at
                    del waiting[job]
            for result in results:
                done += 1
                tokens += result.completion_tokens
                ttft_ms[result.job_id] = result.first_token_ms - added_ms[result.job_id]
                if next_request < len(order):
                    add_one()
        wall = time.perf_counter() - start
        assert tokens == len(order) * self.args.new_tokens, "a request did not run to max_tokens"
        after = self.counters()
        count = {key: after[key] - before[key] for key in after}
        every = [w * 1e3 for w in waits.values()]
        cold = [waits[job] * 1e3 for job in cold_jobs]
        cold_ttft = [ttft_ms[job] for job in cold_jobs]
        warm_ttft = [ttft_ms[job] for job in ttft_ms.keys() - set(cold_jobs)]
        gpu_lookups = count["gpu_hits"] + count["gpu_misses"]
        host_lookups = count["cpu_hits"] + count["cpu_misses"]
        return ZipfRow(mode, concurrency, backlog, len(order), engine.adapter_pool.host.budget_bytes / (1 << 30),
                       tokens / wall, count["gpu_hits"] / max(gpu_lookups, 1), count["cpu_hits"] / max(host_lookups, 1),
                       percentile(every, 0.5), percentile(every, 0.99), percentile(cold, 0.5), percentile(cold, 0.99),
                       percentile(warm_ttft, 0.5), percentile(cold_ttft, 0.5),
                       int(count["disk_loads"]), count["disk_load_seconds"] * 1e3 / max(count["disk_loads"], 1),
                       in_flight_max, pinned_alloc_ms(engine.config.device) - pinned_before,
                       engine.adapter_pool.arena.setup_seconds,
                       int(count["gpu_evictions"]), int(count["cpu_evictions"]))  # fmt: skip

    def close(self) -> None:
        """Close the pool and let the engine go, its host arena with it (each engine has one)."""
        self.engine.adapter_pool.close()
        del self.engine
        gc.collect()


def zipf_bench(info: ModelInfo, root: Path, args: argparse.Namespace) -> list[ZipfRow]:
    """Per concurrency and backlog: the all-resident run, then the pool's cold pass and its steady pass
    (the same stream again through the same engine, host tier warm, GPU pages as the cold pass left
    them)."""
    distinct = [(f"zipf-files-{i}", write_adapter(root / f"zipf-files-{i}", info, 16, seed=100 + i))
                for i in range(args.files)]  # fmt: skip
    refs = [AdapterRef(f"tenant-{i}", 1, *distinct[i % len(distinct)]) for i in range(args.adapters)]
    rng = random.Random(0)
    order = rng.choices(range(args.adapters), weights=[1 / (k + 1) for k in range(args.adapters)], k=args.requests)
    rows = []
    context = args.prompt + args.new_tokens
    for concurrency in args.concurrency:
        config = EngineConfig(device=args.device, dtype="bfloat16", max_num_seqs=concurrency,
                              max_num_batched_tokens=8192, num_kv_blocks=concurrency * -(-context // 16) + 64,
                              block_size=16, max_loras=MAX_LORAS, max_lora_rank=MAX_RANK,
                              adapter_host_cache_gb=args.adapter_host_cache_gb,
                              adapter_eviction=args.adapter_eviction)  # fmt: skip
        runner = random_runner(info, config)  # decode graphs captured once per batch size
        warm_up = ZipfEngine(runner, root, refs, args, all_resident=True)
        warm_up.run(order[: 2 * concurrency], "warm-up", 0)  # Triton JIT
        warm_up.close()
        for backlog in args.backlogs:
            resident = ZipfEngine(runner, root, refs, args, all_resident=True)
            rows.append(resident.run(order, "all-resident", backlog))
            resident.close()
            print(rows[-1], flush=True)
            pool = ZipfEngine(runner, root, refs, args, all_resident=False)
            for mode in ("pool cold", "pool steady"):
                rows.append(pool.run(order, mode, backlog))
                print(rows[-1], flush=True)
            pool.close()
        del runner, warm_up, resident, pool
        gc.collect()  # the runner's KV cache and decode graphs, the pool's pinned host tier
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def host_memory() -> tuple[int, int]:
    """(resident set bytes, pinned host bytes held by torch's caching host allocator)."""
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    # the caching host allocator's bytes held (name differs across torch versions); -1: not reported
    held = next((v for k, v in stats.items() if "bytes" in k and k.endswith(".current") and "reserved" in k), -1)
    return rss, int(held)


def churn(root: Path, cycles: int) -> dict[str, float]:
    info = SMALL
    config = EngineConfig(device="cuda", max_loras=2, max_lora_rank=MAX_RANK, num_kv_blocks=16)
    engine = random_engine(info, config, root)
    pool = engine.adapter_pool  # driven here without engine steps
    # ranks 8, 16, 24 in turn: pages are reused by adapters of one and two pages
    sources = [(f"churn-{i}", write_adapter(root / f"churn-{i}", info, 8 * (i + 1), seed=i)) for i in range(3)]

    def cycle(index: int) -> None:
        ref = AdapterRef(f"churn-{index}", 1, *sources[index % 3])
        pool.request(ref)
        while pool.gpu.slot_of(ref.uid) is None:
            assert pool.poll() == []
            pool.wait(1.0)
        pool.drop(ref.uid)

    for index in range(200):
        cycle(index)
    gc.collect()
    torch.cuda.synchronize()
    before = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), *host_memory())
    start = time.perf_counter()
    for index in range(200, 200 + cycles):
        cycle(index)
    seconds = time.perf_counter() - start
    gc.collect()
    torch.cuda.synchronize()
    after = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), *host_memory())
    pool.close()
    names = ("gpu_allocated", "gpu_reserved", "host_rss", "host_pinned")
    result = {f"{n}_mb_before": b / 1e6 for n, b in zip(names, before, strict=True)}
    result |= {f"{n}_mb_after": a / 1e6 for n, a in zip(names, after, strict=True)}
    return {"cycles": cycles, "ms_per_cycle": seconds / cycles * 1e3, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--files", type=int, default=8, help="distinct adapter files behind the identities")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 64], help="requests running (max_num_seqs)")
    parser.add_argument("--backlogs", type=int, nargs="+", default=[0, 32],
                        help="requests the engine holds beyond the running ones, each a run of its own")  # fmt: skip
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--adapter-host-cache-gb", type=float, default=None,
                        help="the Zipf runs' host tier (default: a worker's, 2 GPU pools' worth of bytes)")  # fmt: skip
    parser.add_argument("--adapter-eviction", choices=("lru", "lfu"), default="lru", help="the Zipf runs' policy")
    parser.add_argument("--cycles", type=int, default=10_000)
    parser.add_argument("--skip", nargs="*", default=[], choices=["latency", "zipf", "churn"])
    parser.add_argument("--out", help="write every row as JSON lines here")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the Zipf part alone")
    parser.add_argument("--model", choices=("8b", "small"), default="8b", help="the Zipf part's model shapes")
    parser.add_argument("--layers", type=int, default=SMALL.num_layers, help="--model small's layers")
    args = parser.parse_args()
    if args.device == "cpu":
        args.skip = ["latency", "churn"]  # they measure GPU pages, copies and device memory
    zipf_model = LLAMA3_8B if args.model == "8b" else dataclasses.replace(SMALL, num_layers=args.layers)
    root = Path(tempfile.mkdtemp(prefix="adapter-pool-bench-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None))
    out = open(args.out, "w") if args.out else None  # noqa: SIM115 - kept open for the whole run
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    bandwidth = pinned_h2d_bandwidth() if args.device == "cuda" else 0.0
    print(f"device {device}  pinned H2D {bandwidth / 1e9:.1f} GB/s  eviction {args.adapter_eviction}", flush=True)
    latency: list[LatencyRow] = []
    zipf: list[ZipfRow] = []
    memory: dict[str, float] = {}
    if "latency" not in args.skip:
        model = random_model(LLAMA3_8B, EngineConfig(device="cuda", max_loras=MAX_LORAS, max_lora_rank=MAX_RANK))
        latency = load_latency(model, root, bandwidth)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if "zipf" not in args.skip:
        zipf = zipf_bench(zipf_model, root, args)
    if "churn" not in args.skip:
        memory = churn(root, args.cycles)
        print(memory, flush=True)
    for row in [*latency, *zipf]:
        if out:
            out.write(json.dumps({"kind": type(row).__name__, **row.__dict__}) + "\n")
    if out:
        out.write(json.dumps({"kind": "churn", **memory}) + "\n")
        out.close()
    print(f"\npinned H2D bandwidth {bandwidth / 1e9:.1f} GB/s ({device})")
    print("rank  MB     floor ms  pinned->GPU ms (x floor)  host launch ms  (first into pages)  disk->GPU ms  "
          "of which read ms  disk floor ms  (x floor)  cache")  # fmt: skip
    for r in latency:
        ratio = r.pinned_ms / r.floor_ms
        print(f"{r.rank:<5} {r.mbytes:<6.0f} {r.floor_ms:<9.2f} {r.pinned_ms:<6.2f} ({ratio:.2f}x){'':<11} "
              f"{r.pinned_host_ms:<15.2f} {r.first_host_ms:<20.2f} {r.disk_ms:<13.1f} {r.disk_read_ms:<17.1f} "
              f"{r.disk_floor_ms:<14.1f} ({r.disk_ms / r.disk_floor_ms:.2f}x)  {r.cache_drop}")  # fmt: skip
    print("mode          conc  backlog  req   host GB  tok/s    x resident  gpu hit  host hit  wait p50/p99 ms  "
          "cold wait p50/p99 ms  TTFT p50 warm/cold ms  disk loads  load ms  in flight  "
          "pin alloc ms  arena s  gpu evict  host evict")  # fmt: skip
    resident_tok_s = {(z.concurrency, z.backlog): z.tok_s for z in zipf if z.mode == "all-resident"}
    for z in zipf:
        pooled = z.mode != "all-resident"
        host_gb, host_hit = (f"{z.host_cache_gb:.1f}", f"{z.host_hit_rate:.3f}") if pooled else ("-", "-")
        print(f"{z.mode:<13} {z.concurrency:<5} {z.backlog:<8} {z.requests:<5} {host_gb:<8} {z.tok_s:<8.0f} "
              f"{z.tok_s / resident_tok_s[(z.concurrency, z.backlog)]:<11.3f} {z.gpu_hit_rate:<8.3f} {host_hit:<9} "
              f"{z.wait_p50_ms:.1f}/{z.wait_p99_ms:<10.1f} {z.cold_wait_p50_ms:.1f}/{z.cold_wait_p99_ms:<16.1f} "
              f"{z.warm_ttft_p50_ms:.1f}/{z.cold_ttft_p50_ms:<17.1f} "
              f"{z.disk_loads:<11} {z.disk_load_ms_mean:<8.1f} {z.loads_in_flight_max:<10} {z.pinned_alloc_ms:<13.0f} "
              f"{z.arena_s:<8.2f} {z.gpu_evictions:<10} {z.host_evictions}")  # fmt: skip
    if memory:
        print(json.dumps(memory))


if __name__ == "__main__":
    main()
