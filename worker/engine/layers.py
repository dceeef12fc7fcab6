"""The Llama block shared by Llama, Mistral and Qwen2: RMSNorm, GQA self-attention with RoPE over the
paged cache, SwiGLU MLP. Every projection is a `LoRALinear`; q/k/v and gate/up are packed.

Activations are flat over the step's tokens: [T, features], no batch or padding axis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.lora import LoRABatch
from shared.model_info import ModelInfo
from worker.engine.attention import paged_attention
from worker.engine.forward_batch import ForwardBatch
from worker.engine.lora_linear import LoRALinear, LoRASlotShape
from worker.engine.rope import apply_rope


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, size] normalised in float32, cast back before the weight (as HF does, so low-precision
        checkpoints round the same way)."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


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

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] → float32 [N, vocab]."""
        return F.linear(hidden, self.weight).float()


class SelfAttention(nn.Module):
    def __init__(
        self, info: ModelInfo, *, slots: LoRASlotShape, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.num_heads = info.num_heads
        self.num_kv_heads = info.num_kv_heads
        self.head_dim = info.head_dim
        self.scale = info.head_dim**-0.5
        q_width = info.num_heads * info.head_dim
        kv_width = info.num_kv_heads * info.head_dim
        self.qkv_proj = LoRALinear(
            info.hidden_size,
            {"q_proj": q_width, "k_proj": kv_width, "v_proj": kv_width},
            bias=info.attention_bias,
            slots=slots,
            dtype=dtype,
            device=device,
        )
        # Llama's attention_bias covers o_proj too; Qwen2 biases only q/k/v
        o_bias = info.attention_bias and info.architecture != "Qwen2ForCausalLM"
        self.o_proj = LoRALinear(
            q_width, {"o_proj": info.hidden_size}, bias=o_bias, slots=slots, dtype=dtype, device=device
        )

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        """hidden [T, hidden_size] → [T, hidden_size]; writes this step's K/V into this layer's cache.

        rope: (cos, sin) [T, head_dim] for the step's positions.
        """
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden, batch.lora)
        q, k, v = qkv.split(self.qkv_proj.out_features, dim=-1)
        q = apply_rope(q.view(num_tokens, self.num_heads, self.head_dim), *rope)
        k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_dim), *rope)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        attended = paged_attention(q, k, v, key_cache, value_cache, batch, self.scale)
        return self.o_proj(attended.reshape(num_tokens, -1), batch.lora)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(
        self, info: ModelInfo, *, slots: LoRASlotShape, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        width = info.intermediate_size
        self.gate_up_proj = LoRALinear(
            info.hidden_size,
            {"gate_proj": width, "up_proj": width},
            bias=False,
            slots=slots,
            dtype=dtype,
            device=device,
        )
        self.down_proj = LoRALinear(
            width, {"down_proj": info.hidden_size}, bias=False, slots=slots, dtype=dtype, device=device
        )

    def forward(self, hidden: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """[T, hidden_size] → [T, hidden_size]."""
        gate, up = self.gate_up_proj(hidden, lora).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up, lora)


class DecoderLayer(nn.Module):
    def __init__(
        self, info: ModelInfo, *, slots: LoRASlotShape, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = SelfAttention(info, slots=slots, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = GatedMLP(info, slots=slots, dtype=dtype, device=device)

    def lora_linears(self) -> tuple[LoRALinear, ...]:
        """The layer's adaptable projections; together their slices are the seven PEFT targets."""
        return (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        """[T, hidden_size] → [T, hidden_size] (pre-norm residual block)."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, batch, key_cache, value_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden), batch.lora)
