"""The one place the engine touches the device: builds the step's tensors, runs the model, samples.

Owns the model, its KV cache and the LoRA slot tensors; knows nothing about requests beyond what
the scheduler hands it. On CUDA, pure-decode steps replay captured graphs (cuda_graphs.py), and
steps with prefill chunks replay graphs of everything but attention (piecewise_graphs.py); every
step on CPU runs the model eagerly.

Under tensor parallelism every rank has a runner over its share of the model. Rank 0's (`channel`
given) is the engine's: each step it sends the step's inputs to the followers before running it, and
its sampled tokens after; a follower's runner runs the steps it receives (`follow`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path

import structlog
import torch

from kernels.lora import LoRABatch
from kernels.quant import FP8_DTYPE
from shared.config import EngineConfig
from worker.adapter_pool.follower_tier import FollowerAdapters
from worker.adapter_pool.slot_writer import SlotWriter, Upload
from worker.engine.capture_pacer import CapturePacer
from worker.engine.cuda_graphs import DecodeGraphs, mark
from worker.engine.kv_calibration import calibrate_kv_scales
from worker.engine.piecewise_graphs import PIECEWISE_MAX_TOKENS, PiecewiseGraphs
from worker.engine.sampled_tokens import SampledTokens
from worker.engine.sampler import sample
from worker.engine.scheduler import ScheduledSequence
from worker.engine.step_channel import StepChannel
from worker.engine.step_inputs import StepInputs
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache, KVLayout
from worker.model.model import CausalLM

log = structlog.get_logger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        kv_storage: torch.Tensor,
        num_blocks: int,
        *,
        pacer: CapturePacer | None = None,
        channel: StepChannel | None = None,
    ) -> None:
        """The runner of `model` (built on config.device, its weights filled: worker/switching/
        residency.py does both). Its KV cache is `num_blocks` blocks, as the memory plan sized them
        (worker/memory_plan.py), carved from the flat uint8 `kv_storage`, which on CUDA also holds one
        scratch block past them for the decode graphs' padding rows; on CUDA the graphs are captured
        here, paced by `pacer` while another model serves beside (capture_pacer.py), and on every rank
        of a tensor-parallel group at once (their collectives are captured too). `channel`: this
        runner is a tensor-parallel rank's (the model's shard says which). `pacer`'s timeline gets
        each stretch of the build by kind (capture_pacer.py), closed when the runner is built."""
        if (model.max_loras, model.max_lora_rank) != (config.max_loras, config.max_lora_rank):
            raise ValueError("the model's adapter slots differ from config.max_loras / max_lora_rank")
        self.info = model.info
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = model.dtype
        self.model = model
        self.channel = channel
        on_cuda = self.device.type == "cuda"
        layout = KVLayout.of(model.local_info, config.block_size, self.dtype)  # a tensor-parallel rank's KV heads
        if channel is not None:  # every rank's cache holds every block rank 0's block manager hands out
            num_blocks = channel.smallest(num_blocks)
        self.num_blocks = num_blocks
        mark(pacer, "kv carve")
        self.kv_cache = KVCache.carve(layout, num_blocks + int(on_cuda), kv_storage)
        # an fp8 cache's scales, where the checkpoint published none: calibrated here, the one place
        # every engine (a worker's, a test's) is built, with the weights loaded and before any graph
        # is captured (the graphs read the scale tensors the calibration fills)
        calibrated = layout.dtype == FP8_DTYPE and not model.kv_scales_published
        if calibrated:
            mark(pacer, "kv calibration")
            calibrate_kv_scales(model, block_size=config.block_size, max_tokens=config.max_num_batched_tokens)
        # None: those steps run eagerly (CPU; tests compare graphs against eager by clearing them)
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        # int64 [B] tokens the last step sampled, still on the device: the next step's inputs take a
        # token id -(r + 1) (a sequence whose newest token the host has not read yet) from row r
        self._last_sampled: torch.Tensor | None = None
        if on_cuda:
            pool = torch.cuda.graph_pool_handle()  # replayed one at a time, the graphs share their memory
            max_tokens = min(config.max_num_batched_tokens, PIECEWISE_MAX_TOKENS)
            mark(pacer, "piece setup")
            self.piecewise = PiecewiseGraphs(model, self.kv_cache, max_tokens=max_tokens, pool=pool, pacer=pacer)
            mark(pacer, "decode setup")
            self.graphs = DecodeGraphs(
                model,
                self.kv_cache,
                max_batch=config.max_num_seqs,
                max_blocks_per_seq=-(-self.info.max_context // config.block_size),
                pool=pool,
                pacer=pacer,
            )
        if pacer is not None:
            pacer.finish()
        if channel is not None and on_cuda:  # graphs that captured the group's collectives go before the group
            channel.before_leaving(self.release_graphs)
        log.info(
            "model_loaded",
            model=self.info.name,
            dtype=str(self.dtype),
            device=str(self.device),
            kv_blocks=num_blocks,
            kv_scales=("calibrated" if calibrated else "checkpoint") if layout.dtype == FP8_DTYPE else None,
            capture_paced_s=None if pacer is None else round(pacer.slept_s, 3),
            build_s_by_kind=None if pacer is None else {k: round(v, 3) for k, v in pacer.seconds_by_kind().items()},
        )

    def release_graphs(self) -> None:
        """Destroy the captured graphs; later steps run eagerly. A tensor-parallel rank's runner does
        it as its rank leaves the group (StepChannel.before_leaving): NCCL (>= 2.26) destroys or
        aborts a communicator only once every graph that captured its collectives is destroyed, and
        waits for them without end (issue #26: rank 0 hung at stop holding its engine's graphs)."""
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            for graphs in (self.graphs, self.piecewise):  # from any thread (a leave runs on its own)
                if graphs is not None:
                    graphs.release()
        self.graphs = None
        self.piecewise = None

    def execute(
        self, scheduled: Sequence[ScheduledSequence], slot_of: Callable[[str], int | None], block_size: int
    ) -> torch.Tensor:
        """Run one step; returns float32 logits [B, V], one row per scheduled sequence. A token id
        -(r + 1) in a sequence's tokens stands for row r of what the previous step sampled. Rank 0
        of a tensor-parallel group sends the step to its followers first."""
        inputs = StepInputs.of(scheduled, slot_of, block_size)
        if self.channel is not None:
            self.channel.send(inputs)
        return self.run(inputs)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The step of `inputs`: float32 logits [B, V] (see execute)."""
        graphs = self.graphs
        if graphs is not None and inputs.is_decode and inputs.num_seqs <= graphs.max_batch:
            return graphs.run(
                token_ids=inputs.input_ids,
                positions=inputs.positions,
                slots=inputs.slot_mapping,
                adapter_slots=inputs.token_slots,
                block_tables=inputs.block_tables,
                last_sampled=self._last_sampled,
            )
        batch, token_slots = self._build_batch(inputs)
        if self.piecewise is not None and batch.num_tokens <= self.piecewise.max_tokens:
            return self.piecewise.run(batch, token_slots)
        if token_slots is not None:
            model = self.model
            batch.lora = LoRABatch.build(token_slots, model.slot_ranks, model.slot_scales, model.slot_pages)
        with torch.inference_mode():
            return self.model.forward(batch, self.kv_cache)

    def sample(self, logits: torch.Tensor, scheduled: Sequence[ScheduledSequence]) -> SampledTokens:
        """A token per scheduled sequence (and whether its logits row was finite), copied to the host
        behind the step without waiting for it; the next step may take them as inputs on the device."""
        seqs = [s.seq for s in scheduled]
        tokens = sample(
            logits, [s.sampling for s in seqs], [s.seed for s in seqs], [len(s.output_token_ids) for s in seqs]
        )
        if self.channel is not None:
            self.channel.share_tokens(tokens)
        sampled = SampledTokens(tokens, logits.isfinite().all(dim=-1))
        self._last_sampled = tokens  # only once nothing here can fail: an out-of-memory retry still reads the old
        return sampled

    def follow(self, adapter_root: Path | None) -> None:
        """A follower rank's life: read ahead the adapters rank 0 reads, write them into the pages it
        chose, and run the steps it sends, until it says stop. Adapters are read from `adapter_root`
        as rank 0's pool reads them (a file that fails here fails the rank, and with it the worker)."""
        if self.channel is None or self.channel.tp.rank == 0:
            raise RuntimeError("only a tensor-parallel follower's runner follows")
        writer = SlotWriter(self.model)
        adapters = FollowerAdapters(self.model, self.config, adapter_root, pin=self.device.type == "cuda")
        uploads: list[Upload] = []  # in flight: each holds its host buffer until it has landed
        try:
            while True:
                message = self.channel.receive()
                for ref in message.reads:
                    adapters.read_ahead(ref)
                uploads = [upload for upload in uploads if not upload.done()]
                for load in message.loads:
                    # after the steps queued so far (they may read the pages' previous adapter), before the next
                    marker = writer.read_marker()
                    upload = writer.write(load.pages, adapters.take(load.ref), after=[marker] if marker else [])
                    if upload.event is not None:
                        torch.cuda.current_stream(self.device).wait_event(upload.event)
                    uploads.append(upload)
                if message.inputs is None:
                    return
                self.run(message.inputs)
                tokens = torch.empty(message.inputs.num_seqs, dtype=torch.int64, device=self.device)
                self._last_sampled = self.channel.share_tokens(tokens)
        finally:
            adapters.close()

    def _build_batch(self, inputs: StepInputs) -> tuple[ForwardBatch, torch.Tensor | None]:
        """The step's batch without LoRA metadata, and int32 [T] token slots (-1: base model) when
        any token has an adapter: a graph builds the metadata itself, an eager step from these."""
        max_blocks = max(len(table) for table in inputs.block_tables)
        tables = [table + [-1] * (max_blocks - len(table)) for table in inputs.block_tables]
        context_lens = inputs.context_lens
        query_start = inputs.query_start

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            # pinned host memory lets the copy overlap with the previous step's GPU work
            pin = self.device.type == "cuda"
            return torch.tensor(values, dtype=dtype, pin_memory=pin).to(self.device, non_blocking=True)

        token_ids = tensor(inputs.input_ids, torch.int64)
        if min(inputs.input_ids) < 0:  # tokens the previous step sampled: read where they are, on the device
            token_ids = torch.where(token_ids < 0, self._last_sampled[(-token_ids - 1).clamp(min=0)], token_ids)
        batch = ForwardBatch(
            input_ids=token_ids,
            positions=tensor(inputs.positions, torch.int64),
            slot_mapping=tensor(inputs.slot_mapping, torch.int64),
            query_start_loc=tensor(query_start, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            block_tables=tensor(tables, torch.int32),
            logits_indices=tensor([end - 1 for end in query_start[1:]], torch.int64),
            max_query_len=max(end - start for start, end in pairwise(query_start)),
            max_context_len=max(context_lens),
        )
        token_slots = inputs.token_slots
        return batch, tensor(token_slots, torch.int32) if any(s >= 0 for s in token_slots) else None
