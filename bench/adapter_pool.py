"""The adapter pool on a CUDA GPU, Llama-3-8B shapes (random bf16 weights built in memory).

    python -m bench.adapter_pool [--requests 768] [--concurrency 64] [--cycles 10000] [--out FILE]

1. Load latency of one adapter, rank 16 and 64 on all seven projections (PEFT files written here):
   pinned host -> GPU slot (SlotWriter: one H2D copy, device scatters, event) beside the floor
   nbytes / measured pinned H2D bandwidth; and disk -> GPU slot with the file's page cache dropped
   (read + sha256 + validation + packing on the host, then the same upload).
2. 1,000 registered adapters (rank 16; each its own identity, files shared by groups of them), Zipf(1.0)
   over adapters, 32 GPU slots, closed loop of --concurrency requests through LLMEngine: GPU hit rate
   per request, time a request waits for its adapter (add -> its slot READY) p50/p99, cold (GPU miss)
   and warm, and output tok/s beside the same request stream with every adapter resident (adapter i
   mapped onto preloaded slot i mod 32: the same batch shapes, no loads).
3. --cycles load/evict cycles through the pool (small model, two slots, a new identity per cycle):
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from bench.engine import LLAMA3_8B, prompts
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, file_sha256
from shared.config import EngineConfig
from shared.model_info import PROJECTIONS, ModelInfo
from shared.schema import AdapterRef, SamplingParams
from worker.adapter_pool.host_adapter import HostAdapter, read_host_adapter
from worker.adapter_pool.pool import AdapterPool
from worker.adapter_pool.slot_writer import SlotWriter
from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.model import CausalLM
from worker.engine.model_runner import ModelRunner
from worker.engine.peft_adapter import peft_key
from worker.metrics import EngineMetrics, WorkerMetrics

SLOTS = 32
MAX_RANK = 64
SMALL = dataclasses.replace(LLAMA3_8B, name="small", hidden_size=1024, intermediate_size=2816, num_layers=2,
                            num_heads=8, num_kv_heads=2, vocab_size=32000)  # fmt: skip


def random_model(info: ModelInfo, slots: int) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(info, max_loras=slots, max_lora_rank=MAX_RANK, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    return model


def write_adapter(directory: Path, info: ModelInfo, rank: int, seed: int) -> str:
    """A PEFT adapter of `rank` on every projection (bf16); returns its sha256."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(info.num_layers):
        for projection in PROJECTIONS:
            fan_in, fan_out = info.projection_shape(projection)
            tensors[peft_key(layer, projection, "A")] = (torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5).to(
                torch.bfloat16
            )
            tensors[peft_key(layer, projection, "B")] = (torch.randn(fan_out, rank, generator=gen) * 0.01).to(
                torch.bfloat16
            )
    save_file(tensors, str(directory / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)}
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    return file_sha256(directory / WEIGHTS_FILE)


def drop_page_cache(path: Path) -> str:
    """Evict `path` from the page cache; returns how."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "fadvise"


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


def read(ref: AdapterRef, model: CausalLM, root: Path) -> HostAdapter:
    """Disk -> pinned host, as the pool's loader threads do it (hashing on a second thread)."""
    with ThreadPoolExecutor(1) as hasher:
        return read_host_adapter(ref, adapter_root=root, info=model.info, dtype=model.dtype, max_rank=MAX_RANK,
                                 max_bytes=2 << 30, pin=True, hasher=hasher)  # fmt: skip


@dataclass
class LatencyRow:
    rank: int
    mbytes: float
    floor_ms: float
    pinned_ms: float
    pinned_host_ms: float  # host time inside SlotWriter.write (launches)
    disk_ms: float
    disk_read_ms: float  # read + hash + validate + pack, on the host
    cache_drop: str


def load_latency(model: CausalLM, root: Path, bandwidth: float) -> list[LatencyRow]:
    writer = SlotWriter(model)
    rows = []
    for rank in (16, 64):
        directory = root / f"latency-r{rank}"
        sha = write_adapter(directory, model.info, rank, seed=rank)
        ref = AdapterRef(f"latency-r{rank}", 1, directory.name, sha)

        adapter = read(ref, model, root)
        pinned, host = [], []
        for i in range(22):
            torch.cuda.synchronize()
            start = time.perf_counter()
            upload = writer.write(i % SLOTS, adapter)
            launched = time.perf_counter()
            upload.wait()
            pinned.append(time.perf_counter() - start)
            host.append(launched - start)
        disk, reads = [], []
        for i in range(5):
            how = drop_page_cache(directory / WEIGHTS_FILE)
            torch.cuda.synchronize()
            start = time.perf_counter()
            fresh = read(ref, model, root)
            reads.append(time.perf_counter() - start)
            writer.write(i % SLOTS, fresh).wait()
            disk.append(time.perf_counter() - start)
        rows.append(LatencyRow(rank, adapter.nbytes / 1e6, adapter.nbytes / bandwidth * 1e3,
                               statistics.median(pinned[2:]) * 1e3, statistics.median(host[2:]) * 1e3,
                               statistics.median(disk) * 1e3, statistics.median(reads) * 1e3, how))  # fmt: skip
        print(rows[-1], flush=True)
    return rows


