"""Host → device: copies a packed host adapter into one of the model's LoRA slots. The one module
of the adapter pool that touches CUDA streams.

On CUDA the copy runs on a side stream, so it overlaps the steps the engine keeps running: one
host-to-device transfer of the packed buffer, then device-side scatters into the slot's rows, then
an event the pool polls before it lets any request use the slot. Before writing, the side stream
waits for the work already queued on the main stream, which may still read the evicted adapter.
On CPU the same code runs synchronously.

A write runs on the engine thread, so its host cost is kept to a few calls whatever the number of
projections: the views it copies into are built once per slot and adapter shape (`_SlotPlan`), the
views it copies from come from one split of the staged buffer (host_adapter.BufferLayout), and the
copies are multi-tensor ones (a few launches for all 224 projections of Llama-3-8B).

No leak from an evicted adapter: kernels and the reference apply only the first `slot_ranks[s]`
ranks of a slot, and on top of that every entry the previous occupant may have written past the
new adapter's rank, or in projections the new adapter leaves alone, is zeroed here. So a slot's
contents past its current adapter are always zero, whatever path reads them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from worker.adapter_pool.host_adapter import HostAdapter
from worker.engine.model import CausalLM
from worker.engine.moe import MoEBlock

# (A [slots, max_rank, in], B [slots, out, max_rank]); an MoE layer's expert projections add an expert
# axis: A [slots, max_rank, E, in], B [slots, E, out, max_rank] (ranks stay on dim 1 of A, last in B)
SlotTensors = tuple[torch.Tensor, torch.Tensor]
Targets = tuple[tuple[int, str], ...]  # (layer, projection) of each part of an adapter

# Plans kept per slot, least recently used out. A plan holds ~670 views (~0.4 MB for Llama-3-8B);
# a deployment's adapters come in a few (rank, targets) shapes, so a handful per slot hits nearly
# always while bounding the memory however many shapes turn up.
_PLANS_PER_SLOT = 4


@dataclass(slots=True)
class Upload:
    """A copy in flight; holds the host buffer and device staging copy until it has landed."""

    slot: int
    adapter: HostAdapter
    event: torch.cuda.Event | None  # None: already complete (CPU)
    staging: torch.Tensor | None

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


@dataclass(frozen=True, slots=True)
class _SlotPlan:
    """Where adapters of one rank and one set of targets land in one slot: the views the writer copies
    into and zeroes. Built on first use and kept (the slot tensors never move): building ~900 views
    per write was most of a write's engine-thread time."""

    a: list[torch.Tensor]  # per dense part: A[slot, :rank] flattened [rank * in]
    b: list[torch.Tensor]  # per dense part: the whole B[slot] flattened [out * max_rank], written zero-padded
    b_sizes: list[int]  # out * max_rank per dense part: the padded Bs' segments
    experts: list[tuple[torch.Tensor, torch.Tensor]]  # per expert part: (A[slot, :rank], B[slot, ..., :rank])
    tails: list[torch.Tensor]  # past `rank`: A of dense parts, A and B of expert parts (a higher-rank occupant's)
    untargeted: list[torch.Tensor]  # the whole A and B of every projection the targets leave alone


