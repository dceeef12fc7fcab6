"""The worker's one memory plan: every device budget, sized before anything is allocated.

Per resident model the device holds its weights, its LoRA pool (dense pages, and on MoE models every
expert's slots), the slot writer's staging buffers and room for activations (the largest eager step,
and the CUDA graphs' private pool); per resident slot (worker/switching/residency.py) one flat KV
storage buffer, which whichever model occupies the slot views with its own layout. All of it is
sized here from ModelInfo, EngineConfig and the device's bytes without allocating (the model's own
tensors are counted on the meta device), so it is computed, and unit-tested, anywhere. A
configuration that cannot fit fails here, at start, with an error naming the settings that would
make it fit, never as an out-of-memory error midway through loading.

    usable       the device's free bytes (torch's cached blocks included) less the part
                 --gpu-memory-utilization leaves alone; with --gpu-memory-fraction, that cap less
                 what the process holds (processes sharing a GPU under MPS shrink the free bytes)
    slots        --max-resident-models, else as many models (in the order given) as fit in 75% of
                 `usable` together with the prefetch reserve
    reserve      room to prepare the largest model that is not resident beside the resident ones
    KV per slot  (usable - CUDA runtime - resident models' bytes - reserve) / slots, but no more
                 than a full batch of full contexts of the hungriest model can use (or
                 --num-kv-blocks of it), plus the decode graphs' padding block

On CPU, the KV storage is cpu_kv_cache_gb split among the slots, and nothing else is checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shared.config import EngineConfig
from shared.model_info import ModelInfo
from worker.adapter_pool.host_arena import host_budget_bytes
from worker.adapter_pool.slot_writer import buffer_bytes
from worker.engine.piecewise_graphs import PIECEWISE_MAX_TOKENS
from worker.model.kv_cache import KVLayout
from worker.model.lora_linear import LoRALinear, LoRAPages
from worker.model.model import CausalLM, model_dtype
from worker.model.moe import MoEBlock
from worker.model.parallel.group import TensorParallel

# Without --max-resident-models, resident models (and the prefetch reserve) take at most this share of
# the usable memory, so that KV caches keep the rest.
_WEIGHTS_SHARE = 0.75
# Activations live in torch's caching allocator, which rounds blocks up and fragments: the largest
# step's tensors are budgeted this many times over.
_ALLOCATOR_SLACK = 2
# Device memory no tensor of ours holds: cuBLAS workspaces (one per stream), Triton's and the CUDA
# graphs' own bookkeeping.
_CUDA_RUNTIME_BYTES = 1 << 30
# The sampler's float32 / int64 temporaries per logit (the hash rounds of its noise, a sort of the row
# for top-k / top-p): a few [batch, vocab] arrays alive at once.
_SAMPLER_BYTES_PER_LOGIT = 48


class MemoryPlanError(ValueError):
    """A configuration the device cannot hold; the message names the settings to change."""


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One CUDA device's bytes as this process sees them: its total, what is free (blocks torch's
    allocator caches for reuse count as free) and what this process has allocated."""

    total: int
    free: int
    allocated: int = 0

    @classmethod
    def measure(cls, device: torch.device) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        return cls(total=total, free=free + torch.cuda.memory_reserved(device) - allocated, allocated=allocated)

    def usable(self, config: EngineConfig) -> int:
        """Bytes this process may still take."""
        if config.gpu_memory_fraction is not None:
            return min(self.free, int(self.total * config.gpu_memory_fraction) - self.allocated)
        return int(self.free - self.total * (1 - config.gpu_memory_utilization))


@dataclass(frozen=True, slots=True)
class ModelFootprint:
    """What one resident model takes of the device, in bytes, besides its KV cache."""

    weights: int
    dense_lora: int  # LoRA pages of the dense projections, and the slot tables
    expert_lora: int  # every expert's LoRA slots (MoE models)
    lora_staging: int  # the slot writer's staging and re-layout buffers
    activations: int  # the largest eager step (with allocator slack) and the decode graphs' pool
    kv_bytes_per_block: int
    kv_blocks_wanted: int  # --num-kv-blocks, else a full batch of full contexts: more is unreachable
    # host memory, not the device's (so not in `fixed`): the adapter pool's host tier, one arena allocated
    # at start (page-locked on CUDA), --adapter-host-cache-gb or its default; 0 without LoRA
    adapter_host_arena: int

    @property
    def fixed(self) -> int:
        return self.weights + self.dense_lora + self.expert_lora + self.lora_staging + self.activations


