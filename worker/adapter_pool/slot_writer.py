"""Host → device: copies a packed host adapter into its pages of the model's LoRA pool. The one
module of the adapter pool that touches CUDA streams.

On CUDA the copy runs on a side stream, so it overlaps the steps the engine keeps running: one
host-to-device transfer of the packed buffer into the writer's staging buffer (one per writer,
grown to the largest adapter; uploads follow each other on the side stream, so a write never
overwrites what an earlier one has yet to scatter), then device-side scatters into the pages' rows, then
the slot's page table, rank and scale, then an event the pool polls before it lets any request use
the slot. Before writing, the side stream waits for the steps that may still read the pages'
evicted adapters: the pool hands over, per evicted adapter, the event recorded after the last step
launched with it (`read_marker`), so an upload into pages nobody read lately starts at once rather
than behind every step queued on the main stream (two steps, with the engine's host/device
overlap). On CPU the same code runs synchronously.

A write runs on the engine thread, so its host cost is kept to a few calls whatever the number of
projections: the views it copies into are built once per page and adapter shape (`_PagePlan`), the
views it copies from once per buffer layout (host_adapter.BufferLayout: adapters saved alike share
one) over the staging buffer, which never moves, and the copies are multi-tensor ones (a few
launches for all 224 projections of Llama-3-8B): cutting the staged copy into its views on every
write cost the engine thread more than half the copy's own time (docs/benchmarks.md, "Adapter pool").

No leak from an evicted adapter: kernels and the reference apply only the first `slot_ranks[s]`
ranks of a slot, and on top of that every entry a page's previous occupant may have written past
the new adapter's rows in it, or in projections the new adapter leaves alone, is zeroed here. So a
page's contents past its current adapter are always zero, whatever path reads them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.model_info import PROJECTIONS, ModelInfo
from worker.adapter_pool.host_adapter import BufferLayout, HostAdapter, max_adapter_bytes
from worker.adapter_pool.peft_adapter import ATTENTION_PROJECTIONS
from worker.model.lora_linear import LoRAPages
from worker.model.model import CausalLM
from worker.model.moe import MoEBlock

# (A [pages, page_rank, in], B [pages, out, page_rank]); an MoE layer's expert projections add an
# expert axis: A [pages, page_rank, E, in], B [pages, E, out, page_rank] (ranks on dim 1 of A, last in
# B). MoE models have one page of the whole max rank per adapter, so expert parts fill a single page.
PageTensors = tuple[torch.Tensor, torch.Tensor]
Targets = tuple[tuple[int, str], ...]  # (layer, projection) of each part of an adapter
# views of the writer's buffers for one buffer layout: (A sources, B sources, the staged Bs to re-lay
# into the B sources first; empty when the Bs are their own sources)
_Sources = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]

# Source views kept per buffer layout (and page count), least recently used out: a deployment's
# adapter files come in a few layouts.
_SOURCE_LAYOUTS = 8
# Plans kept per page, least recently used out. A plan holds ~670 views (~0.4 MB for Llama-3-8B);
# a deployment's adapters come in a few (rank, targets) shapes, so a couple per page hit nearly
# always while bounding the memory however many shapes turn up.
_PLANS_PER_PAGE = 2


def buffer_bytes(info: ModelInfo, pages: LoRAPages, *, max_lora_rank: int, dtype: torch.dtype) -> int:
    """The most a writer's device buffers grow to (the memory plan budgets it): the staged copy of the
    largest adapter the pool accepts, and its dense projections' Bs re-laid into page blocks (every
    dense projection's output rows, over the pages of one max-rank adapter)."""
    dense_layers = info.num_layers - len(info.moe_layers)
    out_rows = dense_layers * sum(info.projection_shape(p)[1] for p in PROJECTIONS)
    out_rows += len(info.moe_layers) * sum(info.projection_shape(p)[1] for p in ATTENTION_PROJECTIONS)
    relaid = pages.pages_per_slot * pages.page_rank * out_rows * dtype.itemsize
    return max_adapter_bytes(info, max_rank=max_lora_rank, dtype=dtype) + relaid


@dataclass(slots=True)
class Upload:
    """A copy in flight; holds the host buffer until it has landed."""

    slot: int  # the adapter's first page
    adapter: HostAdapter
    event: torch.cuda.Event | None  # None: already complete (CPU)

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


