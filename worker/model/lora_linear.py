"""A linear layer that packs one or more projections into one GEMM and applies per-token LoRA.

q/k/v share an input, so do gate/up: packing them into one weight ([q; k; v] stacked along the
output) lets one GEMM (and one LoRA launch) serve the group. Each packed projection is a *slice*;
the layer knows its slices by their checkpoint / PEFT names, so both the checkpoint loader and the
adapter slots find where `q_proj` lives without a separate mapping table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from kernels.lora import LoRABatch, lora_linear, lora_linear_deferred
from kernels.quant import FP8_DTYPE, Int4Weight
from kernels.quant.codebook import codebook
from kernels.quant.int4_mma import fill_mma_layout, mma_layout_fits
from kernels.quant.int4_reference import MMA_K_ALIGN, PACK, MmaInt4Weight, arrival_counters
from shared.int4_quantization import CODEBOOK_FORMATS, INT4_FORMATS
from shared.model_info import ModelInfo
from worker.model import bnb_weights, int4_weights
from worker.model.fp8_weights import BlockScaledFP8, copy_fp8, copy_scale, quantize_into
from worker.model.parallel.sharding import LinearShard, Split
from worker.model.weights import TensorLoader, copy_weight

# Rank rows per page of a paged pool: tl.dot's minimum tile, and the LoRA kernels' vector width.
PAGE_RANK = 16


@dataclass(frozen=True, slots=True)
class LoRAPages:
    """The device memory every adapted projection keeps for adapters: `num_pages` pages of `page_rank`
    rank rows each (S-LoRA's unified paging). An adapter of rank r takes cdiv(r, page_rank) pages,
    anywhere in the pool; the model's page table (`CausalLM.slot_pages`) says which. No pages: LoRA
    is off, and every LoRA buffer is empty (zero bytes, never read)."""

    num_pages: int
    page_rank: int
    pages_per_slot: int  # pages of one max-rank adapter

    @classmethod
    def for_pool(cls, info: ModelInfo, *, max_loras: int, max_lora_rank: int) -> LoRAPages:
        """The pages of a pool as large as `max_loras` adapters of rank `max_lora_rank`. MoE models,
        whose expert buffers are not paged, and pools of rank <= PAGE_RANK get one page of the whole
        max rank per adapter: slots are then pages. max_loras 0: no pages (LoRA off)."""
        if max_loras < 0 or max_lora_rank < 1:
            raise ValueError("max_loras must be >= 0 and max_lora_rank >= 1")
        page_rank = max_lora_rank if info.is_moe or max_lora_rank <= PAGE_RANK else PAGE_RANK
        pages_per_slot = -(-max_lora_rank // page_rank)
        return cls(num_pages=max_loras * pages_per_slot, page_rank=page_rank, pages_per_slot=pages_per_slot)


class LoRALinear(nn.Module):
    """y = x @ W.T (+ b), plus each token's adapter delta, for packed slices i:

        y[t, off_i : off_i + N_i] += scale[s] * (x[t] @ A_i[s].T) @ B_i[s].T    with s = token_slots[t] >= 0

    weight [sum N_i, K] (K = in_features) in the model's dtype, or (quantization "fp8") in fp8 with
    float32 per-output-channel scales weight_scale [sum N_i] (kernels/quant), or (quantization
    "int4", "awq" or "gptq") None, the 4-bit weight held in qweight int32 [K / 8, sum N_i] with
    float16 scales and zeros [K / G, sum N_i] (kernels/quant/int4_reference.py), or (quantization
    "nf4" or "fp4") None, the 4-bit codes in qweight with float32 scales [K / B, sum N_i] and the
    codebook float32 [16]; with `decode_copy`, an affine 4-bit weight whose widths fit, in bf16 on a
    device other than the CPU, is also held in the tensor cores' layout (kernels/quant/int4_mma.py):
    decode_qweight int32 [sum N_i / 8, K / 128, 32, 4] and decode_scale_offsets bfloat16
    [K / G, sum N_i, 2], filled from the loaded weight (fill_decode_copy); bias [sum N_i] or None;
    lora_a[i] [num_pages, page_rank, K]; lora_b[i] [num_pages, N_i, page_rank]. Rank row r of an
    adapter lives in its page r // page_rank, at row (of A) / column (of B) r % page_rank; the rows
    past its rank in its last page stay zero, so padding adds nothing.

    Under tensor parallelism (`shard`) the widths are the rank's: a column-parallel layer holds its
    slices' output rows (and their LoRA B rows), a row-parallel one its input columns (and LoRA A
    columns) and sums its partial output, LoRA delta included, with one all-reduce.
    """

    def __init__(
        self,
        in_features: int,
        projections: Mapping[str, int],
        *,
        bias: bool,
        pages: LoRAPages,
        dtype: torch.dtype,
        device: torch.device | str,
        quantization: str = "none",
        group_size: int = 0,
        decode_copy: bool = False,
        shard: LinearShard | None = None,
    ) -> None:
        """`projections`: name → output width of each packed slice, in output order; `dtype`: the
        activations' (and adapters'); `quantization` "fp8": the weight is held in fp8; "int4", "awq"
        or "gptq": in 4 bits, in groups of `group_size` inputs (the name says where it came from:
        quantized at load, or which checkpoint format the loaders read); "nf4" or "fp4": in 4 bits on
        bitsandbytes' codebook, in blocks of `group_size` inputs; `decode_copy`: an affine 4-bit
        weight keeps the tensor-core copy above where it can (the meta device counts it); `shard`: this
        tensor-parallel rank's part (widths already the rank's), None without tensor parallelism
        (4-bit weights are never sharded: shared/config.py refuses the pair)."""
        super().__init__()
        self.shard = shard
        self.in_features = in_features
        self.projections = tuple(projections)
        self.out_features = tuple(projections.values())
        self.page_rank = pages.page_rank
        total = sum(self.out_features)
        self.quantization = quantization
        # empty: every element is overwritten by the checkpoint, and the loader checks that it was
        if quantization in INT4_FORMATS:
            self.register_parameter("weight", None)
            self.qweight = _frozen(torch.empty(in_features // PACK, total, dtype=torch.int32, device=device))
            groups = in_features // group_size
            if quantization in CODEBOOK_FORMATS:  # bitsandbytes' float32 absmax, kept exact
                self.scales = _frozen(torch.empty(groups, total, dtype=torch.float32, device=device))
                self.register_parameter("zeros", None)
                # part of the weight (64 bytes), as the counters are; buffers here are LoRA memory
                self.codebook = _frozen(codebook(quantization, device))
            else:
                self.scales = _frozen(torch.empty(groups, total, dtype=torch.float16, device=device))
                self.zeros = _frozen(torch.empty(groups, total, dtype=torch.float16, device=device))
                self.codebook = None
            # the split-K GEMM's counters: part of the weight's storage (4 KiB), not a LoRA buffer
            self.arrivals = _frozen(arrival_counters(device))
            self.register_parameter("decode_qweight", None)
            self.register_parameter("decode_scale_offsets", None)
            copy = decode_copy and self.codebook is None and torch.device(device).type != "cpu"
            if copy and mma_layout_fits(total, in_features, group_size, dtype):
                words = (total // 8, in_features // MMA_K_ALIGN, 32, 4)
                self.decode_qweight = _frozen(torch.empty(words, dtype=torch.int32, device=device))
                self.decode_scale_offsets = _frozen(torch.empty(groups, total, 2, dtype=torch.bfloat16, device=device))
        else:
            weight_dtype = FP8_DTYPE if quantization == "fp8" else dtype
            self.weight = _frozen(torch.empty(total, in_features, dtype=weight_dtype, device=device))
        self.weight_scale = (
            nn.Parameter(torch.empty(total, dtype=torch.float32, device=device), requires_grad=False)
            if quantization == "fp8"
            else None
        )
        self.bias = nn.Parameter(torch.empty(total, dtype=dtype, device=device), requires_grad=False) if bias else None
        for name, width in projections.items():
            a = torch.zeros(pages.num_pages, pages.page_rank, in_features, dtype=dtype, device=device)
            b = torch.zeros(pages.num_pages, width, pages.page_rank, dtype=dtype, device=device)
            self.register_buffer(f"lora_a_{name}", a, persistent=False)
            self.register_buffer(f"lora_b_{name}", b, persistent=False)

    @property
    def lora_a(self) -> tuple[torch.Tensor, ...]:
        """Per slice: [num_pages, page_rank, in_features]."""
        return tuple(self.get_buffer(f"lora_a_{name}") for name in self.projections)

    @property
    def lora_b(self) -> tuple[torch.Tensor, ...]:
        """Per slice: [num_pages, out_features_i, page_rank]."""
        return tuple(self.get_buffer(f"lora_b_{name}") for name in self.projections)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in_features] → [T, sum out_features]; `lora` None when no token uses an adapter
        (always on a model without LoRA: the base GEMM alone, no LoRA launch; its page table
        addresses this layer's pages). `residual` [T, sum out_features]: the stream
        the caller adds the result to next, which may take the LoRA delta instead (at decode sizes
        on CUDA, where the delta is computed beside the base GEMM)."""
        if self.shard is not None and self.shard.row_parallel:
            # a partial sum: the delta goes into it (never into the replicated residual) before the all-reduce
            y = lora_linear(
                x, self.base_weight, self.bias, self.lora_a, self.lora_b, lora, weight_scale=self.weight_scale
            )
            return self.shard.tp.all_reduce(y)
        return lora_linear(
            x,
            self.base_weight,
            self.bias,
            self.lora_a,
            self.lora_b,
            lora,
            residual=residual,
            weight_scale=self.weight_scale,
        )

    def forward_deferred(self, x: torch.Tensor, lora: LoRABatch | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, delta) for a caller whose next fused kernel adds the LoRA delta: y + delta is the
        projection of x [T, in_features]; delta [T, sum out_features] is None when it is in y."""
        return lora_linear_deferred(
            x, self.base_weight, self.bias, self.lora_a, self.lora_b, lora, weight_scale=self.weight_scale
        )

    @property
    def base_weight(self) -> torch.Tensor | Int4Weight:
        """What the base GEMM reads: the weight [sum N_i, K], or the 4-bit weight standing for it."""
        if self.weight is None:
            codebook_name = None if self.codebook is None else self.quantization
            copy = self.decode_qweight is not None
            tensor_cores = MmaInt4Weight(self.decode_qweight, self.decode_scale_offsets) if copy else None
            return Int4Weight(
                self.qweight, self.scales, self.zeros, self.arrivals, self.codebook, codebook_name, tensor_cores
            )
        return self.weight

    def checkpoint_loaders(
        self,
        parent: str,
        *,
        prequantized: bool = False,
        double_quant: bool = False,
        scale_block: tuple[int, int] | None = None,
    ) -> dict[str, Callable[[torch.Tensor], None]]:
        """Checkpoint tensor name → loader, for each slice's weight (and bias): `q_proj.weight` of a
        packed qkv layer under `parent` lands in rows [0, N_q) of this layer's weight. An fp8 layer
        quantizes a plain checkpoint's weight as it loads, or (`prequantized`) takes the checkpoint's
        fp8 weight and its `weight_scale` as they are, or with `scale_block` (a block-wise
        checkpoint's outputs × inputs per scale) quantizes them again per row (BlockScaledFP8). A
        4-bit layer quantizes a plain checkpoint's weight, or (`prequantized`) reads an AWQ or GPTQ
        checkpoint's `qweight`, `qzeros` and `scales` (worker/model/int4_weights.py), or a
        bitsandbytes checkpoint's `weight` and quant state, `double_quant` when its absmax is itself
        quantized (worker/model/bnb_weights.py). A tensor-parallel rank's loaders take its part of
        each whole checkpoint tensor."""
        loaders: dict[str, Callable[[torch.Tensor], None]] = {}
        prefix = f"{parent}." if parent else ""
        offset = 0
        splits = self.shard.splits if self.shard is not None else (None,) * len(self.projections)
        first_rank = self.shard is None or self.shard.tp.rank == 0
        for name, width, split in zip(self.projections, self.out_features, splits, strict=True):
            rows = slice(offset, offset + width)
            offset += width
            key = f"{prefix}{name}"
            parts: dict[str, TensorLoader] = {}  # fed a tensor-parallel rank's part of the checkpoint tensor
            whole: dict[str, TensorLoader] = {}  # fed the whole tensor, on every rank
            if self.weight is None:
                parts = self._int4_loaders(key, rows, prequantized=prequantized, double_quant=double_quant)
            elif self.weight_scale is None:
                parts[f"{key}.weight"] = partial(copy_weight, self.weight[rows], name=f"{key}.weight")
            elif prequantized and scale_block:
                blocks = BlockScaledFP8(self.weight[rows], self.weight_scale[rows], scale_block, name=key, split=split)
                whole = {f"{key}.weight": blocks.load_weight, f"{key}.weight_scale": blocks.load_scales}
            elif prequantized:
                parts[f"{key}.weight"] = partial(copy_fp8, self.weight[rows], name=f"{key}.weight")
                parts[f"{key}.weight_scale"] = partial(copy_scale, self.weight_scale[rows], name=f"{key}.weight_scale")
            else:
                parts[f"{key}.weight"] = partial(
                    quantize_into, self.weight[rows], self.weight_scale[rows], name=f"{key}.weight"
                )
            if self.bias is not None:
                parts[f"{key}.bias"] = partial(copy_weight, self.bias[rows], name=f"{key}.bias")
            if split is not None:
                parts = {
                    tensor_name: _rank_part(loader, split, tensor_name.rpartition(".")[2], first_rank=first_rank)
                    for tensor_name, loader in parts.items()
                }
            loaders |= parts | whole
        return loaders

    def fill_decode_copy(self) -> None:
        """Once the checkpoint is loaded: fill the tensor-core copy of a 4-bit weight that keeps one
        from the loaded weight. Queued on the current stream, as the loads are."""
        if self.weight is not None or self.decode_qweight is None:
            return
        fill_mma_layout(
            Int4Weight(self.qweight, self.scales, self.zeros, self.arrivals),
            MmaInt4Weight(self.decode_qweight, self.decode_scale_offsets),
        )

    def _int4_loaders(
        self, key: str, columns: slice, *, prequantized: bool, double_quant: bool
    ) -> dict[str, Callable[[torch.Tensor], None]]:
        """The loaders of one slice (output `columns`) of a 4-bit layer, for checkpoint names under `key`."""
        qweight, scales = self.qweight[:, columns], self.scales[:, columns]
        if self.codebook is not None:
            if prequantized:
                bnb = bnb_weights.BnbSlice(qweight, scales, quant_type=self.quantization, nested=double_quant)
                return bnb.loaders(key)
            quantize = partial(bnb_weights.quantize_into, qweight, scales, self.quantization, name=f"{key}.weight")
            return {f"{key}.weight": quantize}
        zeros = self.zeros[:, columns]
        if not prequantized:
            return {f"{key}.weight": partial(int4_weights.quantize_into, qweight, scales, zeros, name=f"{key}.weight")}
        copy_qweight = int4_weights.copy_awq_qweight if self.quantization == "awq" else int4_weights.copy_gptq_qweight
        return {
            f"{key}.qweight": partial(copy_qweight, qweight, name=f"{key}.qweight"),
            f"{key}.qzeros": partial(int4_weights.zeros_loader(self.quantization), zeros, name=f"{key}.qzeros"),
            f"{key}.scales": partial(int4_weights.copy_scales, scales, name=f"{key}.scales"),
        }


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _rank_part(loader: TensorLoader, split: Split, kind: str, *, first_rank: bool) -> TensorLoader:
    """`loader` fed with a rank's part of the whole checkpoint tensor. A row-parallel bias is added
    by rank 0 alone: the ranks' partial outputs are summed, so it must count once."""
    if kind == "weight":
        return lambda tensor: loader(split.take(tensor))
    if kind == "bias" and split.row_parallel:
        return lambda tensor: loader(tensor if first_rank else torch.zeros_like(tensor))
    return lambda tensor: loader(split.take_vector(tensor))
