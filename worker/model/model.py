"""The decoder-only causal LM (Llama / Mistral / Qwen2) as the engine runs it: one forward over a flat
token batch with a paged KV cache, and per-token adapters from a paged LoRA pool.

Parameter names mirror the HF checkpoint (`model.layers.3.self_attn.qkv_proj.weight` is filled from
`…q_proj.weight`, `…k_proj.weight` and `…v_proj.weight`), so loading is a walk over named modules.
The model is built directly on its device and is not meant to be moved afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial

import torch
from torch import nn

from shared.model_info import ModelInfo
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache
from worker.model.kv_scales import KVScaleLoader
from worker.model.layers import DecoderLayer, RMSNorm, VocabEmbedding
from worker.model.lora_linear import LoRALinear, LoRAPages
from worker.model.moe import MoEBlock
from worker.model.parallel.group import TensorParallel
from worker.model.parallel.sharding import ModelShard
from worker.model.parallel.vocab import VocabParallelEmbedding
from worker.model.rope import RotaryEmbedding
from worker.model.weights import TensorLoader, copy_weight, load_tensors


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


def model_dtype(name: str | None, info: ModelInfo, device: torch.device | str) -> torch.dtype:
    """The dtype a worker runs `info`'s weights in: the checkpoint's unless `name` overrides it; fp16
    on CPU runs as fp32 (slow and lossy there)."""
    dtype = resolve_dtype(name, info)
    return torch.float32 if torch.device(device).type == "cpu" and dtype is torch.float16 else dtype


def _embedding(
    info: ModelInfo, shard: ModelShard | None, dtype: torch.dtype, device: torch.device | str
) -> VocabEmbedding:
    if shard is None:
        return VocabEmbedding(info.vocab_size, info.hidden_size, dtype=dtype, device=device)
    return VocabParallelEmbedding(info.vocab_size, info.hidden_size, shard.tp, dtype=dtype, device=device)


class DecoderStack(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.*`)."""

    def __init__(
        self,
        info: ModelInfo,
        *,
        pages: LoRAPages,
        dtype: torch.dtype,
        device: torch.device | str,
        shard: ModelShard | None = None,
    ) -> None:
        """`info`: the network this process builds (a tensor-parallel rank's share: `shard`)."""
        super().__init__()
        self.embed_tokens = _embedding(info, shard, dtype, device)
        self.rotary_emb = RotaryEmbedding(info.head_dim, info.rope_theta, info.rope_scaling, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(info, layer_index=index, pages=pages, dtype=dtype, device=device, shard=shard)
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
        tp: TensorParallel | None = None,
    ) -> None:
        """Allocate the model with uninitialised weights (filled by `load_tensors`) and an empty
        LoRA pool as large as `max_loras` adapters of rank `max_lora_rank`. dtype None: the checkpoint's.
        On the meta device it allocates nothing: the memory plan counts its tensors' bytes that way.

        The pool is paged (S-LoRA's unified paging): pages of PAGE_RANK rank rows for every adapted
        projection of every layer, so adapters of lower rank take fewer pages and more of them fit,
        up to one per page. An adapter's slot (its index into the per-slot tensors below) is the
        index of its first page (LoRAPages.for_pool says when slots are pages). max_loras 0: LoRA
        off, every LoRA tensor empty; only base-model batches (`lora` None) may run.

        `tp`: this process is one rank of a tensor-parallel group and builds its share of the network
        (parallel/sharding.py); `info` stays the whole model's, `local_info` is the share's."""
        super().__init__()
        self.info = info
        self.shard = ModelShard.of(info, tp) if tp is not None else None
        self.local_info = self.shard.local if self.shard is not None else info
        self.dtype = resolve_dtype(dtype, info)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        pages = LoRAPages.for_pool(info, max_loras=max_loras, max_lora_rank=max_lora_rank)
        self.page_rank = pages.page_rank
        self.pages_per_slot = pages.pages_per_slot
        self.num_pages = pages.num_pages
        self.num_slots = self.num_pages
        self.kv_scales_published = False  # the checkpoint gave every layer's KV cache scales (kv_scales.py)
        self.model = DecoderStack(self.local_info, pages=pages, dtype=self.dtype, device=device, shard=self.shard)
        self.lm_head = (
            self.model.embed_tokens if info.tie_word_embeddings else _embedding(info, self.shard, self.dtype, device)
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

    @property
    def lora_enabled(self) -> bool:
        return self.num_pages > 0

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
        # (that wait made a slot write cost the engine thread its whole load time)
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

    def load_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], *, source: str) -> None:
        """Fill every parameter from (checkpoint name, tensor) pairs already in host memory (a
        checkpoint read by worker/switching/loader.py). Copies are queued on the current CUDA stream
        without a host wait: the caller synchronises that stream before use and keeps `tensors`
        alive until then. The 4-bit weights' tensor-core copies are filled from the loaded weights after."""
        if self.info.checkpoint_quantization != "none":
            # transformers' fp8 format calls the per-channel scale weight_scale_inv (it multiplies all the same)
            tensors = (
                (name.removesuffix("_inv") if name.endswith(".weight_scale_inv") else name, t) for name, t in tensors
            )
        kv_scales = KVScaleLoader(  # published KV cache scales go to the layers' kv_scales
            [layer.self_attn.kv_scales for layer in self.model.layers],
            num_kv_heads=self.info.num_kv_heads,
            kv_head_start=self.shard.kv_head_start if self.shard is not None else 0,
        )
        with torch.no_grad():
            load_tensors(kv_scales.divert(tensors), self._checkpoint_loaders(), ignore=self._derived, source=source)
            for module in self.modules():
                if isinstance(module, LoRALinear):
                    module.fill_decode_copy()
        kv_scales.check(source)
        self.kv_scales_published = kv_scales.published

    def _derived(self, name: str) -> bool:
        """Checkpoint tensors the model derives itself, or does without: a tied head is the embedding;
        old checkpoints also saved the rotary frequencies."""
        if self.info.checkpoint_quantization != "none" and name.endswith(".input_scale"):
            return True  # a static activation scale: activations are quantized per token instead
        if self.info.checkpoint_quantization == "gptq" and name.endswith(".g_idx"):
            return True  # desc_act false (shared/int4_quantization.py): g_idx[k] is k // group_size
        return (self.info.tie_word_embeddings and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")

    def _checkpoint_loaders(self) -> dict[str, TensorLoader]:
        """Checkpoint tensor name → where it goes; packed layers declare their own slices."""
        loaders: dict[str, TensorLoader] = {}
        prequantized = self.info.checkpoint_quantization != "none"
        for module_name, module in self.named_modules():
            if isinstance(module, LoRALinear):
                parent = module_name.rpartition(".")[0]
                loaders.update(
                    module.checkpoint_loaders(
                        parent,
                        prequantized=prequantized,
                        double_quant=self.info.weight_double_quant,
                        scale_block=self.info.weight_scale_block,
                    )
                )
                continue
            if isinstance(module, MoEBlock):
                loaders.update(module.checkpoint_loaders(module_name.rpartition(".")[0], prequantized=prequantized))
                continue
            if isinstance(module, VocabParallelEmbedding):
                loaders[f"{module_name}.weight"] = partial(module.load, name=f"{module_name}.weight")
                continue
            for param_name, param in module.named_parameters(prefix=module_name, recurse=False):
                loaders[param_name] = partial(copy_weight, param, name=param_name)
        return loaders
