"""CUDA graphs for the steps that are not pure decode: prefill chunks, alone or beside decodes.

Such a step cannot replay a whole-step graph: attention's grid and work depend on how its tokens
split into sequences, which varies from step to step. Everything else in a decoder layer works
token by token (norms, projections and their LoRA updates, RoPE and the K/V write, the MLP or the
experts), so it depends only on the step's token count. Those parts are captured, per layer and
for a ladder of token counts, and attention runs eagerly between them (piecewise capture):

    piece 0     embedding, RoPE cos/sin, the LoRA metadata, layer 0 up to attention → q
    attention   layer 0's paged attention over the cache, eager, into the static `attended`
    piece i     layer i-1 after attention, then layer i up to attention → q        (1 ≤ i < L)
    piece L     layer L-1 after attention → hidden
    tail        add + norm of the rows whose logits are wanted, lm_head: eager, per sequence

An eager step of an 8B model launches ~1,000 kernels (more with LoRA: a shrink and an expand per
projection and the stream fork and join around them) and is bound by the host; this one launches
L + 1 graphs and L attention kernels.

A step of T tokens replays the pieces captured for the smallest bucket b >= T. Rows T..b-1 are
padding: their K/V go to the scratch block (one block past those the block manager hands out),
they use no adapter, and since every captured operation is row-wise they never touch a real row;
attention and the tail read only the first T rows. The pieces of a bucket share state through
static buffers (the residual stream, q, attended, the last hidden) and through the RoPE table and
LoRA metadata piece 0 builds, which stay allocated for the bucket's life.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from kernels.lora import LoRABatch
from worker.engine.capture_pacer import CapturePacer
from worker.engine.cuda_graphs import capture, capture_session, lora_variants, pace, warm_up_cache
from worker.model.attention import paged_attention
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache
from worker.model.model import CausalLM

log = structlog.get_logger(__name__)

# Steps of more tokens run eagerly: their GEMMs outlast their launches, so a graph would gain them
# little, while each bucket would cost captures and the pool the activations of its largest piece.
PIECEWISE_MAX_TOKENS = 2048


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 48, 64, 96, 128, then every 32 to 256, every 64 to 512, every 128 past it, capped by
    and always including max_tokens: padding wastes at most a fifth of a step's rows past 64 (a
    large step's time is its tokens' arithmetic, so the ladder is finer where steps are large)."""
    sizes = [16, 32, 48, 64, 96]
    steps = ((256, 32), (512, 64))
    size = 128
    while size < max_tokens:
        sizes.append(size)
        size += next((step for limit, step in steps if size < limit), 128)
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


@dataclass(slots=True)
class PieceState:
    """What piece 0 builds for the others: the RoPE table and (with_lora) the LoRA metadata of the
    step's rows, from the static token-slot buffer over the model's slot tensors."""

    with_lora: bool
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [b, head_dim]
    lora: LoRABatch | None = None


class StepPieces:
    """The pieces of a step and the static buffers they share, device-agnostic: PiecewiseGraphs
    replays them from graphs; `run` with each piece called directly is the same step, eagerly."""

    def __init__(self, model: CausalLM, max_tokens: int, scratch_slot: int) -> None:
        """Static buffers for up to `max_tokens` tokens on the model's device; padding rows write
        their K/V at `scratch_slot` (a flat cache slot no sequence owns)."""
        info, stack = model.local_info, model.model  # a tensor-parallel rank's heads
        self.model = model
        self.num_layers = info.num_layers
        self.max_tokens = max_tokens
        self.scratch_slot = scratch_slot
        device, dtype = model.slot_ranks.device, model.dtype
        heads = (info.num_heads, info.head_dim)
        with torch.inference_mode():
            self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
            self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
            self.slot_mapping = torch.full((max_tokens,), scratch_slot, dtype=torch.int64, device=device)
            self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
            self.residual = torch.zeros(max_tokens, info.hidden_size, dtype=dtype, device=device)
            self.hidden = torch.zeros(max_tokens, info.hidden_size, dtype=dtype, device=device)
            self.q = torch.zeros(max_tokens, *heads, dtype=dtype, device=device)
            self.attended = torch.zeros(max_tokens, *heads, dtype=dtype, device=device)
        self._scale = stack.layers[0].self_attn.scale

    def piece(self, index: int, size: int, state: PieceState, kv_cache: KVCache) -> None:
        """Piece `index` (0..num_layers) over the first `size` rows of the static buffers; piece 0
        fills `state`."""
        stack = self.model.model
        residual = self.residual[:size]
        if index == 0:
            hidden = stack.embed_tokens(self.input_ids[:size])
            state.rope = stack.rotary_emb.cos_sin(self.positions[:size], hidden.dtype)
            if state.with_lora:
                model = self.model
                state.lora = LoRABatch.build(
                    self.token_slots[:size], model.slot_ranks, model.slot_scales, model.slot_pages
                )
            residual.copy_(hidden)  # the first block's residual stream is its input
            stream_in: torch.Tensor | None = None
        else:
            hidden, stream_in = stack.layers[index - 1].attention_output(self.attended[:size], residual, state.lora)
        if index == self.num_layers:
            self.hidden[:size].copy_(hidden)
            self._keep(residual, stream_in)
            return
        layer = stack.layers[index]
        q, stream_out = layer.attention_input(
            residual if index == 0 else hidden,
            stream_in,
            state.rope,
            self.slot_mapping[:size],
            state.lora,
            kv_cache.key[index],
            kv_cache.value[index],
        )
        self.q[:size].copy_(q)
        self._keep(residual, stream_out)

    @staticmethod
    def _keep(residual: torch.Tensor, stream: torch.Tensor | None) -> None:
        """Leave the residual stream in the static buffer: on CUDA the fused norms update it in place
        (the stream is that buffer already); the CPU references return a new tensor."""
        if stream is not None and stream.data_ptr() != residual.data_ptr():
            residual.copy_(stream)

    def stage(self, batch: ForwardBatch, token_slots: torch.Tensor | None, size: int) -> None:
        """The step's per-token inputs into the first rows of the static buffers, padding up to `size`."""
        n = batch.num_tokens
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.slot_mapping[n:size].fill_(self.scratch_slot)
        if token_slots is not None:
            self.token_slots[:n].copy_(token_slots)
            self.token_slots[n:size].fill_(-1)

    def run(
        self,
        batch: ForwardBatch,
        token_slots: torch.Tensor | None,
        size: int,
        kv_cache: KVCache,
        run_piece: Callable[[int], None],
    ) -> torch.Tensor:
        """One step: logits float32 [B, vocab] for the tokens at batch.logits_indices. `run_piece(i)`
        runs piece i over `size` rows (a graph replay, or the piece itself); attention and the tail
        run here, over the step's real rows."""
        n = batch.num_tokens
        self.stage(batch, token_slots, size)
        run_piece(0)
        for index, layer in enumerate(self.model.model.layers):
            scales = layer.self_attn.kv_scales
            paged_attention(
                self.q[:n], kv_cache.key[index], kv_cache.value[index], batch, self._scale, scales, self.attended[:n]
            )
            run_piece(index + 1)
        stack, wanted = self.model.model, batch.logits_indices
        # advanced indexing copies the rows, so the norm's in-place sum leaves the static stream alone
        normed = stack.norm.add_and_norm(self.hidden[wanted], self.residual[wanted])[0]
        return self.model.lm_head.logits(normed)