class SlotWriter:
    def __init__(self, model: CausalLM) -> None:
        self._model = model
        self._targets: dict[tuple[int, str], SlotTensors] = {}
        for layer_index, layer in enumerate(model.model.layers):
            for linear in layer.lora_linears():
                for name, a, b in zip(linear.projections, linear.lora_a, linear.lora_b, strict=True):
                    self._targets[(layer_index, name)] = (a, b)
            if isinstance(layer.mlp, MoEBlock):
                for name, views in layer.mlp.lora_slot_views().items():
                    self._targets[(layer_index, name)] = views
        self.device = model.slot_ranks.device
        self._max_rank = model.max_lora_rank
        self._plans: OrderedDict[tuple[int, int, int, Targets], _SlotPlan] = OrderedDict()
        self._max_plans = _PLANS_PER_SLOT * model.max_loras
        # per slot: (rank, targets) of the last write; only ranks [0, rank) of those targets may hold
        # nonzero entries. The model may have been given weights by other means before, so every slot
        # starts fully suspect (None: any projection)
        self._written: list[tuple[int, Targets | None]] = [(model.max_lora_rank, None)] * model.max_loras
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def write(self, slot: int, adapter: HostAdapter) -> Upload:
        """Queue the copy of `adapter` into `slot` (which no request may read until the upload is done)."""
        if adapter.rank > self._model.max_lora_rank:
            raise ValueError(f"adapter rank {adapter.rank} exceeds max_lora_rank {self._model.max_lora_rank}")
        if self._stream is None:
            self._copy(slot, adapter, adapter.buffer)
            return Upload(slot, adapter, None, None)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            staging = adapter.buffer.to(self.device, non_blocking=True)  # the one host-to-device transfer
            self._copy(slot, adapter, staging)
            event = torch.cuda.Event()
            event.record(self._stream)
        return Upload(slot, adapter, event, staging)

    @torch.no_grad()
    def _copy(self, slot: int, adapter: HostAdapter, source: torch.Tensor) -> None:
        rank, layout = adapter.rank, adapter.layout
        plan = self._plan(slot, adapter)
        written_rank, written_targets = self._written[slot]
        # fully suspect until this write is queued whole: one failing midway leaves part of it in the slot
        self._written[slot] = (self._max_rank, None)
        zeroed = plan.untargeted if written_targets != layout.targets else []
        if written_rank > rank:
            zeroed = zeroed + plan.tails
        if zeroed:
            torch._foreach_zero_(zeroed)
        if plan.a:  # multi-tensor copies: a few launches for all dense parts
            a_sources, b_sources = layout.split(source)
            if rank < self._max_rank:
                b_sources = self._padded(b_sources, rank, plan.b_sizes)
            torch._foreach_copy_(plan.a, a_sources)
            torch._foreach_copy_(plan.b, b_sources)
        if plan.experts:
            sources = [view(part, source) for part in layout.experts for view in (adapter.a, adapter.b)]
            torch._foreach_copy_([d for pair in plan.experts for d in pair], sources)
        self._model.slot_ranks[slot] = rank
        self._model.slot_scales[slot] = adapter.scaling
        self._written[slot] = (rank, layout.targets)

    def bookkeeping_size(self) -> int:
        """Plans held: at most _PLANS_PER_SLOT times the slots, however many adapter shapes were written."""
        return len(self._plans)

    def _plan(self, slot: int, adapter: HostAdapter) -> _SlotPlan:
        layout = adapter.layout
        key = (slot, adapter.rank, len(layout.experts), layout.targets)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(slot, adapter.rank, layout.targets, len(layout.experts))
            if len(self._plans) > self._max_plans:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def _make_plan(self, slot: int, rank: int, targets: Targets, experts: int) -> _SlotPlan:
        """The plan for `targets` (the dense parts', then `experts` expert parts') at `rank`."""
        unknown = [key for key in targets if key not in self._targets]
        if unknown:
            raise ValueError(f"adapter targets modules this model does not have: {unknown[:3]}")
        plan = _SlotPlan([], [], [], [], [], [])
        for index, key in enumerate(targets):
            a_slots, b_slots = self._targets[key]
            if self._is_dense(b_slots) != (index < len(targets) - experts):
                raise ValueError(f"adapter part {key} does not have the shape of this model's slots for it")
            if index < len(targets) - experts:
                plan.a.append(a_slots[slot, :rank].view(-1))
                plan.b.append(b_slots[slot].view(-1))
                plan.b_sizes.append(plan.b[-1].numel())
                plan.tails.append(a_slots[slot, rank:].view(-1))
            else:
                plan.experts.append((a_slots[slot, :rank], b_slots[slot, ..., :rank]))
                plan.tails.extend((a_slots[slot, rank:], b_slots[slot, ..., rank:]))
        for key in self._targets.keys() - set(targets):
            plan.untargeted.extend(slots[slot] for slots in self._targets[key])
        return plan

    def _is_dense(self, b_slots: torch.Tensor) -> bool:
        """Whether a projection's slot B is one dense projection's, [slots, out, max_rank] (an expert
        view has an expert axis)."""
        return b_slots.dim() == 3 and b_slots.is_contiguous() and b_slots.shape[2] == self._max_rank

    def _padded(self, b_sources: list[torch.Tensor], rank: int, sizes: list[int]) -> list[torch.Tensor]:
        """Flat Bs [out * rank] → the same Bs zero-padded to [out * max_rank], flat, so their copies
        into the slot are dense and also zero whatever a previous adapter left past `rank`. Writing
        only the first `rank` columns of each slot B would be a strided copy, one launch per tensor;
        instead every B is padded in one device buffer: a cat and a pad."""
        stacked = torch.cat(b_sources).view(-1, rank)  # [sum out, rank]
        padded = torch.nn.functional.pad(stacked, (0, self._max_rank - rank))  # [sum out, max_rank]
        return list(padded.view(-1).split_with_sizes(sizes))
