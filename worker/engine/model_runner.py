"""The one place the engine touches the device: builds the step's tensors, runs the model, samples.

Owns the model, its KV cache and the LoRA slot tensors; knows nothing about requests beyond what
the scheduler hands it. On CUDA, pure-decode steps replay captured graphs (cuda_graphs.py), and
steps with prefill chunks replay graphs of everything but attention (piecewise_graphs.py); every
step on CPU runs the model eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog
import torch

from kernels.lora import LoRABatch
from shared.config import EngineConfig
from worker.engine.capture_pacer import CapturePacer
from worker.engine.cuda_graphs import DecodeGraphs
from worker.engine.piecewise_graphs import PIECEWISE_MAX_TOKENS, PiecewiseGraphs
from worker.engine.sampled_tokens import SampledTokens
from worker.engine.sampler import sample
from worker.engine.scheduler import ScheduledSequence
from worker.engine.sequence import Sequence as SequenceState
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache, KVLayout
from worker.model.model import CausalLM

log = structlog.get_logger(__name__)


def _token_at(seq: SequenceState, position: int) -> int:
    """The token at `position` of prompt + output, without concatenating the two lists."""
    prompt_len = len(seq.prompt_token_ids)
    return seq.prompt_token_ids[position] if position < prompt_len else seq.output_token_ids[position - prompt_len]


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        kv_storage: torch.Tensor,
        num_blocks: int,
        pacer: CapturePacer | None = None,
    ) -> None:
        """The runner of `model` (built on config.device, its weights filled: worker/switching/
        residency.py does both). Its KV cache is `num_blocks` blocks, as the memory plan sized them
        (worker/memory_plan.py), carved from the flat uint8 `kv_storage`, which on CUDA also holds one
        scratch block past them for the decode graphs' padding rows; on CUDA the graphs are captured
        here, paced by `pacer` while another model serves beside (capture_pacer.py)."""
        if (model.max_loras, model.max_lora_rank) != (config.max_loras, config.max_lora_rank):
            raise ValueError("the model's adapter slots differ from config.max_loras / max_lora_rank")
        self.info = model.info
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = model.dtype
        self.model = model
        on_cuda = self.device.type == "cuda"
        layout = KVLayout.of(self.info, config.block_size, self.dtype)
        self.num_blocks = num_blocks
        self.kv_cache = KVCache.carve(layout, num_blocks + int(on_cuda), kv_storage)
        # None: those steps run eagerly (CPU; tests compare graphs against eager by clearing them)
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        # int64 [B] tokens the last step sampled, still on the device: the next step's inputs take a
        # token id -(r + 1) (a sequence whose newest token the host has not read yet) from row r
        self._last_sampled: torch.Tensor | None = None
        if on_cuda:
            pool = torch.cuda.graph_pool_handle()  # replayed one at a time, the graphs share their memory
            max_tokens = min(config.max_num_batched_tokens, PIECEWISE_MAX_TOKENS)
            self.piecewise = PiecewiseGraphs(model, self.kv_cache, max_tokens=max_tokens, pool=pool, pacer=pacer)
            self.graphs = DecodeGraphs(
                model,
                self.kv_cache,
                max_batch=config.max_num_seqs,
                max_blocks_per_seq=-(-self.info.max_context // config.block_size),
                pool=pool,
                pacer=pacer,
            )
        log.info(
            "model_loaded",
            model=self.info.name,
            dtype=str(self.dtype),
            device=str(self.device),
            kv_blocks=num_blocks,
            capture_paced_s=None if pacer is None else round(pacer.slept_s, 3),
        )

    def execute(
        self, scheduled: Sequence[ScheduledSequence], slot_of: Callable[[str], int | None], block_size: int
    ) -> torch.Tensor:
        """Run one step; returns float32 logits [B, V], one row per scheduled sequence. A token id
        -(r + 1) in a sequence's tokens stands for row r of what the previous step sampled."""
        graphs = self.graphs
        if graphs is not None and len(scheduled) <= graphs.max_batch and all(s.num_new_tokens == 1 for s in scheduled):
            return self._replay_decode(graphs, scheduled, slot_of, block_size, self._last_sampled)
        batch, token_slots = self._build_batch(scheduled, slot_of, block_size)
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
        sampled = SampledTokens(tokens, logits.isfinite().all(dim=-1))
        self._last_sampled = tokens  # only once nothing here can fail: an out-of-memory retry still reads the old
        return sampled

    @staticmethod
    def _replay_decode(
        graphs: DecodeGraphs,
        scheduled: Sequence[ScheduledSequence],
        slot_of: Callable[[str], int | None],
        block_size: int,
        last_sampled: torch.Tensor | None,
    ) -> torch.Tensor:
        """A step where each sequence brings one token (at position num_computed_tokens), by graph."""
        seqs = [item.seq for item in scheduled]
        positions = [seq.num_computed_tokens for seq in seqs]
        return graphs.run(
            token_ids=[_token_at(seq, p) for seq, p in zip(seqs, positions, strict=True)],
            positions=positions,
            slots=[
                seq.block_table[p // block_size] * block_size + p % block_size
                for seq, p in zip(seqs, positions, strict=True)
            ],
            adapter_slots=[-1 if seq.adapter_uid is None else slot_of(seq.adapter_uid) for seq in seqs],
            block_tables=[seq.block_table for seq in seqs],
            last_sampled=last_sampled,
        )

    def _build_batch(
        self, scheduled: Sequence[ScheduledSequence], slot_of: Callable[[str], int | None], block_size: int
    ) -> tuple[ForwardBatch, torch.Tensor | None]:
        """The step's batch without LoRA metadata, and int32 [T] token slots (-1: base model) when
        any token has an adapter: a graph builds the metadata itself, an eager step from these."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        logits_indices: list[int] = []
        token_slots: list[int] = []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids += seq.token_ids(start, end)
            positions += range(start, end)
            slots += [seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            query_start.append(query_start[-1] + item.num_new_tokens)
            context_lens.append(end)
            logits_indices.append(query_start[-1] - 1)
            adapter_slot = -1 if seq.adapter_uid is None else slot_of(seq.adapter_uid)
            token_slots += [adapter_slot] * item.num_new_tokens
        max_blocks = max(len(item.seq.block_table) for item in scheduled)
        tables = [item.seq.block_table + [-1] * (max_blocks - len(item.seq.block_table)) for item in scheduled]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            # pinned host memory lets the copy overlap with the previous step's GPU work
            pin = self.device.type == "cuda"
            return torch.tensor(values, dtype=dtype, pin_memory=pin).to(self.device, non_blocking=True)

        token_ids = tensor(input_ids, torch.int64)
        if min(input_ids) < 0:  # tokens the previous step sampled: read where they are, on the device
            token_ids = torch.where(token_ids < 0, self._last_sampled[(-token_ids - 1).clamp(min=0)], token_ids)
        batch = ForwardBatch(
            input_ids=token_ids,
            positions=tensor(positions, torch.int64),
            slot_mapping=tensor(slots, torch.int64),
            query_start_loc=tensor(query_start, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            block_tables=tensor(tables, torch.int32),
            logits_indices=tensor(logits_indices, torch.int64),
            max_query_len=max(item.num_new_tokens for item in scheduled),
            max_context_len=max(context_lens),
        )
        return batch, tensor(token_slots, torch.int32) if any(s >= 0 for s in token_slots) else None
