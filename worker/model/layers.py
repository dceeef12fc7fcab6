"""The Llama block shared by Llama, Mistral and Qwen2: RMSNorm, GQA self-attention with RoPE over the
paged cache, SwiGLU MLP. Every projection is a `LoRALinear`; q/k/v and gate/up are packed. Qwen3-MoE
and Mixtral swap the MLP for moe.MoEBlock (Qwen3 adds a per-head q/k RMSNorm).

Activations are flat over the step's tokens: [T, features], no batch or padding axis.

Under tensor parallelism a layer is built from the rank's ModelInfo (its share of the heads and
widths: parallel/sharding.py) and its `shard`; without, `shard` is None and nothing changes.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused import add_rms_norm, rms_norm, rope_and_cache_kv, silu_and_mul
from kernels.lora import LoRABatch
from shared.model_info import ModelInfo
from worker.model.attention import paged_attention
from worker.model.forward_batch import ForwardBatch
from worker.model.lora_linear import LoRALinear, LoRAPages
from worker.model.moe import MoEBlock
from worker.model.parallel.sharding import ModelShard


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, size] normalised in float32, cast back before the weight (as HF does, so low-precision
        checkpoints round the same way)."""
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) for x, residual [T, size], in one kernel on CUDA, which
        writes the sum into `residual` itself."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab, hidden]; with tied embeddings also the output projection."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """int64 [T] → [T, hidden]."""
        return F.embedding(token_ids, self.weight)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] → float32 [N, vocab], rounded to the model dtype first as HF's head does; into
        `out` [N, vocab] when given (the decode graphs' static buffer: one cast, no extra copy)."""
        logits = F.linear(hidden, self.weight)
        if out is None:
            return logits.float()
        return out.copy_(logits)


def decoder_projection(
    info: ModelInfo,
    layer_index: int,
    in_features: int,
    outputs: dict[str, int],
    *,
    bias: bool,
    pages: LoRAPages,
    dtype: torch.dtype,
    device: torch.device | str,
    shard: ModelShard | None,
) -> LoRALinear:
    """Decoder layer `layer_index`'s projections `outputs` (PEFT name → out_features; several: one GEMM
    over the input they share) of `in_features` inputs: in the format the model serves them in (one
    for a pack: ModelInfo refuses checkpoints that split one), this rank's share of them with `shard`."""
    return LoRALinear(
        in_features,
        outputs,
        bias=bias,
        pages=pages,
        dtype=dtype,
        device=device,
        quantization=info.projection_quantization(layer_index, next(iter(outputs))),
        group_size=info.weight_group_size,
        decode_copy=info.int4_decode_copy,
        shard=shard.linear(*outputs) if shard else None,
    )


class SelfAttention(nn.Module):
    def __init__(
        self,
        info: ModelInfo,
        *,
        layer_index: int,
        pages: LoRAPages,
        dtype: torch.dtype,
        device: torch.device | str,
        shard: ModelShard | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = info.num_heads
        self.num_kv_heads = info.num_kv_heads
        self.head_dim = info.head_dim
        self.scale = info.head_dim**-0.5
        q_width = info.num_heads * info.head_dim
        kv_width = info.num_kv_heads * info.head_dim
        build = partial(decoder_projection, info, layer_index, pages=pages, dtype=dtype, device=device, shard=shard)
        self.qkv_proj = build(info.hidden_size, {"q_proj": q_width, "k_proj": kv_width, "v_proj": kv_width},
                              bias=info.attention_bias)  # fmt: skip
        # Llama's attention_bias covers o_proj too; Qwen2 biases only q/k/v
        o_bias = info.attention_bias and info.architecture != "Qwen2ForCausalLM"
        self.o_proj = build(q_width, {"o_proj": info.hidden_size}, bias=o_bias)
        # float32 [2, num_kv_heads]: what an fp8 cache divides this layer's K (row 0) and V (row 1) by,
        # per KV head; from the checkpoint or calibrated when the engine is built (worker/model/kv_scales.py).
        # A fixed tensor, so the captured graphs read whatever it holds; unread by a cache in the dtype.
        self.kv_scales: torch.Tensor
        self.register_buffer(
            "kv_scales", torch.ones(2, info.num_kv_heads, dtype=torch.float32, device=device), persistent=False
        )
        # Qwen3 RMS-normalises every q and k head before RoPE
        self.q_norm = RMSNorm(info.head_dim, info.rms_norm_eps, dtype=dtype, device=device) if info.qk_norm else None
        self.k_norm = RMSNorm(info.head_dim, info.rms_norm_eps, dtype=dtype, device=device) if info.qk_norm else None

    def queries(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        lora: LoRABatch | None,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The attention's input side: hidden [T, hidden_size] → rotated q [T, num_heads, head_dim];
        writes this step's rotated K and V into this layer's cache at int64 slot_mapping [T].
        rope: (cos, sin) [T, head_dim] for the step's positions."""
        # the LoRA deltas of qkv (decode sizes, CUDA) are computed beside its GEMM and added by RoPE
        qkv, delta = self.qkv_proj.forward_deferred(hidden, lora)
        if self.q_norm is not None and self.k_norm is not None:
            if delta is not None:
                qkv.add_(delta)
                delta = None
            self._norm_heads(qkv, self.q_norm, self.k_norm)
        return rope_and_cache_kv(
            qkv, *rope, key_cache, value_cache, slot_mapping, self.num_heads, delta, self.kv_scales
        )

    def output(self, attended: torch.Tensor, lora: LoRABatch | None, residual: torch.Tensor) -> torch.Tensor:
        """The attention's output side: attended [T, num_heads, head_dim] → [T, hidden_size].
        residual [T, hidden_size]: the stream the output is added to next, which may take o_proj's
        LoRA delta (LoRALinear.forward)."""
        return self.o_proj(attended.reshape(attended.shape[0], -1), lora, residual)

    def _norm_heads(self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm) -> None:
        """RMS-normalise each q and k head of qkv [T, (H + 2 H_kv) * D] in place."""
        q_width, k_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for norm, part in ((q_norm, qkv[:, :q_width]), (k_norm, qkv[:, q_width : q_width + k_width])):
            part.copy_(norm(part.reshape(-1, self.head_dim)).view(part.shape))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(
        self,
        info: ModelInfo,
        *,
        layer_index: int,
        pages: LoRAPages,
        dtype: torch.dtype,
        device: torch.device | str,
        shard: ModelShard | None = None,
    ) -> None:
        super().__init__()
        width = info.intermediate_size
        build = partial(decoder_projection, info, layer_index, pages=pages, dtype=dtype, device=device, shard=shard)
        self.gate_up_proj = build(info.hidden_size, {"gate_proj": width, "up_proj": width}, bias=False)
        self.down_proj = build(width, {"down_proj": info.hidden_size}, bias=False)

    def forward(self, hidden: torch.Tensor, lora: LoRABatch | None, residual: torch.Tensor) -> torch.Tensor:
        """[T, hidden_size] → [T, hidden_size]; residual [T, hidden_size] as in SelfAttention.forward."""
        gate_up, delta = self.gate_up_proj.forward_deferred(hidden, lora)
        return self.down_proj(silu_and_mul(gate_up, delta), lora, residual)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        info: ModelInfo,
        *,
        layer_index: int,
        pages: LoRAPages,
        dtype: torch.dtype,
        device: torch.device | str,
        shard: ModelShard | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = SelfAttention(
            info, layer_index=layer_index, pages=pages, dtype=dtype, device=device, shard=shard
        )
        self.post_attention_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps, dtype=dtype, device=device)
        self.mlp: GatedMLP | MoEBlock = (
            MoEBlock(info, pages=pages, dtype=dtype, device=device, shard=shard)
            if layer_index in info.moe_layers
            else GatedMLP(info, layer_index=layer_index, pages=pages, dtype=dtype, device=device, shard=shard)
        )

    def lora_linears(self) -> tuple[LoRALinear, ...]:
        """The layer's adaptable projections; together their slices are the seven PEFT targets (four
        in an MoE layer, whose experts hold their own adapter slots)."""
        attention = (self.self_attn.qkv_proj, self.self_attn.o_proj)
        if isinstance(self.mlp, MoEBlock):
            return attention
        return (*attention, self.mlp.gate_up_proj, self.mlp.down_proj)

    def attention_input(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        lora: LoRABatch | None,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block up to attention: (q [T, num_heads, head_dim], the residual stream [T, hidden_size]).

        Pre-norm residual block over [T, hidden_size] tensors, with each residual add deferred into
        the next norm (one kernel): takes the previous block's output and the residual stream before
        it (None for the first block, whose input is the embedding); on CUDA the stream is updated in
        place, so the returned one is `residual` itself."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        return self.self_attn.queries(normed, rope, slot_mapping, lora, key_cache, value_cache), residual

    def attention_output(
        self, attended: torch.Tensor, residual: torch.Tensor, lora: LoRABatch | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block after attention: (its output, the residual stream before it), both [T, hidden_size],
        from attended [T, num_heads, head_dim]; the stream after the block is their sum."""
        attended = self.self_attn.output(attended, lora, residual)
        normed, residual = self.post_attention_layernorm.add_and_norm(attended, residual)
        if isinstance(self.mlp, MoEBlock):  # sums its expert deltas into its own output (topk_sum)
            return self.mlp(normed, lora), residual
        return self.mlp(normed, lora, residual), residual

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole block: attention_input, paged attention over the cache, attention_output."""
        q, residual = self.attention_input(
            hidden, residual, rope, batch.slot_mapping, batch.lora, key_cache, value_cache
        )
        attention = self.self_attn
        attended = paged_attention(q, key_cache, value_cache, batch, attention.scale, attention.kv_scales)
        return self.attention_output(attended, residual, batch.lora)
