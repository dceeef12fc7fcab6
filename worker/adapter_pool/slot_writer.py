"""Host → device: copies a packed host adapter into one of the model's LoRA slots. The one module
of the adapter pool that touches CUDA streams.

On CUDA the copy runs on a side stream, so it overlaps the steps the engine keeps running: one
host-to-device transfer of the packed buffer, then device-side scatters into the slot's rows, then
an event the pool polls before it lets any request use the slot. Before writing, the side stream
waits for the work already queued on the main stream, which may still read the evicted adapter.
On CPU the same code runs synchronously.

No leak from an evicted adapter: kernels and the reference apply only the first `slot_ranks[s]`
ranks of a slot, and on top of that every entry the previous occupant may have written past the
new adapter's rank, or in projections the new adapter leaves alone, is zeroed here. So a slot's
contents past its current adapter are always zero, whatever path reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.adapter_pool.host_adapter import HostAdapter
from worker.engine.model import CausalLM
from worker.engine.moe import MoEBlock

# (A [slots, max_rank, in], B [slots, out, max_rank]); an MoE layer's expert projections add an expert
# axis: A [slots, max_rank, E, in], B [slots, E, out, max_rank] (ranks stay on dim 1 of A, last in B)
SlotTensors = tuple[torch.Tensor, torch.Tensor]


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
        # per slot: ranks [0, written_rank) may hold nonzero entries (of any projection); the model
        # may have been given weights by other means before, so every slot starts fully suspect
        self._written_rank = [model.max_lora_rank] * model.max_loras
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
        rank, stale = adapter.rank, self._written_rank[slot]
        parts = {(part.layer, part.projection): part for part in adapter.parts}
        unknown = sorted(set(parts) - set(self._targets))
        if unknown:
            raise ValueError(f"adapter targets modules this model does not have: {unknown[:3]}")
        a_pairs, b_pairs, zeroed = [], [], []  # (destination, source); destinations to zero
        dense_b: list[tuple[torch.Tensor, torch.Tensor]] = []  # (B [out, max_rank] of the slot, B [out, r])
        for key, (a_slots, b_slots) in self._targets.items():
            part = parts.get(key)
            whole_b = b_slots[slot]
            # a projection's whole B [out, max_rank] (expert views have more axes or part of the ranks)
            dense = whole_b.dim() == 2 and whole_b.is_contiguous() and whole_b.shape[1] == self._model.max_lora_rank
            if part is None:
                if stale:
                    zeroed += [a_slots[slot, :stale], whole_b if dense else b_slots[slot, ..., :stale]]
                continue
            a_pairs.append((a_slots[slot, :rank], adapter.a(part, source)))
            if dense:
                dense_b.append((whole_b, adapter.b(part, source)))  # its columns past `rank` are rewritten as zeros
            else:
                b_pairs.append((b_slots[slot, ..., :rank], adapter.b(part, source)))
            if stale > rank:
                zeroed.append(a_slots[slot, rank:stale])
                if not dense:
                    zeroed.append(b_slots[slot, ..., rank:stale])
        if zeroed:
            torch._foreach_zero_(zeroed)
        b_pairs += self._padded_b(dense_b, rank)
        # multi-tensor copies: a few launches for all dense pairs (the A rows; B padded to the slot rank)
        for pairs in (a_pairs, b_pairs):
            if pairs:
                destinations, sources = zip(*pairs, strict=True)
                torch._foreach_copy_(list(destinations), list(sources))
        self._model.slot_ranks[slot] = rank
        self._model.slot_scales[slot] = adapter.scaling
        self._written_rank[slot] = rank

    def _padded_b(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], rank: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(slot B [out, max_rank], B [out, rank]) pairs → (slot B, B zero-padded to max_rank) pairs whose
        copies are dense. Writing only the first `rank` columns of each slot B would be a strided copy,
        one launch per tensor; instead every B is padded in one device buffer (a cat, a zero fill and
        one strided copy), which also zeroes whatever a previous adapter left past `rank`."""
        if not pairs or rank == self._model.max_lora_rank:
            return pairs
        stacked = torch.cat([b for _, b in pairs])  # [sum out, rank]
        padded = stacked.new_zeros(stacked.shape[0], self._model.max_lora_rank)
        padded[:, :rank] = stacked
        rows = [destination.shape[0] for destination, _ in pairs]
        return list(zip([destination for destination, _ in pairs], padded.split(rows), strict=True))
