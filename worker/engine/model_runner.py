"""The one place the engine touches the device: builds the step's tensors, runs the model, samples.

Owns the model, its KV cache and the LoRA slot tensors; knows nothing about requests beyond what
the scheduler hands it. On CUDA, pure-decode steps replay captured graphs (cuda_graphs.py), and
steps with prefill chunks replay graphs of everything but attention (piecewise_graphs.py); every
step on CPU runs the model eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import structlog
import torch

from kernels.lora import LoRABatch
from shared.config import EngineConfig, ModelSpec
from shared.model_info import ModelInfo
from worker.engine.cuda_graphs import DecodeGraphs
from worker.engine.forward_batch import ForwardBatch
from worker.engine.kv_cache import KVCache, KVLayout
from worker.engine.model import CausalLM, resolve_dtype
from worker.engine.peft_adapter import load_adapter_weights
from worker.engine.piecewise_graphs import PIECEWISE_MAX_TOKENS, PiecewiseGraphs
from worker.engine.sampled_tokens import SampledTokens
from worker.engine.sampler import sample
from worker.engine.scheduler import ScheduledSequence
from worker.engine.sequence import Sequence as SequenceState

log = structlog.get_logger(__name__)

# Activations of the largest step, per batched token, as a multiple of the widest layer output:
# generous so the KV cache sized from "what is left" never starves the forward pass.
_ACTIVATION_HEADROOM = 16


def engine_dtype(name: str | None, info: ModelInfo, device: torch.device) -> torch.dtype:
    """The checkpoint's dtype unless `name` overrides it; fp16 on CPU runs as fp32 (slow and lossy there)."""
    dtype = resolve_dtype(name, info)
    return torch.float32 if device.type == "cpu" and dtype is torch.float16 else dtype


def device_bytes_left(config: EngineConfig, device: torch.device) -> int:
    """Device memory this process may still take: the device's free memory plus what torch's allocator
    keeps cached for reuse (freed by an evicted model, say). With `gpu_memory_fraction` (processes
    sharing a GPU under MPS) no more than the process's own cap less what it has allocated, since the
    device's free memory also shrinks as the other processes allocate; otherwise less the part
    `gpu_memory_utilization` leaves alone."""
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # blocks torch keeps for reuse
    if config.gpu_memory_fraction is not None:
        return min(free, int(total * config.gpu_memory_fraction) - torch.cuda.memory_allocated(device))
    return int(free - total * (1 - config.gpu_memory_utilization))


def kv_layout(info: ModelInfo, config: EngineConfig, dtype: torch.dtype) -> KVLayout:
    return KVLayout(info.num_layers, config.block_size, info.num_kv_heads, info.head_dim, dtype)


