"""CUDA graphs of the model's forward for pure-decode steps (every sequence brings exactly one token).

An eager decode step of an 8B model is ~1,000 kernel launches, each with Python and launch cost on
the host; the GPU work is a few milliseconds. Replaying a captured graph launches them all at once.

A step of n sequences replays the graph of the smallest captured batch size b >= n. Its inputs live
in static device buffers the graphs were captured on; rows n..b-1 are padding: token 0 at position 0
with context length 1, writing and reading only the scratch KV block (one block past those the block
manager hands out), so padding never touches a real sequence's cache.

Two graphs per size: base-only (lora None) and with LoRA (none on a model without LoRA). The LoRA
graph builds its `LoRABatch` from the static token-slot buffer inside the capture, over the model's
slot_ranks / slot_scales / slot_pages tensors, which adapter loads update in place: replays see
whichever adapters the slots hold now.

Nothing a captured kernel's grid or host-side branch depends on varies between replays: the grids
depend on b alone, attention takes max_query_len = 1 and reads each context length on the device,
and the LoRA plan is chosen from shapes (the token count b, the projection shape).
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator

import structlog
import torch

from kernels.lora import LoRABatch
from worker.engine.capture_pacer import CapturePacer
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache, KVLayout
from worker.model.model import CausalLM

log = structlog.get_logger(__name__)

# Rows of the int64 staging buffer: one host-to-device copy carries a step's per-token inputs.
_TOKEN, _POSITION, _SLOT, _CONTEXT, _ADAPTER = range(5)


@functools.cache
def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream decode graphs are captured on, one per device for the process's life: cuBLAS gets a
    workspace (32 MiB on Hopper) for every stream it runs on and keeps it until the process exits, so
    a new stream per capture would leak one per model switch. Serving never runs on it."""
    return torch.cuda.Stream(device)


@contextlib.contextmanager
def capture_session(device: torch.device, pacer: CapturePacer | None = None) -> Iterator[torch.cuda.Stream]:
    """The setting every capture of a runner's graphs runs in: the capture stream (after the work
    queued so far on the current one, such as the static buffers' fills), inference mode, and no
    garbage collection.

    This may run on a loader thread while another model of the worker serves (a switch prepared
    beside it): captures only record kernels (thread-local mode, on a stream only captures use),
    so the serving model's launches go on and are never captured. A CUDA graph destroyed while
    another is being captured invalidates that capture (the next cuBLAS call fails): an earlier
    runner's graphs (a test's, a switched-out model's) may wait in unreachable reference cycles, so
    they are collected first and no collection runs mid-capture (a stretch of its own on `pacer`'s
    timeline: the collection holds the GIL throughout)."""
    stream = _capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    mark(pacer, "gc.collect")
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.inference_mode(), torch.cuda.stream(stream):
            yield stream
    finally:
        if collecting:
            gc.enable()
        stream.synchronize()


def capture(run: Callable[[], None], pool: tuple[int, int], pacer: CapturePacer | None = None) -> torch.cuda.CUDAGraph:
    """A graph of what `run` launches, its memory from `pool` (inside a capture_session). On `pacer`'s
    timeline the graph's instantiation (the driver's work in capture_end) is a stretch of its own."""
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        run()
    finally:
        mark(pacer, "graph instantiate")
        graph.capture_end()
    return graph


def pace(pacer: CapturePacer | None, kind: str) -> None:
    """A point between two units of capture work where a paced capture yields to the serving model;
    the next unit is of `kind` (the pacer's timeline)."""
    if pacer is not None:
        pacer.pause(kind)


def mark(pacer: CapturePacer | None, kind: str) -> None:
    """The preparation's work from here on is of `kind` (the pacer's timeline; no rest)."""
    if pacer is not None:
        pacer.mark(kind)


def warm_up_cache(kv_cache: KVCache) -> KVCache:
    """A one-block cache shaped like `kv_cache`, for the eager runs before captures: they compile
    Triton kernels and create cuBLAS handles without writing the real cache, which a model serving
    beside the capture may be reading."""
    key = kv_cache.key[0]
    layout = KVLayout(len(kv_cache.key), kv_cache.block_size, key.shape[2], key.shape[3], key.dtype)
    return KVCache.allocate(layout, 1, key.device)