class PiecewiseGraphs:
    """The pieces of every bucket captured as CUDA graphs, two variants per bucket (base-only, and
    with LoRA metadata built inside piece 0 from the static token slots, over the model's slot
    tensors, which adapter loads update in place; a model without LoRA has the first only)."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        *,
        max_tokens: int,
        pool: tuple[int, int],
        pacer: CapturePacer | None = None,
    ) -> None:
        """Capture pieces for steps of up to `max_tokens` tokens, their memory from `pool`, paced by
        `pacer` when a model serves beside. The cache's last block is the padding rows' scratch."""
        self.kv_cache = kv_cache
        self.sizes = token_buckets(max_tokens)
        scratch_block = kv_cache.key[0].shape[0] - 1
        self.pieces = StepPieces(model, max_tokens, scratch_slot=scratch_block * kv_cache.block_size)
        self._graphs: dict[tuple[int, bool], list[torch.cuda.CUDAGraph]] = {}
        self._states: dict[tuple[int, bool], PieceState] = {}  # keeps each bucket's RoPE and LoRA tensors
        self._capture_all(pool, pacer)

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def release(self) -> None:
        """Destroy every graph now: see ModelRunner.release_graphs. The object is not run after."""
        for graphs in self._graphs.values():
            for graph in graphs:
                graph.reset()
        self._graphs.clear()

    def run(self, batch: ForwardBatch, token_slots: torch.Tensor | None) -> torch.Tensor:
        """Logits float32 [B, vocab] of one step of batch.num_tokens <= max_tokens tokens; token_slots
        int32 [T] (adapter slot per token, -1 for the base model) or None when no token has one."""
        size = next(s for s in self.sizes if s >= batch.num_tokens)
        graphs = self._graphs[size, token_slots is not None]
        with torch.inference_mode():
            return self.pieces.run(batch, token_slots, size, self.kv_cache, lambda index: graphs[index].replay())

    def _capture_all(self, pool: tuple[int, int], pacer: CapturePacer | None) -> None:
        """Per bucket (largest first, as DecodeGraphs) and variant: every piece once eagerly on a
        warm-up cache of its own, then each piece captured, in order, over the real cache; paced
        (a pause before the warm-up and before each piece's capture) when `pacer` is given."""
        pieces = self.pieces
        warm_cache = warm_up_cache(self.kv_cache)
        with capture_session(self.kv_cache.key[0].device, pacer) as stream:
            pieces.slot_mapping.fill_(0)  # the warm-up cache's first slot
            for size in reversed(self.sizes):
                for with_lora in lora_variants(pieces.model):
                    pace(pacer, "piece warm-up")
                    warm_state = PieceState(with_lora)
                    for index in range(pieces.num_layers + 1):
                        pieces.piece(index, size, warm_state, warm_cache)
                    stream.synchronize()
                    state = PieceState(with_lora)
                    self._states[size, with_lora] = state
                    graphs = self._graphs[size, with_lora] = []
                    for index in range(pieces.num_layers + 1):
                        pace(pacer, "piece capture")
                        piece = functools.partial(pieces.piece, index, size, state, self.kv_cache)
                        graphs.append(capture(piece, pool, pacer))
            pieces.slot_mapping.fill_(pieces.scratch_slot)
        log.info("piecewise_graphs_captured", sizes=self.sizes, graphs=sum(map(len, self._graphs.values())))
