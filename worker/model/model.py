"""The decoder-only causal LM (Llama / Mistral / Qwen2) as the engine runs it: one forward over a flat
token batch with a paged KV cache, and per-token adapters from a paged LoRA pool.

Parameter names mirror the HF checkpoint (`model.layers.3.self_attn.qkv_proj.weight` is filled from
`…q_proj.weight`, `…k_proj.weight` and `…v_proj.weight`), so loading is a walk over named modules.
The model is built directly on its device and is not meant to be moved afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path

import torch
from torch import nn

from shared.model_info import PROJECTIONS, ModelInfo
from worker.adapter_pool.peft_adapter import AdapterWeights
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache
from worker.model.layers import DecoderLayer, RMSNorm, VocabEmbedding
from worker.model.lora_linear import PAGE_RANK, LoRALinear, LoRAPages
from worker.model.moe import MoEBlock
from worker.model.rope import RotaryEmbedding
from worker.model.weights import TensorLoader, copy_weight, load_checkpoint, load_tensors


def resolve_dtype(dtype: torch.dtype | str | None, info: ModelInfo) -> torch.dtype:
    """The dtype weights run in: `dtype` if given (a torch dtype or its name), else the checkpoint's."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        name = info.torch_dtype if dtype is None else dtype
        resolved = getattr(torch, name, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype {name!r} is not a torch dtype")
    if not resolved.is_floating_point:
        raise ValueError(f"dtype {resolved} is not a floating-point dtype")
    return resolved


class DecoderStack(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.*`)."""

    def __init__(self, info: ModelInfo, *, pages: LoRAPages, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(info.vocab_size, info.hidden_size, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(info.head_dim, info.rope_theta, info.rope_scaling, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(info, layer_index=index, pages=pages, dtype=dtype, device=device)
            for index in range(info.num_layers)
        )
        self.norm = RMSNorm(info.hidden_size, info.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Final hidden states [B, hidden_size] of the tokens at `batch.logits_indices`."""
        hidden = self.embed_tokens(batch.input_ids)  # [T, hidden_size]
        rope = self.rotary_emb.cos_sin(batch.positions, hidden.dtype)  # once per step, shared by all layers
        residual = None
        for layer, key_cache, value_cache in zip(self.layers, kv_cache.key, kv_cache.value, strict=True):
            hidden, residual = layer(hidden, residual, rope, batch, key_cache, value_cache)
        # the norm is per token: add the last residual and normalise only the rows whose logits are wanted
        wanted = batch.logits_indices
        return self.norm.add_and_norm(hidden[wanted], residual[wanted])[0]


class CausalLM(nn.Module):
    def __init__(
        self,
        info: ModelInfo,
        *,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """Allocate the model with uninitialised weights (fill them with `load_weights`) and an empty
        LoRA pool as large as `max_loras` adapters of rank `max_lora_rank`. dtype None: the checkpoint's.

        The pool is paged (S-LoRA's unified paging): pages of PAGE_RANK rank rows for every adapted
        projection of every layer, so adapters of lower rank take fewer pages and more of them fit,
        up to one per page. An adapter's slot (its index into the per-slot tensors below) is the
        index of its first page. MoE models, whose expert buffers are not paged, and pools of rank
        <= PAGE_RANK get one page of the whole max rank per adapter: slots are then pages."""
        super().__init__()
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        self.info = info
        self.dtype = resolve_dtype(dtype, info)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.page_rank = max_lora_rank if info.is_moe or max_lora_rank <= PAGE_RANK else PAGE_RANK
        self.pages_per_slot = -(-max_lora_rank // self.page_rank)
        self.num_pages = max_loras * self.pages_per_slot
        self.num_slots = self.num_pages
        pages = LoRAPages(num_pages=self.num_pages, page_rank=self.page_rank)
        self.model = DecoderStack(info, pages=pages, dtype=self.dtype, device=device)
        self.lm_head = (
            self.model.embed_tokens
            if info.tie_word_embeddings
            else VocabEmbedding(info.vocab_size, info.hidden_size, dtype=self.dtype, device=device)
        )
        # per-slot adapter metadata for LoRABatch.build: rank 0 / scale 0 mark an empty slot; a slot's
        # row of slot_pages lists its pages in rank order (entries past its last page: 0, never read)
        self.slot_ranks: torch.Tensor  # int32 [num_slots]
        self.slot_scales: torch.Tensor  # float32 [num_slots]
        self.slot_pages: torch.Tensor  # int32 [num_slots, pages_per_slot]
        self.register_buffer(
            "slot_ranks", torch.zeros(self.num_slots, dtype=torch.int32, device=device), persistent=False
        )
        self.register_buffer(
            "slot_scales", torch.zeros(self.num_slots, dtype=torch.float32, device=device), persistent=False
        )
        self.register_buffer(
            "slot_pages",
            torch.zeros(self.num_slots, self.pages_per_slot, dtype=torch.int32, device=device),
            persistent=False,
        )

    def pages_for_rank(self, rank: int) -> int:
        """Pages an adapter of `rank` takes."""
        if rank > self.max_lora_rank:
            raise ValueError(f"adapter rank {rank} exceeds max_lora_rank {self.max_lora_rank}")
        if rank < 1:
            raise ValueError(f"adapter rank {rank} is not positive")
        return -(-rank // self.page_rank)

    def set_slot(self, slot: int, pages: Sequence[int], rank: int, scale: float) -> None:
        """Point `slot` at `pages` (its adapter's, in rank order): what the kernels read from the next
        step on. Queued on the current stream, like the page writes before it."""
        if len(pages) != self.pages_for_rank(rank) or slot != pages[0]:
            raise ValueError(f"slot {slot} of rank {rank} cannot take pages {list(pages)}")
        # fill kernels only: `cuda_tensor[i] = number` copies a host scalar (pageable memory) and
        # waits for the stream, and the adapter pool queues this behind an upload on its side stream
        # (on the H200 that wait made a slot write's engine-thread time its whole load time)
        row = self.slot_pages[slot]
        row.zero_()
        for index, page in enumerate(pages):
            row[index : index + 1].fill_(page)
        self.slot_ranks[slot : slot + 1].fill_(rank)
        self.slot_scales[slot : slot + 1].fill_(scale)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits float32 [B, vocab] of the tokens at `batch.logits_indices`, one row per sequence,
        written into `out` [B, vocab] when given.

        Writes the step's K/V into `kv_cache` at `batch.slot_mapping` as a side effect.
        """
        return self.lm_head.logits(self.model(batch, kv_cache), out)

    def load_weights(self, model_dir: Path) -> None:
        """Fill every parameter from the HF safetensors checkpoint in `model_dir` (single or sharded)."""
        with torch.no_grad():
            load_checkpoint(Path(model_dir), self._checkpoint_loaders(), ignore=self._derived)

    def load_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], *, source: str) -> None:
        """Fill every parameter from (checkpoint name, tensor) pairs already in host memory (a warm
        model's pinned copy). Copies are queued on the current CUDA stream without a host wait: the
        caller synchronises that stream before use and keeps `tensors` alive until then."""
        with torch.no_grad():
            load_tensors(tensors, self._checkpoint_loaders(), ignore=self._derived, source=source)

    def _derived(self, name: str) -> bool:
        """Checkpoint tensors the model derives itself: a tied head is the embedding; old checkpoints
        also saved the rotary frequencies."""
        return (self.info.tie_word_embeddings and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")

    def _checkpoint_loaders(self) -> dict[str, TensorLoader]:
        """Checkpoint tensor name → where it goes; packed layers declare their own slices."""
        loaders: dict[str, TensorLoader] = {}
        for module_name, module in self.named_modules():
            if isinstance(module, LoRALinear | MoEBlock):
                loaders.update(module.checkpoint_loaders(module_name.rpartition(".")[0]))
                continue
            for param_name, param in module.named_parameters(prefix=module_name, recurse=False):
                loaders[param_name] = partial(copy_weight, param, name=param_name)
        return loaders

    def set_adapter_slot(self, index: int, adapter: AdapterWeights) -> int:
        """Load `adapter` without the adapter pool (tests, single-adapter tools) as the `index`-th of
        max_loras adapters: into the index-th max-rank stretch of pages. Returns its slot."""
        if not 0 <= index < self.max_loras:
            raise ValueError(f"adapter slot {index} is outside 0..{self.max_loras - 1}")
        first = index * self.pages_per_slot
        return self.set_adapter(list(range(first, first + self.pages_for_rank(adapter.rank))), adapter)

    @torch.no_grad()
    def set_adapter(self, pages: Sequence[int], adapter: AdapterWeights) -> int:
        """Copy `adapter` into `pages` (free ones, in rank order) and return its slot: projections the
        adapter does not target, and ranks past its own, are zeroed."""
        known = {(layer, projection) for layer in range(self.info.num_layers) for projection in PROJECTIONS}
        unknown = sorted(set(adapter.lora) - known)
        if unknown:
            raise ValueError(f"adapter targets modules this model does not have: {unknown[:3]}")
        if len(pages) != self.pages_for_rank(adapter.rank) or not all(0 <= p < self.num_pages for p in pages):
            raise ValueError(f"an adapter of rank {adapter.rank} cannot take pages {list(pages)}")
        slot = pages[0]
        for layer_index, layer in enumerate(self.model.layers):
            for linear in layer.lora_linears():
                linear.set_lora(pages, [adapter.lora.get((layer_index, name)) for name in linear.projections])
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.set_lora(slot, layer_index, adapter.experts)
        self.set_slot(slot, pages, adapter.rank, adapter.scaling)
        return slot

    @torch.no_grad()
    def clear_adapter_slot(self, slot: int) -> None:
        """Zero `slot` and its pages entirely, so no weight of its evicted adapter can leak into the
        next one; the slot reads as empty (rank 0) from then on."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"adapter slot {slot} is outside 0..{self.num_slots - 1}")
        rank = int(self.slot_ranks[slot])
        pages = self.slot_pages[slot, : -(-rank // self.page_rank)].tolist() if rank else [slot]
        for layer in self.model.layers:
            for linear in layer.lora_linears():
                linear.clear_lora(pages)
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.clear_lora(slot)
        self.slot_ranks[slot] = 0
        self.slot_scales[slot] = 0.0
