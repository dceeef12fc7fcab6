"""Model switching and GPU sharing on one GPU, with bf16 random-weight Llama-shaped models.

    python -m bench.model_switch --part switch [--shapes 1b 8b 14b] [--cold 1b 8b] [--dir DIR] [--switch-interval-ms 5]
    python -m bench.model_switch --part share  [--pair 1b 8b] [--seconds 20] [--mps]
    python -m bench.model_switch --serve 8b --seconds 20 --memory-fraction 0.45   (one co-located process)

--part switch, per model shape, beside the floors measured in the same run:
    cold      stream_to_model: the shards read (O_DIRECT, parallel) into reused page-locked staging, the
              copies to the device overlapping the reads (the worker's cold load without a host cache)
    cold → host  read_to_host (into kept page-locked buffers, the host cache's copy) + copy to the device
              floor of both: the checkpoint's bytes over a plain sequential read of the same files
              (bench/disk_floor.py; page cache dropped before every read)
    warm      copy_to_model from the pinned host copy on a side stream; floor: bytes over the pinned
              host-to-device bandwidth of a 1 GiB copy
    overlap   a 1B-shaped model keeps decoding (batch 32) while the model is prepared beside it as
              ModelResidency.prepare does (paced weight copy, then its KV cache carved from the serving
              model's KV storage and its decode graphs captured); the pause is the hand-over (evict the
              serving engine, activate the new one) until the new model's first step is launched; the
              time that step (a 32 x 128-token prefill) then takes is printed beside it
    during    decode tok/s of the serving model while the side-stream copy runs, vs before it
    timeline  the serving model's tok/s and step times during each kind of the preparation's work
              (copy, KV carve, warm-up passes, piece and decode captures, the pacer's rests, ...),
              beside the serving model alone over a whole batch (bench/overlap_timeline.py)
The cold and warm rows run the code the worker runs (worker/switching/loader.py); the overlap row takes
the steps ModelResidency takes (prepare on a loader thread, evict, activate) beside a serving LLMEngine.

--part share: two base models (--pair) on one GPU, each fed batches of 32 requests (prompt 128,
128 new tokens, greedy, ignore_eos):
    dedicated       each model alone in one process (what one GPU per model gives)
    time-sliced     one process, one model resident at a time, a warm switch after each batch
    co-located      two processes at once (--memory-fraction each), without MPS (the driver
                    time-slices their contexts), and with --mps under a running MPS daemon
                    (deploy/mps/start.sh) with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 each
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, astuple, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, models

from bench.disk_floor import drop_page_cache, read_floor
from bench.overlap_timeline import Step, format_table, percentile, split_by_kind, tok_s_over_time, whole
from shared.config import EngineConfig
from shared.model_info import ModelInfo
from shared.schema import SamplingParams
from worker.engine.capture_pacer import CapturePacer
from worker.engine.engine import LLMEngine
from worker.engine.engine_request import EngineRequest
from worker.engine.model_runner import ModelRunner
from worker.memory_plan import kv_storage_bytes, model_footprint
from worker.metrics import WorkerMetrics
from worker.model.model import CausalLM
from worker.model.weights import INDEX_FILE, checkpoint_files
from worker.switching.checkpoint_cache import HostWeights
from worker.switching.loader import copy_to_model, new_model, read_to_host, stream_to_model
from worker.switching.shard_reader import PageLock, StagingRing


def llama(name: str, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tied: bool) -> ModelInfo:
    return ModelInfo(
        name=name,
        architecture="LlamaForCausalLM",
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hidden // heads,
        vocab_size=vocab,
        max_context=4096,
        rope_theta=500000.0,
        rope_scaling=None,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=(2,),
        torch_dtype="bfloat16",
    )


SHAPES = {
    "tiny": llama("tiny", 256, 688, 2, 4, 2, 1024, True),  # a CPU smoke run of this script
    "1b": llama("1b", 2048, 8192, 16, 32, 8, 128256, True),  # Llama-3.2-1B
    "8b": llama("8b", 4096, 14336, 32, 32, 8, 128256, False),  # Llama-3-8B
    "14b": llama("14b", 5120, 13824, 48, 40, 8, 152064, False),  # Qwen2.5-14B's sizes, Llama layout
}
BATCH, PROMPT, NEW_TOKENS = 32, 128, 128
_BLOCK_ELEMENTS = 1 << 27  # 256 MiB of random bf16 values that every tensor's bytes are cut from
_SHARD_BYTES = 5_000_000_000  # transformers' default max_shard_size


def tensor_shapes(info: ModelInfo) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name → shape, as an HF Llama checkpoint names them."""
    h, kv = info.hidden_size, info.num_kv_heads * info.head_dim
    shapes = {"model.embed_tokens.weight": (info.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(info.num_layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (h, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, h),
            f"{p}.mlp.gate_proj.weight": (info.intermediate_size, h),
            f"{p}.mlp.up_proj.weight": (info.intermediate_size, h),
            f"{p}.mlp.down_proj.weight": (h, info.intermediate_size),
        }
    if not info.tie_word_embeddings:
        shapes["lm_head.weight"] = (info.vocab_size, h)
    return shapes


def random_block(device: str) -> torch.Tensor:
    """bf16 N(0, 0.02) values on the host (finite logits whatever slice a tensor gets)."""
    return (torch.randn(_BLOCK_ELEMENTS, device=device, dtype=torch.bfloat16) * 0.02).cpu()


def _layout(info: ModelInfo, shard_bytes: int | None = None) -> list[tuple[dict, int]]:
    """(safetensors header, data bytes) per shard of at most `shard_bytes` (None: one file)."""
    shards: list[tuple[dict, int]] = [({}, 0)]
    for name, shape in tensor_shapes(info).items():
        nbytes = 2 * int(torch.Size(shape).numel())
        header, offset = shards[-1]
        if shard_bytes is not None and offset and offset + nbytes > shard_bytes:
            shards.append(({}, 0))
            header, offset = shards[-1]
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        shards[-1] = (header, offset + nbytes)
    return shards


def _fill(buffer: memoryview, block: bytes) -> None:
    for start in range(0, len(buffer), len(block)):
        end = min(start + len(block), len(buffer))
        buffer[start:end] = block[: end - start]


def write_model(info: ModelInfo, directory: Path, block: torch.Tensor) -> Path:
    """An HF-format checkpoint (config.json, tokenizer.json, one model.safetensors) on disk, synced."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [info.architecture],
        "hidden_size": info.hidden_size,
        "intermediate_size": info.intermediate_size,
        "num_hidden_layers": info.num_layers,
        "num_attention_heads": info.num_heads,
        "num_key_value_heads": info.num_kv_heads,
        "vocab_size": info.vocab_size,
        "max_position_embeddings": info.max_context,
        "rope_theta": info.rope_theta,
        "rms_norm_eps": info.rms_norm_eps,
        "tie_word_embeddings": info.tie_word_embeddings,
        "bos_token_id": info.bos_token_id,
        "eos_token_id": list(info.eos_token_ids),
        "torch_dtype": "bfloat16",
    }
    (directory / "config.json").write_text(json.dumps(config))
    word_level = Tokenizer(models.WordLevel({f"w{i}": i for i in range(info.vocab_size)}, unk_token="w0"))
    word_level.save(str(directory / "tokenizer.json"))
    shards = _layout(info, _SHARD_BYTES)
    chunk = block.view(torch.int16).numpy().tobytes()
    weight_map = {}
    for index, (header, data_bytes) in enumerate(shards, start=1):
        shard = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        weight_map |= dict.fromkeys(header, shard)
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)  # the data section 8-byte aligned, as safetensors writers do
        with (directory / shard).open("wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for start in range(0, data_bytes, len(chunk)):
                f.write(memoryview(chunk)[: min(len(chunk), data_bytes - start)])
            f.flush()
            os.fsync(f.fileno())
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def host_weights(info: ModelInfo, block: torch.Tensor) -> HostWeights:
    """The checkpoint built in pinned host memory, as the warm tier holds it (no file needed)."""
    [(header, data_bytes)] = _layout(info)
    buffer = torch.empty(data_bytes, dtype=torch.uint8)
    _fill(memoryview(buffer.numpy()), block.view(torch.int16).numpy().tobytes())
    lock = (PageLock(buffer),) if torch.cuda.is_available() else ()
    tensors = {
        name: buffer[e["data_offsets"][0] : e["data_offsets"][1]].view(torch.bfloat16).reshape(e["shape"])
        for name, e in header.items()
    }
    return HostWeights(info.name, tensors, data_bytes, pinned=bool(lock), keepalive=lock)


def h2d_floor() -> float:
    """Pinned host → device bytes/s, median of 10 copies of 1 GiB."""
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(12):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return src.numel() / sorted(times[2:])[5]


def engine_config(context: int = PROMPT + NEW_TOKENS) -> EngineConfig:
    """A batch of BATCH sequences of up to `context` tokens fits the KV cache."""
    return EngineConfig(
        device=device(),
        dtype="bfloat16",
        max_num_seqs=BATCH,
        max_num_batched_tokens=8192,
        num_kv_blocks=BATCH * -(-context // 16),
        max_loras=1,
        max_lora_rank=16,
    )


def word_tokenizer() -> Tokenizer:
    return Tokenizer(models.WordLevel({"w0": 0}, unk_token="w0"))


def new_runner(
    model: CausalLM, config: EngineConfig, kv_storage: torch.Tensor | None = None, pacer: CapturePacer | None = None
) -> ModelRunner:
    """The runner of `model` with config.num_kv_blocks blocks, carved from `kv_storage` (a resident
    slot's, shared by the models that take turns in it) or from storage of its own; its captures
    paced by `pacer` (beside a serving model, as ModelResidency.prepare does)."""
    if kv_storage is None:
        nbytes = kv_storage_bytes(model_footprint(model.info, config), config.num_kv_blocks, config)
        kv_storage = torch.zeros(nbytes, dtype=torch.uint8, device=config.device)
    return ModelRunner(model, config, kv_storage, config.num_kv_blocks, pacer=pacer)


def new_engine(model: CausalLM, config: EngineConfig, kv_storage: torch.Tensor | None = None) -> LLMEngine:
    return LLMEngine(
        new_runner(model, config, kv_storage),
        word_tokenizer(),
        config,
        Path(),
        WorkerMetrics(config.device).engine(model.info.name),
    )


def add_batch(engine: LLMEngine, tag: str, new_tokens: int = NEW_TOKENS) -> None:
    gen = torch.Generator().manual_seed(len(tag))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(BATCH):
        tokens = tuple(torch.randint(3, engine.info.vocab_size, (PROMPT,), generator=gen).tolist())
        engine.add(EngineRequest(job_id=f"{tag}-{i}", prompt_token_ids=tokens, sampling=params))


def timed_step(engine: LLMEngine, steps: list[Step]) -> None:
    """One engine step, its wall interval and sampled tokens appended to `steps`."""
    start = time.perf_counter()
    engine.step()
    steps.append(Step(start, time.perf_counter(), engine.last_step.num_sampled))


def run_batch(engine: LLMEngine, tag: str) -> int:
    """Generated tokens of one batch run to completion."""
    add_batch(engine, tag)
    done = []
    while engine.num_unfinished:
        done += engine.step()
    assert all(r.completion_tokens == NEW_TOKENS for r in done), [r.error for r in done if r.error][:1]
    return sum(r.completion_tokens for r in done)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def side_stream() -> torch.cuda.Stream | None:
    return torch.cuda.Stream() if torch.cuda.is_available() else None


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- part: switch ---------------------------------------------------------------------------------


@dataclass
class SwitchRow:
    shape: str
    gb: float
    kind: str  # cold / cold → host / warm / overlap
    seconds: float
    floor_s: float  # the same bytes at the measured floor bandwidth (cold: disk; warm: pinned H2D)
    detail: str


def measure_cold(
    info: ModelInfo, directory: Path, disk_bps: float, stream: torch.cuda.Stream | None, staging: StagingRing
) -> list[SwitchRow]:
    """Disk → device both ways a worker loads a cold model, the page cache dropped before each:
    streamed through the staging ring (no host copy kept: the default), and read into kept host
    buffers then copied (where the host model cache keeps the checkpoint)."""
    files = checkpoint_files(directory)
    nbytes = sum(path.stat().st_size for path in files)
    config = engine_config()
    rows = []
    how = drop_page_cache(files)
    model = new_model(info, config)
    sync()
    start = time.perf_counter()
    stream_to_model(model, info.name, directory, staging, stream)
    seconds = time.perf_counter() - start
    detail = f"streamed through {staging.count} × {staging.nbytes / staging.count / 1e6:.0f} MB staging; {how}"
    rows.append(SwitchRow(info.name, nbytes / 1e9, "cold", seconds, nbytes / disk_bps, detail))
    del model
    free_device_memory()
    drop_page_cache(files)
    start = time.perf_counter()
    host = read_to_host(info.name, directory, pin=torch.cuda.is_available())
    read_s = time.perf_counter() - start
    model = new_model(info, config)
    copy_start = time.perf_counter()
    copy_to_model(model, host, stream)
    copy_s = time.perf_counter() - copy_start
    detail = f"read to kept host buffers {read_s:.2f} s + copy {copy_s:.2f} s; {how}"
    rows.append(SwitchRow(info.name, nbytes / 1e9, "cold → host", read_s + copy_s, nbytes / disk_bps, detail))
    del model, host
    free_device_memory()
    return rows


def measure_warm(info: ModelInfo, host: HostWeights, h2d_bps: float, stream: torch.cuda.Stream | None) -> SwitchRow:
    config = engine_config()
    model = new_model(info, config)
    sync()
    start = time.perf_counter()
    copy_to_model(model, host, stream)
    seconds = time.perf_counter() - start
    del model
    free_device_memory()
    detail = f"{len(host.tensors)} tensors, {host.nbytes / seconds / 1e9:.1f} GB/s"
    return SwitchRow(info.name, host.nbytes / 1e9, "warm", seconds, host.nbytes / h2d_bps, detail)


SERVING_TOKENS = 2048  # each of the serving model's batches: refilled as it finishes, so it has work throughout
# the CPU smoke run's: its preparation takes a fraction of a second, and the baseline decodes a whole batch
SMOKE_SERVING_TOKENS = 64


def serving_tokens(info: ModelInfo) -> int:
    """New tokens per batch of the serving model `info`."""
    return SMOKE_SERVING_TOKENS if info.name == "tiny" else SERVING_TOKENS


def kv_storage_for(*infos: ModelInfo) -> torch.Tensor:
    """One resident slot's KV storage, as ModelResidency keeps it: large enough for the serving
    model's cache (prompt + serving_tokens) and the incoming one's (engine_config()'s)."""
    needs = []
    contexts = [PROMPT + serving_tokens(infos[0])] + [PROMPT + NEW_TOKENS] * (len(infos) - 1)
    for info, context in zip(infos, contexts, strict=True):
        config = engine_config(context)
        needs.append(kv_storage_bytes(model_footprint(info, config), config.num_kv_blocks, config))
    return torch.empty(max(needs), dtype=torch.uint8, device=device())


def serving_engine(
    block: torch.Tensor, tiny: bool, stream: torch.cuda.Stream | None, kv_storage: torch.Tensor
) -> LLMEngine:
    """The model that serves while another is prepared: 1B-shaped (tiny on a CPU smoke run)."""
    info = SHAPES["tiny" if tiny else "1b"]
    config = engine_config(PROMPT + serving_tokens(info))
    engine = new_engine(new_model(info, config), config, kv_storage)
    copy_to_model(engine.runner.model, host_weights(info, block), stream)
    return engine


def measure_overlap(
    serving: LLMEngine,
    info: ModelInfo,
    host: HostWeights,
    stream: torch.cuda.Stream | None,
    kv_storage: torch.Tensor,
    timeline_out: Path | None = None,
) -> tuple[SwitchRow, LLMEngine]:
    """Prepare `info` beside `serving` while it decodes, as ModelResidency.prepare does (paced weight
    copy on a side stream, then the runner: KV cache carved from `serving`'s KV storage, decode graphs
    captured), then hand over as the switcher does (evict, activate); returns the row and the new
    engine. Takes `serving` over: it is dropped in the hand-over (the caller keeps no reference).
    `timeline_out`: where to append the raw timeline and steps as one JSON line, for slicing later."""
    config = engine_config()
    # a worker switching between models it served before has their kernels compiled (Triton JITs
    # each new shape once per process): compile them here so the pause below is the steady state
    warm = new_engine(new_model(info, config), config)
    add_batch(warm, "compile", new_tokens=2)
    while warm.num_unfinished:
        warm.step()
    del warm
    free_device_memory()
    # the serving model alone over one whole batch (its prefill, then its decode steps): the context
    # lengths the preparation's window sees, unlike the 20 steps after a prefill below
    new_tokens = serving_tokens(serving.info)
    add_batch(serving, "compile", new_tokens=2)  # a first eager prefill's shapes may compile kernels
    while serving.num_unfinished:
        serving.step()
    alone: list[Step] = []
    add_batch(serving, "alone", new_tokens=new_tokens)
    while serving.num_unfinished:
        timed_step(serving, alone)
    sync()
    batches = ["before-0"]
    add_batch(serving, batches[-1], new_tokens=new_tokens)
    for _ in range(3):  # prefill, then decode steps only
        serving.step()
    sync()
    t0, steps0 = time.perf_counter(), 20
    for _ in range(steps0):
        serving.step()
    sync()
    before_tok_s = BATCH * steps0 / (time.perf_counter() - t0)
    prepared: dict[str, object] = {}
    # as ModelResidency.prepare: the captures yield while the serving model has requests (a weak
    # reference: the hand-over below drops the serving engine, and its memory with it)
    serving_ref = weakref.ref(serving)
    pacer = CapturePacer(serving=lambda: (engine := serving_ref()) is not None and engine.num_unfinished > 0)

    def prepare() -> None:
        pacer.mark("model allocation")
        model = new_model(info, config)
        started = time.perf_counter()
        pacer.mark("weight copy")
        copy_to_model(model, host, stream)
        built = time.perf_counter()
        prepared["runner"] = new_runner(model, config, kv_storage, pacer)
        prepared["copy_s"], prepared["build_s"] = built - started, time.perf_counter() - built

    loader = threading.Thread(target=prepare)
    during: list[Step] = []
    t0 = time.perf_counter()
    loader.start()
    while loader.is_alive():
        if not serving.num_unfinished:  # a paced preparation outlasts a batch: the next one arrives
            batches.append(f"before-{len(batches)}")
            add_batch(serving, batches[-1], new_tokens=new_tokens)
        timed_step(serving, during)
    loader.join()
    sync()
    t1 = time.perf_counter()
    prepare_s = t1 - t0
    during_tok_s = BATCH * len(during) / prepare_s
    alone_row = whole(alone, f"alone, one whole batch ({new_tokens} tokens)")
    print(f"\n{info.name} prepared beside the serving model: the serving model during each stretch")
    print(format_table(split_by_kind(during, pacer.timeline, t0, t1), alone_row))
    if timeline_out is not None:
        with timeline_out.open("a") as f:
            raw = {"alone": alone, "during": during, "timeline": pacer.timeline}
            record = {name: [astuple(item) for item in items] for name, items in raw.items()}
            f.write(json.dumps({"model": info.name, "window": [t0, t1], **record}) + "\n")
    tenth = max(1, len(alone) // 10)  # the alone batch's steps in order: contexts from PROMPT up
    early, late = ([(s.end - s.start) * 1e3 for s in part] for part in (alone[1 : tenth + 1], alone[-tenth:]))
    print(
        f"alone, step p50 over the batch's first and last tenth of decode steps (context grows by "
        f"{new_tokens} tokens): {percentile(early, 50):.2f} → {percentile(late, 50):.2f} ms; "
        f"tok/s per fifth of the preparation: {', '.join(f'{x:.0f}' for x in tok_s_over_time(during, t0, t1, 5))}",
        flush=True,
    )
    for i in range(BATCH):  # a switch past its grace: the serving model's jobs are handed back
        serving.abort(f"{batches[-1]}-{i}")
    serving.step()  # the step that retires the aborted sequences: the serving model's last
    sync()
    pause_start = time.perf_counter()
    del serving  # evict
    metrics = WorkerMetrics(config.device).engine(info.name)
    incoming = LLMEngine(prepared.pop("runner"), word_tokenizer(), config, Path(), metrics)  # activate
    add_batch(incoming, "after", new_tokens=2)
    incoming.step()  # launches the new model's first step (a 32 x 128-token prefill)
    pause_s = time.perf_counter() - pause_start
    sync()
    first_step_s = time.perf_counter() - pause_start - pause_s
    detail = (
        f"prepare {prepare_s:.2f} s beside serving (copy {prepared['copy_s']:.2f} s, KV + graphs "
        f"{prepared['build_s']:.2f} s); pause = evict + activate until the first step is launched; that "
        f"step (prefill) then took {first_step_s * 1e3:.0f} ms; decode {before_tok_s:.0f} → {during_tok_s:.0f} tok/s "
        f"(alone over a whole batch {alone_row.tok_s:.0f} tok/s: × {during_tok_s / alone_row.tok_s:.2f})"
    )
    return SwitchRow(info.name, host.nbytes / 1e9, "overlap", pause_s, pause_s + first_step_s, detail), incoming


def part_switch(args: argparse.Namespace) -> None:
    stream = side_stream()
    block = random_block(device())
    h2d = h2d_floor() if torch.cuda.is_available() else float("nan")
    print(f"pinned H2D floor: {h2d / 1e9:.1f} GB/s", flush=True)
    rows: list[SwitchRow] = []
    staging = StagingRing(pin=torch.cuda.is_available())  # one per worker, reused load after load
    for shape in args.cold:
        directory = write_model(SHAPES[shape], args.dir / shape, block)
        disk = read_floor(checkpoint_files(directory))
        for row in measure_cold(SHAPES[shape], directory, disk, stream, staging):
            row.detail += f"; disk floor {disk / 1e9:.2f} GB/s; {len(checkpoint_files(directory))} shards"
            rows.append(row)
            print(row, flush=True)
        for path in checkpoint_files(directory):
            path.unlink()
    for shape in args.shapes:
        host = host_weights(SHAPES[shape], block)
        rows.append(measure_warm(SHAPES[shape], host, h2d, stream))
        print(rows[-1], flush=True)
        serving_info = SHAPES["tiny" if "tiny" in args.shapes else "1b"]
        kv_storage = kv_storage_for(serving_info, SHAPES[shape])
        serving = serving_engine(block, "tiny" in args.shapes, stream, kv_storage)
        row, incoming = measure_overlap(serving, SHAPES[shape], host, stream, kv_storage, args.timeline_out)
        del serving  # measure_overlap dropped its own reference at the hand-over
        rows.append(row)
        print(rows[-1], flush=True)
        del incoming, host, kv_storage
        free_device_memory()
    print_switch_table(rows, h2d)
    if args.out:
        with args.out.open("a") as f:
            for row in rows:
                f.write(json.dumps({"part": "switch", **asdict(row)}) + "\n")


def print_switch_table(rows: list[SwitchRow], h2d: float) -> None:
    """cold/warm: seconds beside the floor (× floor); overlap: the pause, and the pause with the first step."""
    print("\n| model | GB | switch | seconds | floor s (overlap: pause + first step) | × floor | detail |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = "—" if r.kind == "overlap" else f"{r.seconds / r.floor_s:.2f}"
        print(f"| {r.shape} | {r.gb:.2f} | {r.kind} | {r.seconds:.3f} | {r.floor_s:.3f} | {ratio} | {r.detail} |")
    print(f"pinned H2D floor {h2d / 1e9:.1f} GB/s")


# -- part: share ----------------------------------------------------------------------------------


def serve(shape: str, seconds: float) -> None:
    """One co-located process: build the model, say ready, wait for 'go' on stdin, then decode
    batches for `seconds`; prints one JSON line with its generated tokens and wall time."""
    config = engine_config()
    block = random_block(device())
    engine = new_engine(new_model(SHAPES[shape], config), config)
    copy_to_model(engine.runner.model, host_weights(SHAPES[shape], block), side_stream())
    run_batch(engine, "warmup")
    print("ready", flush=True)
    sys.stdin.readline()
    tokens, start, batches = 0, time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        tokens += run_batch(engine, f"b{batches}")
        batches += 1
    wall = time.perf_counter() - start
    print(json.dumps({"shape": shape, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}), flush=True)


def co_located(pair: list[str], seconds: float, fraction: float, mps: bool) -> list[dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if mps:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = "50"
    command = [sys.executable, "-m", "bench.model_switch", "--seconds", str(seconds)]
    command += ["--memory-fraction", str(fraction)]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "env": env, "text": True}
    procs = [subprocess.Popen([*command, "--serve", shape], **pipes) for shape in pair]
    for proc in procs:
        _next_line(proc, lambda line: line == "ready")
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = [json.loads(_next_line(proc, lambda line: line.startswith("{"))) for proc in procs]
    for proc in procs:
        proc.wait(60)
    return results


def _next_line(proc: subprocess.Popen, wanted: Callable[[str], bool]) -> str:
    """The process's next stdout line that `wanted` accepts (its log lines go the same way)."""
    for line in proc.stdout:
        if wanted(line.strip()):
            return line.strip()
    raise RuntimeError(f"a co-located process ended early (exit code {proc.wait()})")


def part_share(args: argparse.Namespace) -> None:
    rows: list[tuple[str, str, float]] = []  # (setup, model, tok/s)
    if not args.mps:
        config = engine_config()
        block = random_block(device())
        stream = side_stream()
        hosts = {shape: host_weights(SHAPES[shape], block) for shape in args.pair}
        for shape in args.pair:
            engine = new_engine(new_model(SHAPES[shape], config), config)
            copy_to_model(engine.runner.model, hosts[shape], stream)
            run_batch(engine, "warmup")
            tokens, start = 0, time.perf_counter()
            while time.perf_counter() - start < args.seconds / 2:
                tokens += run_batch(engine, "d")
            rows.append(("dedicated", shape, tokens / (time.perf_counter() - start)))
            del engine
            free_device_memory()
        tokens_by = dict.fromkeys(args.pair, 0)
        switches, start = 0, time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            for shape in args.pair:  # a warm switch (copy + KV + graphs), then one batch
                engine = new_engine(new_model(SHAPES[shape], config), config)
                copy_to_model(engine.runner.model, hosts[shape], stream)
                tokens_by[shape] += run_batch(engine, "t")
                del engine
                free_device_memory()
                switches += 1
        wall = time.perf_counter() - start
        rows += [(f"time-sliced ({switches} switches)", shape, tokens_by[shape] / wall) for shape in args.pair]
        del hosts
        free_device_memory()
        setup = "co-located, no MPS"
    else:
        setup = "co-located, MPS 50% threads"
    results = co_located(args.pair, args.seconds, args.memory_fraction, args.mps)
    rows += [(f"{setup} ({args.memory_fraction:.2f} memory each)", r["shape"], r["tok_s"]) for r in results]
    print("\n| setup | model | tok/s |")
    print("| --- | --- | --- |")
    for setup_name in dict.fromkeys(name for name, _, _ in rows):
        group = [(m, t) for name, m, t in rows if name == setup_name]
        for model, tok_s in group:
            print(f"| {setup_name} | {model} | {tok_s:.0f} |")
        if len(group) > 1:
            print(f"| {setup_name} | aggregate | {sum(t for _, t in group):.0f} |")
    if args.out:
        with args.out.open("a") as f:
            for name, model, tok_s in rows:
                f.write(json.dumps({"part": "share", "setup": name, "model": model, "tok_s": tok_s}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("switch", "share"))
    parser.add_argument("--shapes", nargs="+", default=["1b", "8b", "14b"], choices=list(SHAPES))
    parser.add_argument("--cold", nargs="*", default=["1b", "8b"], choices=list(SHAPES))
    parser.add_argument("--dir", type=Path, default=Path("/tmp/lorafleet-model-switch"))
    parser.add_argument("--pair", nargs=2, default=["1b", "8b"], choices=list(SHAPES))
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--memory-fraction", type=float, default=0.45)
    parser.add_argument("--mps", action="store_true", help="co-located run only, under a running MPS daemon")
    parser.add_argument("--serve", choices=list(SHAPES), help="internal: one co-located process")
    parser.add_argument("--out", type=Path, help="append result rows as JSON lines")
    parser.add_argument(
        "--timeline-out",
        type=Path,
        help="append each overlap's raw timeline as a JSON line: the serving steps alone and during the "
        "preparation as [start, end, tokens], the preparation's stretches as [start, end, kind]",
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        help="the process's GIL switch interval (sys.setswitchinterval; Python's default 5 ms): how long a "
        "thread waiting for the GIL lets another one run Python (bench/gil_handoff.py)",
    )
    args = parser.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    print(f"GIL switch interval {sys.getswitchinterval() * 1e3:g} ms", flush=True)
    if args.serve:
        if torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
        serve(args.serve, args.seconds)
    elif args.part == "switch":
        part_switch(args)
    elif args.part == "share":
        part_share(args)
    else:
        parser.error("give --part switch|share")


if __name__ == "__main__":
    main()