@dataclass(frozen=True, slots=True)
class _PagePlan:
    """Where `rows` rank rows of adapters with one set of targets land in one page: the views the
    writer copies into and zeroes. Built on first use and kept (the page tensors never move):
    building ~900 views per write was most of a write's engine-thread time."""

    a: list[torch.Tensor]  # per dense part: A[page, :rows] flattened [rows * in]
    b: list[torch.Tensor]  # per dense part: the whole B[page] flattened [out * page_rank], written zero-padded
    experts: list[tuple[torch.Tensor, torch.Tensor]]  # per expert part: (A[page, :rows], B[page, ..., :rows])
    tails: list[torch.Tensor]  # past `rows`: A of dense parts, A and B of expert parts (a higher-rank occupant's)
    untargeted: list[torch.Tensor]  # the whole A and B of every projection the targets leave alone


class SlotWriter:
    def __init__(self, model: CausalLM) -> None:
        self._model = model
        self._targets: dict[tuple[int, str], PageTensors] = {}
        for layer_index, layer in enumerate(model.model.layers):
            for linear in layer.lora_linears():
                for name, a, b in zip(linear.projections, linear.lora_a, linear.lora_b, strict=True):
                    self._targets[(layer_index, name)] = (a, b)
            if isinstance(layer.mlp, MoEBlock):
                for name, views in layer.mlp.lora_slot_views().items():
                    self._targets[(layer_index, name)] = views
        self.device = model.slot_ranks.device
        self._page_rank = model.page_rank
        self._plans: OrderedDict[tuple[int, int, int, Targets], _PagePlan] = OrderedDict()
        self._max_plans = _PLANS_PER_PAGE * model.num_pages
        # per page: (rows, targets) of the last write; only rows [0, rows) of those targets may hold
        # nonzero entries. The model may have been given weights by other means before, so every page
        # starts fully suspect (None: any projection)
        self._written: list[tuple[int, Targets | None]] = [(model.page_rank, None)] * model.num_pages
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # device buffers written on the side stream only: the staged adapter, and Bs re-laid into
        # page blocks (adapters of several pages); the source views cut from them, per layout
        self._staging = torch.empty(0, dtype=model.dtype, device=self.device)
        self._relaid = torch.empty(0, dtype=model.dtype, device=self.device)
        self._sources: OrderedDict[tuple[BufferLayout, int], _Sources] = OrderedDict()

    def read_marker(self) -> torch.cuda.Event | None:
        """An event after the work queued so far on the current stream (None on CPU): recorded after a
        step is launched, it is what an upload into pages that step reads must wait for."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def write(self, pages: tuple[int, ...], adapter: HostAdapter, after: Sequence[torch.cuda.Event] = ()) -> Upload:
        """Queue the copy of `adapter` into `pages` (its own, in rank order; no request may read its
        slot, pages[0], until the upload is done), once the work marked by `after` is done: every
        step that may still read those pages (read_marker events of their previous occupants)."""
        if len(pages) != self._model.pages_for_rank(adapter.rank):
            raise ValueError(f"an adapter of rank {adapter.rank} cannot take pages {list(pages)}")
        if self._stream is None:
            self._copy(pages, adapter)
            return Upload(pages[0], adapter, None)
        for event in after:
            self._stream.wait_event(event)
        with torch.cuda.stream(self._stream):
            self._copy(pages, adapter)
            event = torch.cuda.Event()
            event.record(self._stream)
        return Upload(pages[0], adapter, event)

    @torch.no_grad()
    def _copy(self, pages: tuple[int, ...], adapter: HostAdapter) -> None:
        rank, layout, page_rank = adapter.rank, adapter.layout, self._page_rank
        numel = adapter.buffer.numel()
        if self._staging.numel() < numel:
            self._staging = torch.empty(numel, dtype=self._staging.dtype, device=self.device)
            self._sources.clear()  # views of the buffer given up
        source = self._staging[:numel]
        source.copy_(adapter.buffer, non_blocking=True)  # the one host-to-device transfer
        rows = [min(page_rank, rank - index * page_rank) for index in range(len(pages))]
        plans = [self._plan(page, page_rows, adapter) for page, page_rows in zip(pages, rows, strict=True)]
        zeroed: list[torch.Tensor] = []
        for page, page_rows, plan in zip(pages, rows, plans, strict=True):
            written_rows, written_targets = self._written[page]
            # fully suspect until this write is queued whole: one failing midway leaves part of it in the page
            self._written[page] = (page_rank, None)
            if written_targets != layout.targets:
                zeroed += plan.untargeted
            if written_rows > page_rows:
                zeroed += plan.tails
        if zeroed:
            torch._foreach_zero_(zeroed)
        if plans[0].a:  # multi-tensor copies: a few launches for all dense parts of all pages
            a_sources, b_sources = self._source_views(layout, rank, len(pages))
            if len(pages) > 1:  # the A sources are each part's pages' row blocks, in page order
                a_destinations = [plan.a[part] for part in range(len(plans[0].a)) for plan in plans]
            else:
                a_destinations = plans[0].a
            torch._foreach_copy_(a_destinations, a_sources)
            torch._foreach_copy_([b for plan in plans for b in plan.b], b_sources)
        if plans[0].experts:
            sources = [view(part, source) for part in layout.experts for view in (adapter.a, adapter.b)]
            torch._foreach_copy_([d for pair in plans[0].experts for d in pair], sources)
        self._model.set_slot(pages[0], pages, rank, adapter.scaling)
        for page, page_rows in zip(pages, rows, strict=True):
            self._written[page] = (page_rows, layout.targets)

    def bookkeeping_size(self) -> int:
        """Plans held: at most _PLANS_PER_PAGE times the pages, however many adapter shapes were written."""
        return len(self._plans)

    def _plan(self, page: int, rows: int, adapter: HostAdapter) -> _PagePlan:
        layout = adapter.layout
        key = (page, rows, len(layout.experts), layout.targets)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(page, rows, layout.targets, len(layout.experts))
            if len(self._plans) > self._max_plans:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def _make_plan(self, page: int, rows: int, targets: Targets, experts: int) -> _PagePlan:
        """The plan for `targets` (the dense parts', then `experts` expert parts') at `rows`."""
        unknown = [key for key in targets if key not in self._targets]
        if unknown:
            raise ValueError(f"adapter targets modules this model does not have: {unknown[:3]}")
        plan = _PagePlan([], [], [], [], [])
        for index, key in enumerate(targets):
            a_pages, b_pages = self._targets[key]
            if self._is_dense(b_pages) != (index < len(targets) - experts):
                raise ValueError(f"adapter part {key} does not have the shape of this model's pages for it")
            if index < len(targets) - experts:
                plan.a.append(a_pages[page, :rows].view(-1))
                plan.b.append(b_pages[page].view(-1))
                plan.tails.append(a_pages[page, rows:].view(-1))
            else:
                plan.experts.append((a_pages[page, :rows], b_pages[page, ..., :rows]))
                plan.tails.extend((a_pages[page, rows:], b_pages[page, ..., rows:]))
        for key in self._targets.keys() - set(targets):
            plan.untargeted.extend(pages[page] for pages in self._targets[key])
        return plan

    def _is_dense(self, b_pages: torch.Tensor) -> bool:
        """Whether a projection's page B is one dense projection's, [pages, out, page_rank] (an expert
        view has an expert axis)."""
        return b_pages.dim() == 3 and b_pages.is_contiguous() and b_pages.shape[2] == self._page_rank

    def _source_views(
        self, layout: BufferLayout, rank: int, num_pages: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(A sources, B sources) of the adapter just staged, in the order of the destinations: one A
        view per dense part and page (its row block of that page), and one B view per page and
        dense part (its B zero-padded past `rank` into the page's columns). Unless the adapter fills
        one page exactly, the Bs are re-laid into page blocks first: a cat, a pad and one permuted
        copy into `_relaid`."""
        key = (layout, num_pages)
        views = self._sources.get(key)
        if views is None:
            views = self._sources[key] = self._cut_sources(layout, rank, num_pages)
            if len(self._sources) > _SOURCE_LAYOUTS:
                self._sources.popitem(last=False)
        else:
            self._sources.move_to_end(key)
        a_views, b_views, staged_b = views
        if staged_b:
            stacked = torch.cat(staged_b).view(-1, rank)  # [sum out, rank]
            width = num_pages * self._page_rank
            padded = stacked if width == rank else torch.nn.functional.pad(stacked, (0, width - rank))
            relaid = self._relaid[: padded.numel()].view(num_pages, -1, self._page_rank)
            relaid.copy_(padded.view(-1, num_pages, self._page_rank).transpose(0, 1))
        return a_views, b_views

    def _cut_sources(self, layout: BufferLayout, rank: int, num_pages: int) -> _Sources:
        page_rank = self._page_rank
        a_views, b_views = layout.split(self._staging[: sum(layout.sizes)])
        if num_pages > 1:
            a_views = [chunk for a in a_views for chunk in a.split(page_rank * (a.numel() // rank))]
        if rank == page_rank:  # one page filled exactly: each B [out, rank] is its page block
            return a_views, b_views, []
        sizes = [b.numel() // rank * page_rank for b in b_views]
        if self._relaid.numel() < num_pages * sum(sizes):
            self._relaid = torch.empty(num_pages * sum(sizes), dtype=self._relaid.dtype, device=self.device)
            self._sources.clear()
        relaid = self._relaid[: num_pages * sum(sizes)].view(num_pages, -1)
        return a_views, [block for page in relaid for block in page.split_with_sizes(sizes)], b_views