def model_footprint(info: ModelInfo, config: EngineConfig) -> ModelFootprint:
    """`info`'s footprint on config.device: its tensors counted on the meta device (allocating nothing).
    Under tensor parallelism, one rank's: rank 0's, which holds the largest share of the vocabulary."""
    dtype = model_dtype(config.dtype, info, config.device)
    tp = TensorParallel(0, config.tensor_parallel) if config.tensor_parallel > 1 else None
    model = CausalLM(
        info, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank, dtype=dtype, device="meta", tp=tp
    )
    whole, info = info, model.local_info  # the rank's heads and widths from here on
    dense_lora = sum(buffer.nbytes for name, buffer in model.named_buffers() if name.startswith("slot_"))
    expert_lora = 0
    for module in model.modules():
        if isinstance(module, LoRALinear):
            dense_lora += sum(buffer.nbytes for buffer in module.buffers(recurse=False))
        elif isinstance(module, MoEBlock):
            expert_lora += sum(buffer.nbytes for buffer in module.buffers(recurse=False))
    every_buffer = sum(buffer.nbytes for buffer in model.buffers())
    pages = LoRAPages.for_pool(info, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank)
    return ModelFootprint(
        # parameters, and the buffers that are not LoRA slots (RoPE's frequencies)
        weights=sum(parameter.nbytes for parameter in model.parameters()) + every_buffer - dense_lora - expert_lora,
        dense_lora=dense_lora,
        expert_lora=expert_lora,
        # without LoRA (--max-loras 0) there is no slot writer
        lora_staging=buffer_bytes(whole, pages, max_lora_rank=config.max_lora_rank, dtype=dtype)
        if config.lora_enabled
        else 0,
        activations=activation_bytes(info, config, dtype),
        kv_bytes_per_block=KVLayout.of(info, config.block_size, dtype).bytes_per_block,
        kv_blocks_wanted=config.num_kv_blocks or config.max_num_seqs * -(-info.max_context // config.block_size),
        adapter_host_arena=host_budget_bytes(whole, dtype, config) if config.lora_enabled else 0,
    )


def kv_storage_bytes(footprint: ModelFootprint, num_blocks: int, config: EngineConfig) -> int:
    """A KV storage holding `num_blocks` blocks of a model's cache and, on CUDA, the decode graphs'
    padding block past them (ModelRunner carves both)."""
    return (num_blocks + _scratch_blocks(config)) * footprint.kv_bytes_per_block


def _scratch_blocks(config: EngineConfig) -> int:
    return int(torch.device(config.device).type == "cuda")


def activation_bytes(info: ModelInfo, config: EngineConfig, dtype: torch.dtype) -> int:
    """The largest eager step (max_num_batched_tokens tokens, max_num_seqs rows of logits), with
    allocator slack, plus, on CUDA, the graphs' shared private pool: the activations of the largest
    graph (a decode step of max_num_seqs sequences, or a piecewise step of up to PIECEWISE_MAX_TOKENS
    tokens) and the piecewise steps' static buffers (the residual stream, q, the attention output
    and the last hidden state of their largest bucket).

    Per token, what one layer holds at once: the hidden state, the residual stream, the normed input
    and o_proj's output; q|k|v and its LoRA delta, the attention output; then the MLP's gate|up and
    its delta and SiLU·up, or, per routed (token, expert) pair, those of the expert and its output
    row and that row's LoRA delta (no deltas without LoRA). Logits are computed for one token per
    sequence: the head's product, the float32 logits and the sampler's temporaries."""
    q_width, kv_width = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
    deltas = int(config.lora_enabled)  # each LoRA delta is as wide as its projection's output
    attention = 4 * info.hidden_size + (1 + deltas) * (q_width + 2 * kv_width) + q_width
    mlp = (3 + 2 * deltas) * info.intermediate_size if len(info.moe_layers) < info.num_layers else 0
    if info.is_moe:
        per_pair = (3 + 2 * deltas) * info.moe_intermediate_size + (1 + deltas) * info.hidden_size
        mlp = max(mlp, info.num_experts_per_tok * per_pair + info.hidden_size)
    per_token = (attention + mlp) * dtype.itemsize
    per_sequence = info.vocab_size * (dtype.itemsize + 4 + _SAMPLER_BYTES_PER_LOGIT)
    seqs = config.max_num_seqs
    eager = config.max_num_batched_tokens * per_token + seqs * per_sequence
    if torch.device(config.device).type != "cuda":
        return _ALLOCATOR_SLACK * eager
    piecewise = min(config.max_num_batched_tokens, PIECEWISE_MAX_TOKENS)
    static = piecewise * 2 * (info.hidden_size + q_width) * dtype.itemsize
    graphs = max(seqs, piecewise) * per_token + seqs * per_sequence + static
    return _ALLOCATOR_SLACK * eager + graphs


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    footprints: dict[str, ModelFootprint]
    resident_slots: int
    kv_storage_bytes: int  # of each resident slot
    scratch_blocks: int  # past a model's blocks in its storage: the decode graphs' padding block (CUDA)
    usable_bytes: int | None  # of the device at start; None on CPU

    def kv_blocks(self, name: str) -> int:
        """KV blocks model `name` gets from a slot's storage (its scratch block not counted)."""
        footprint = self.footprints[name]
        held = self.kv_storage_bytes // footprint.kv_bytes_per_block - self.scratch_blocks
        return min(held, footprint.kv_blocks_wanted)

    def summary(self) -> dict[str, object]:
        """The plan in GB, for the worker's start-up log."""

        def gb(nbytes: int) -> float:
            return round(nbytes / 1e9, 3)

        return {
            "usable_gb": None if self.usable_bytes is None else gb(self.usable_bytes),
            "resident_slots": self.resident_slots,
            "kv_storage_gb": gb(self.kv_storage_bytes),
            # host memory: the adapter pools' arenas of the models resident at start
            "adapter_host_arenas_gb": gb(
                sum(f.adapter_host_arena for f in list(self.footprints.values())[: self.resident_slots])
            ),
            "models": {
                name: {
                    "weights_gb": gb(f.weights),
                    "lora_gb": gb(f.dense_lora),
                    "expert_lora_gb": gb(f.expert_lora),
                    "lora_staging_gb": gb(f.lora_staging),
                    "activations_gb": gb(f.activations),
                    "kv_blocks": self.kv_blocks(name),
                    "adapter_host_arena_gb": gb(f.adapter_host_arena),  # host memory
                }
                for name, f in self.footprints.items()
            },
        }


def plan_memory(
    infos: Mapping[str, ModelInfo],
    config: EngineConfig,
    *,
    memory: DeviceMemory | None,
    max_resident_models: int | None = None,
) -> MemoryPlan:
    """The plan for serving `infos` (in the order given, the first ones resident) with `config` on a
    device with `memory` (None: a CPU worker). Raises MemoryPlanError when they cannot fit."""
    footprints = {name: model_footprint(info, config) for name, info in infos.items()}
    names = list(footprints)
    scratch = _scratch_blocks(config)
    if memory is None:
        if scratch:
            raise ValueError("a CUDA worker's plan needs the device's memory")
        slots = min(len(names), max_resident_models or len(names))
        cpu_bytes = int(config.cpu_kv_cache_gb * (1 << 30)) // slots
        plan = MemoryPlan(footprints, slots, _kv_storage(footprints, config, cpu_bytes), scratch, None)
        # host memory is not planned: --num-kv-blocks is taken as given
        _check_kv(plan, config, room=plan.kv_storage_bytes if config.num_kv_blocks else cpu_bytes, knob="")
        return plan
    usable = memory.usable(config)
    for name, footprint in footprints.items():
        if _CUDA_RUNTIME_BYTES + footprint.fixed > usable:
            raise MemoryPlanError(_too_large(name, footprint, config, usable))
    slots = min(len(names), max_resident_models or _fitting_count(footprints, usable))
    resident = names[:slots]
    reserve = max((footprints[name].fixed for name in names[slots:]), default=0)
    room = (usable - _CUDA_RUNTIME_BYTES - sum(footprints[name].fixed for name in resident) - reserve) // slots
    plan = MemoryPlan(footprints, slots, _kv_storage(footprints, config, max(room, 0)), scratch, usable)
    _check_kv(plan, config, room=room, knob="--gpu-memory-utilization (or --gpu-memory-fraction)")
    return plan


def _fitting_count(footprints: Mapping[str, ModelFootprint], usable: int) -> int:
    """Models (in order) whose bytes, with the prefetch reserve for the largest of the others, fit in
    _WEIGHTS_SHARE of `usable`; at least one."""
    sizes = [footprint.fixed for footprint in footprints.values()]
    for count in range(len(sizes), 0, -1):
        if sum(sizes[:count]) + max(sizes[count:], default=0) <= _WEIGHTS_SHARE * usable:
            return count
    return 1


def _kv_storage(footprints: Mapping[str, ModelFootprint], config: EngineConfig, room: int) -> int:
    """One slot's KV storage: what the model needing the most would use, within `room` unless
    --num-kv-blocks asks for it exactly (_check_kv then says whether it fits)."""
    wanted = max(kv_storage_bytes(f, f.kv_blocks_wanted, config) for f in footprints.values())
    return wanted if config.num_kv_blocks else min(wanted, room)


def _check_kv(plan: MemoryPlan, config: EngineConfig, *, room: int, knob: str) -> None:
    """Every model gets at least one KV block in a slot, and a --num-kv-blocks storage fits its room.
    `knob`: the setting that gives the device more room ("" on CPU)."""
    if config.num_kv_blocks and plan.kv_storage_bytes > room:
        raise MemoryPlanError(
            f"--num-kv-blocks {config.num_kv_blocks} needs {_gb(plan.kv_storage_bytes)} of KV storage per resident "
            f"model, but {_gb(max(room, 0))} are left for it: lower --num-kv-blocks (or leave it unset to size "
            f"the cache from memory) or --max-resident-models, or raise {knob}"
        )
    for name in plan.footprints:
        if plan.kv_blocks(name) < 1:
            raise MemoryPlanError(
                f"no memory is left for {name}'s KV cache ({_gb(max(room, 0))} per resident model after weights, "
                f"LoRA slots and activations): lower --max-num-batched-tokens, --max-loras or --max-lora-rank, "
                f"serve fewer models at once (--max-resident-models)"
                + (f", or raise {knob}" if knob else ", or give --num-kv-blocks")
            )


def _too_large(name: str, footprint: ModelFootprint, config: EngineConfig, usable: int) -> str:
    """Why `name` cannot be loaded at all, every budget line given, and the settings that shrink them."""
    lora = footprint.dense_lora + footprint.expert_lora + footprint.lora_staging
    knobs = []
    if lora >= footprint.activations:
        knobs += ["--max-loras", "--max-lora-rank"]
    knobs.append("--max-num-batched-tokens")
    if lora < footprint.activations:
        knobs += ["--max-loras", "--max-lora-rank"]
    cap = (
        f"--gpu-memory-fraction {config.gpu_memory_fraction}"
        if config.gpu_memory_fraction is not None
        else f"--gpu-memory-utilization {config.gpu_memory_utilization}"
    )
    experts = f"; every expert's slots take {_gb(footprint.expert_lora)} of it" if footprint.expert_lora else ""
    return (
        f"{name} does not fit on the device: it needs {_gb(_CUDA_RUNTIME_BYTES + footprint.fixed)} but "
        f"{_gb(usable)} are usable ({cap}): weights {_gb(footprint.weights)}, LoRA pool "
        f"{_gb(footprint.dense_lora + footprint.expert_lora)} (--max-loras {config.max_loras} adapters of "
        f"--max-lora-rank {config.max_lora_rank}{experts}), adapter staging {_gb(footprint.lora_staging)}, "
        f"activations {_gb(footprint.activations)} (--max-num-batched-tokens {config.max_num_batched_tokens}, "
        f"--max-num-seqs {config.max_num_seqs}), CUDA runtime {_gb(_CUDA_RUNTIME_BYTES)}; the KV cache needs room "
        f"on top. Lower {', '.join(knobs)}, or raise the memory cap"
    )


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"