def lora_variants(model: CausalLM) -> tuple[bool, ...]:
    """The graphs to capture per size, by whether they apply LoRA: a model without LoRA gets none
    that does (no capture time or pool memory spent on graphs that never replay)."""
    return (False, True) if model.lora_enabled else (False,)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then 16, 24, 32, 48, 64, 96, 128, 192 … (powers of two and their 1.5×), capped by
    and always including max_batch: padding wastes at most a third of a step's rows past 8."""
    sizes = [1, 2, 4, 8]
    power = 16
    while sizes[-1] < max_batch:
        sizes += [power, power * 3 // 2]
        power *= 2
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        *,
        max_batch: int,
        max_blocks_per_seq: int,
        pool: tuple[int, int],
        pacer: CapturePacer | None = None,
    ) -> None:
        """Capture decode graphs for batches of up to `max_batch` sequences whose block tables hold
        at most `max_blocks_per_seq` blocks, their memory from `pool` (graphs replayed one at a
        time may share one), paced by `pacer` when a model serves beside. The cache's last block
        is the padding rows' scratch."""
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = capture_sizes(max_batch)
        device = model.slot_ranks.device
        self.scratch_block = kv_cache.key[0].shape[0] - 1
        self._scratch_slot = self.scratch_block * kv_cache.block_size
        with torch.inference_mode():
            self._staging = torch.zeros(5, max_batch, dtype=torch.int64, device=device)  # rows: _TOKEN …
            self._block_tables = torch.full(
                (max_batch, max_blocks_per_seq), self.scratch_block, dtype=torch.int32, device=device
            )
            self._logits = torch.empty(max_batch, model.info.vocab_size, dtype=torch.float32, device=device)
            self._query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
            self._logits_indices = torch.arange(max_batch, dtype=torch.int64, device=device)
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._capture_all(pool, pacer)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def release(self) -> None:
        """Destroy every graph now (not whenever the garbage collector gets to them): see
        ModelRunner.release_graphs. The object is not run after."""
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        adapter_slots: list[int],
        block_tables: list[list[int]],
        last_sampled: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits float32 [n, vocab] of one decode step of n <= max_batch sequences: token_ids,
        positions, cache slots and adapter slots (-1: base model) per sequence, and their block tables.
        A token id -(r + 1) is row r of `last_sampled` (int64, on the device: the previous step's tokens).

        The logits are a view of a buffer the next replay overwrites: read them before the next step."""
        n = len(token_ids)
        size = next(s for s in self.sizes if s >= n)
        pad = size - n
        contexts = [p + 1 for p in positions]
        staged = [
            token_ids + [0] * pad,
            positions + [0] * pad,
            slots + [self._scratch_slot] * pad,
            contexts + [1] * pad,
            adapter_slots + [-1] * pad,
        ]
        width = max(len(table) for table in block_tables)
        tables = [t + [self.scratch_block] * (width - len(t)) for t in block_tables] + [
            [self.scratch_block] * width
        ] * pad
        with torch.inference_mode():
            # pinned host memory: the copies are queued behind the previous step without a host wait
            self._staging[:, :size].copy_(torch.tensor(staged, dtype=torch.int64, pin_memory=True), non_blocking=True)
            self._block_tables[:size, :width].copy_(
                torch.tensor(tables, dtype=torch.int32, pin_memory=True), non_blocking=True
            )
            if min(token_ids) < 0:
                tokens = self._staging[_TOKEN, :n]
                tokens.copy_(torch.where(tokens < 0, last_sampled[(-tokens - 1).clamp(min=0)], tokens))
            self._graphs[size, any(s >= 0 for s in adapter_slots)].replay()
        return self._logits[:n]

    def _capture_all(self, pool: tuple[int, int], pacer: CapturePacer | None) -> None:
        """Warm each graph's kernels up eagerly (on a cache of its own, see warm_up_cache), then
        capture it; largest first, so smaller graphs fit in the memory the larger ones' activations
        freed in the pool. Paced (a pause before each warm-up and each capture) when `pacer` is given."""
        warm_cache = warm_up_cache(self.kv_cache)
        with capture_session(self.kv_cache.key[0].device, pacer) as stream:
            self._stage_padding(scratch_block=0)  # the warm-up cache's one block
            for size in reversed(self.sizes):
                for with_lora in lora_variants(self.model):
                    pace(pacer, "decode warm-up")
                    self._forward(size, with_lora, warm_cache)
                    stream.synchronize()
                    pace(pacer, "decode capture")
                    self._graphs[size, with_lora] = capture(
                        functools.partial(self._forward, size, with_lora, self.kv_cache), pool, pacer
                    )
            self._stage_padding(scratch_block=self.scratch_block)
        log.info("decode_graphs_captured", sizes=self.sizes)

    def _stage_padding(self, scratch_block: int) -> None:
        """Fill every row as padding of `scratch_block`, so a run writes only that block."""
        self._staging.zero_()
        self._staging[_SLOT].fill_(scratch_block * self.kv_cache.block_size)
        self._staging[_CONTEXT].fill_(1)
        self._staging[_ADAPTER].fill_(-1)
        self._block_tables.fill_(scratch_block)

    def _forward(self, size: int, with_lora: bool, kv_cache: KVCache) -> None:
        """model.forward over the first `size` rows of the static buffers into the static logits."""
        staged = self._staging[:, :size]
        lora = None
        if with_lora:
            lora = LoRABatch.build(
                staged[_ADAPTER].to(torch.int32), self.model.slot_ranks, self.model.slot_scales, self.model.slot_pages
            )
        batch = ForwardBatch(
            input_ids=staged[_TOKEN],
            positions=staged[_POSITION],
            slot_mapping=staged[_SLOT],
            query_start_loc=self._query_start_loc[: size + 1],
            context_lens=staged[_CONTEXT].to(torch.int32),
            block_tables=self._block_tables[:size],
            logits_indices=self._logits_indices[:size],
            max_query_len=1,
            # attention reads context lengths on the device; this host copy only bounds them
            max_context_len=self._block_tables.shape[1] * kv_cache.block_size,
            lora=lora,
        )
        # written into one buffer shared by all sizes, so no graph keeps logits memory of its own in the pool
        self.model.forward(batch, kv_cache, out=self._logits[:size])