@dataclass
class ZipfRow:
    mode: str
    concurrency: int
    requests: int
    tok_s: float
    gpu_hit_rate: float
    wait_p50_ms: float
    wait_p99_ms: float
    cold_wait_p50_ms: float
    cold_wait_p99_ms: float
    disk_loads: int
    gpu_evictions: int


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def zipf_run(runner: ModelRunner, root: Path, refs: list[AdapterRef], order: list[int], args: argparse.Namespace,
             *, all_resident: bool) -> ZipfRow:  # fmt: skip
    """One closed-loop run of `order` through a fresh engine on `runner` (its KV cache and graphs reused)."""
    model, config, info = runner.model, runner.config, runner.model.info
    concurrency = config.max_num_seqs
    metrics = WorkerMetrics(device="cuda")
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(info.vocab_size)}, unk_token="w0"))
    engine = LLMEngine(runner, tokenizer, config, root, metrics.engine(info.name))
    if all_resident:  # write refs[i]'s weights into slot i and mark it READY: no load ever happens
        writer = SlotWriter(model)
        copies = {ref.path: read(ref, model, root) for ref in refs[:SLOTS]}
        for slot in range(SLOTS):
            writer.write(slot, copies[refs[slot].path]).wait()
            engine.adapter_slots.reserve(refs[slot].uid, evictable=lambda _: False)
            engine.adapter_slots.mark_ready(refs[slot].uid)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    token_ids = prompts(64, args.prompt, info.vocab_size)
    added: dict[str, tuple[float, str, bool]] = {}  # job → (time added, adapter uid, resident at add)
    waits: dict[str, float] = {}
    next_request, done, tokens = 0, 0, 0

    def add_one() -> None:
        nonlocal next_request
        index = order[next_request]
        ref = refs[index % SLOTS] if all_resident else refs[index]
        job = f"r{next_request}"
        resident = engine.adapter_slots.slot_of(ref.uid) is not None
        engine.add(EngineRequest(job, token_ids[next_request % 64], params, tenant=job, adapter=ref))
        added[job] = (time.perf_counter(), ref.uid, resident)
        if resident:
            waits[job] = 0.0
        next_request += 1

    torch.cuda.synchronize()
    start = time.perf_counter()
    while next_request < min(concurrency, len(order)):
        add_one()
    while done < len(order):
        results = engine.step()
        now = time.perf_counter()
        for job, (at, uid, _) in added.items():
            if job not in waits and engine.adapter_slots.slot_of(uid) is not None:
                waits[job] = now - at
        for result in results:
            done += 1
            tokens += result.completion_tokens
            if next_request < len(order):
                add_one()
    wall = time.perf_counter() - start
    assert tokens == len(order) * args.new_tokens, "a request did not run to max_tokens"
    cold = [waits[job] * 1e3 for job, (_, _, resident) in added.items() if not resident]
    every = [w * 1e3 for w in waits.values()]

    def sample(name: str, tier: str) -> float:
        return metrics.registry.get_sample_value(name, {"model": info.name, "tier": tier}) or 0.0

    hits = sample("lorafleet_worker_adapter_hits_total", "gpu")
    misses = sample("lorafleet_worker_adapter_misses_total", "gpu")
    engine.adapter_pool.close()
    mode = "all-resident" if all_resident else "pool"
    return ZipfRow(mode, concurrency, len(order), tokens / wall, hits / max(hits + misses, 1),
                   percentile(every, 0.5), percentile(every, 0.99), percentile(cold, 0.5), percentile(cold, 0.99),
                   int(sample("lorafleet_worker_adapter_load_seconds_count", "disk")),
                   int(sample("lorafleet_worker_adapter_evictions_total", "gpu")))  # fmt: skip