def usable_kv_blocks(info: ModelInfo, config: EngineConfig) -> int:
    """Blocks a full batch of full-context sequences can use: more is memory no request can reach."""
    return config.max_num_seqs * -(-info.max_context // config.block_size)


def kv_budget_bytes(info: ModelInfo, config: EngineConfig, share: float) -> int:
    """Bytes the KV cache may take: `share` of the device memory left after weights and LoRA slots,
    less activation headroom for the largest step (CUDA); `share` of cpu_kv_cache_gb (CPU)."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return int(config.cpu_kv_cache_gb * (1 << 30) * share)
    widest = max(2 * info.intermediate_size, info.vocab_size)
    activations = config.max_num_batched_tokens * widest * 4 * _ACTIVATION_HEADROOM
    return int(device_bytes_left(config, device) * share - activations)


def fit_kv_blocks(info: ModelInfo, config: EngineConfig, dtype: torch.dtype, share: float) -> int:
    """KV blocks that fit the budget, but no more than usable_kv_blocks (a small model on a large GPU
    would otherwise take all its memory for blocks no request can reach)."""
    per_block = kv_layout(info, config, dtype).bytes_per_block
    blocks = min(kv_budget_bytes(info, config, share) // per_block, usable_kv_blocks(info, config))
    if blocks < 1:
        raise RuntimeError("no memory left for the KV cache: lower max_num_batched_tokens or serve fewer models")
    return blocks


def _token_at(seq: SequenceState, position: int) -> int:
    """The token at `position` of prompt + output, without concatenating the two lists."""
    prompt_len = len(seq.prompt_token_ids)
    return seq.prompt_token_ids[position] if position < prompt_len else seq.output_token_ids[position - prompt_len]


class ModelRunner:
    def __init__(self, spec: ModelSpec, config: EngineConfig, *, kv_memory_share: float = 1.0) -> None:
        """Load the checkpoint at `spec.path` and size the KV cache from the memory left."""
        info = ModelInfo.from_pretrained(spec.name, spec.path)
        device = torch.device(config.device)
        model = CausalLM(
            info,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            dtype=engine_dtype(config.dtype, info, device),
            device=device,
        )
        model.load_weights(spec.path)
        self._attach(model, config, kv_memory_share, name=spec.name)

    @classmethod
    def from_model(
        cls,
        model: CausalLM,
        config: EngineConfig,
        *,
        kv_memory_share: float = 1.0,
        kv_storage: torch.Tensor | None = None,
    ) -> ModelRunner:
        """A runner around a model already built on config.device (benchmarks build random weights
        in memory, a switching worker copies them from its host cache); its slots must match
        config.max_loras / max_lora_rank. The KV cache is carved from `kv_storage` (flat uint8) when
        given, as many blocks as it holds, else allocated from `kv_memory_share` of the memory left."""
        if (model.max_loras, model.max_lora_rank) != (config.max_loras, config.max_lora_rank):
            raise ValueError("the model's adapter slots differ from config.max_loras / max_lora_rank")
        runner = cls.__new__(cls)
        runner._attach(model, config, kv_memory_share, name=model.info.name, kv_storage=kv_storage)
        return runner

    def _attach(
        self,
        model: CausalLM,
        config: EngineConfig,
        kv_memory_share: float,
        *,
        name: str,
        kv_storage: torch.Tensor | None = None,
    ) -> None:
        self.info = model.info
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = model.dtype
        self.model = model
        on_cuda = self.device.type == "cuda"
        scratch = int(on_cuda)  # CUDA: one block past those the block manager hands out, for graphs' padding rows
        layout = kv_layout(self.info, config, self.dtype)
        if kv_storage is None:
            self.num_blocks = config.num_kv_blocks or fit_kv_blocks(self.info, config, self.dtype, kv_memory_share)
            self.kv_cache = KVCache.allocate(layout, self.num_blocks + scratch, self.device)
        else:
            held = layout.blocks_in(kv_storage.numel()) - scratch
            self.num_blocks = min(held, config.num_kv_blocks or usable_kv_blocks(self.info, config))
            if self.num_blocks < 1:
                raise RuntimeError(f"the KV storage holds no block of {name}")
            self.kv_cache = KVCache.carve(layout, self.num_blocks + scratch, kv_storage)
        # None: those steps run eagerly (CPU; tests compare graphs against eager by clearing them)
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        # int64 [B] tokens the last step sampled, still on the device: the next step's inputs take a
        # token id -(r + 1) (a sequence whose newest token the host has not read yet) from row r
        self._last_sampled: torch.Tensor | None = None
        if on_cuda:
            pool = torch.cuda.graph_pool_handle()  # replayed one at a time, the graphs share their memory
            max_tokens = min(config.max_num_batched_tokens, PIECEWISE_MAX_TOKENS)
            self.piecewise = PiecewiseGraphs(model, self.kv_cache, max_tokens=max_tokens, pool=pool)
            self.graphs = DecodeGraphs(
                model,
                self.kv_cache,
                max_batch=config.max_num_seqs,
                max_blocks_per_seq=-(-self.info.max_context // config.block_size),
                pool=pool,
            )
        log.info("model_loaded", model=name, dtype=str(self.dtype), device=str(self.device), kv_blocks=self.num_blocks)

    def load_adapter(self, index: int, adapter_dir: Path) -> int:
        """Load an adapter directly as the `index`-th of max_loras (CausalLM.set_adapter_slot); returns its slot."""
        weights = load_adapter_weights(
            adapter_dir, self.info, max_rank=self.config.max_lora_rank, max_bytes=self.config.max_adapter_bytes
        )
        return self.model.set_adapter_slot(index, weights)

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