def zipf_bench(model: CausalLM, root: Path, args: argparse.Namespace) -> list[ZipfRow]:
    distinct = [(f"zipf-files-{i}", write_adapter(root / f"zipf-files-{i}", model.info, 16, seed=100 + i))
                for i in range(args.files)]  # fmt: skip
    refs = [AdapterRef(f"tenant-{i}", 1, *distinct[i % len(distinct)]) for i in range(args.adapters)]
    rng = random.Random(0)
    order = rng.choices(range(args.adapters), weights=[1 / (k + 1) for k in range(args.adapters)], k=args.requests)
    rows = []
    context = args.prompt + args.new_tokens
    for concurrency in args.concurrency:
        config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=concurrency, max_num_batched_tokens=8192,
                              num_kv_blocks=concurrency * -(-context // 16) + 64, block_size=16, max_loras=SLOTS,
                              max_lora_rank=MAX_RANK)  # fmt: skip
        runner = ModelRunner.from_model(model, config)  # decode graphs captured once per batch size
        zipf_run(runner, root, refs, order[: 2 * concurrency], args, all_resident=True)  # warm-up: Triton JIT
        for all_resident in (True, False):
            rows.append(zipf_run(runner, root, refs, order, args, all_resident=all_resident))
            print(rows[-1], flush=True)
        del runner
        gc.collect()  # the runner's KV cache and decode graphs
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
    model = random_model(info, 2)
    config = EngineConfig(device="cuda", max_loras=2, max_lora_rank=MAX_RANK)
    pool = AdapterPool(model, config, root, EngineMetrics.unregistered("churn").adapters)
    # ranks 8, 16, 24 in turn: slots are reused by lower and higher ranks
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
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 64], help="requests kept in flight")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--cycles", type=int, default=10_000)
    parser.add_argument("--skip", nargs="*", default=[], choices=["latency", "zipf", "churn"])
    parser.add_argument("--out", help="write every row as JSON lines here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="adapter-pool-bench-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None))
    out = open(args.out, "w") if args.out else None  # noqa: SIM115 - kept open for the whole run
    bandwidth = pinned_h2d_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  pinned H2D {bandwidth / 1e9:.1f} GB/s", flush=True)
    latency: list[LatencyRow] = []
    zipf: list[ZipfRow] = []
    memory: dict[str, float] = {}
    if "latency" not in args.skip or "zipf" not in args.skip:
        model = random_model(LLAMA3_8B, SLOTS)
        if "latency" not in args.skip:
            latency = load_latency(model, root, bandwidth)
        if "zipf" not in args.skip:
            zipf = zipf_bench(model, root, args)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if "churn" not in args.skip:
        memory = churn(root, args.cycles)
        print(memory, flush=True)
    for row in [*latency, *zipf]:
        if out:
            out.write(json.dumps({"kind": type(row).__name__, **row.__dict__}) + "\n")
    if out:
        out.write(json.dumps({"kind": "churn", **memory}) + "\n")
        out.close()
    print(f"\npinned H2D bandwidth {bandwidth / 1e9:.1f} GB/s ({torch.cuda.get_device_name()})")
    print("rank  MB     floor ms  pinned->GPU ms (x floor)  host launch ms  disk->GPU ms  of which read ms  cache")
    for r in latency:
        ratio = r.pinned_ms / r.floor_ms
        print(f"{r.rank:<5} {r.mbytes:<6.0f} {r.floor_ms:<9.2f} {r.pinned_ms:<6.2f} ({ratio:.2f}x){'':<11} "
              f"{r.pinned_host_ms:<15.2f} {r.disk_ms:<13.1f} {r.disk_read_ms:<17.1f} {r.cache_drop}")  # fmt: skip
    print("mode          conc  req   tok/s    gpu hit  wait p50/p99 ms  cold wait p50/p99 ms  disk loads  gpu evict")
    for z in zipf:
        print(f"{z.mode:<13} {z.concurrency:<5} {z.requests:<5} {z.tok_s:<8.0f} {z.gpu_hit_rate:<8.3f} "
              f"{z.wait_p50_ms:.1f}/{z.wait_p99_ms:<10.1f} {z.cold_wait_p50_ms:.1f}/{z.cold_wait_p99_ms:<16.1f} "
              f"{z.disk_loads:<11} {z.gpu_evictions}")  # fmt: skip
    for resident, pooled in zip(zipf[::2], zipf[1::2], strict=True):
        print(f"concurrency {pooled.concurrency}: pool / all-resident throughput {pooled.tok_s / resident.tok_s:.3f}")
    if memory:
        print(json.dumps(memory))


if __name__ == "__main__":
    main()
