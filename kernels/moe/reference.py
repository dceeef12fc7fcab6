"""Plain-torch MoE with per-token multi-LoRA on every expert: the semantics the Triton path reproduces.

    probs = softmax(x @ router.T)                     (float32)
    w, e  = top_k(probs); w /= sum(w) if renormalise
    for each token t, its k-th expert e = e[t, k], its adapter slot s (-1: none):
        gu  = x[t] @ W13[e].T + scale[s] * (x[t] @ A13[s, e].T) @ B13[s, e].T    # [2I]: gate | up
        h   = silu(gu[:I]) * gu[I:]
        y   = h @ W2[e].T + scale[s] * (h @ A2[s, e].T) @ B2[s, e].T              # [H]
        out[t] += w[t, k] * y

W13 [E, 2I, H], W2 [E, H, I], in x's dtype, or fp8 (W8A16) with float32 per-output-channel scales
[E, 2I] / [E, H]: each expert's weight is then dequantized (fp8 value * its row's scale, in fp32)
and the same sums run, x unquantized; A13 [S, E, R13, H], B13 [S, E, 2I, R13], A2 [S, E, R2, I], B2 [S, E, H, R2].
Slots are zero past their adapter's rank, so padding adds nothing and no rank mask is needed. B13 is
block-diagonal (gate rows use ranks [0, R13/2), up rows [R13/2, R13)), which the Triton expand
exploits; the reference multiplies it whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.quant.reference import quantize_weight


@dataclass(frozen=True, slots=True)
class ExpertLoRA:
    """One MoE layer's adapter slots: every expert's gate_up and down LoRA, per slot."""

    a13: torch.Tensor  # [S, E, R13, H]
    b13: torch.Tensor  # [S, E, 2I, R13]
    a2: torch.Tensor  # [S, E, R2, I]
    b2: torch.Tensor  # [S, E, H, R2]


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights float32 [T, top_k], expert ids int32 [T, top_k]), best first."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def moe_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    lora: ExpertLoRA | None = None,
    token_slots: torch.Tensor | None = None,
    slot_scales: torch.Tensor | None = None,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] through the routed experts → [T, H] in x's dtype (float32 accumulation per expert).

    weights/ids [T, K] from the router; token_slots int [T] (-1: no adapter) and slot_scales
    float32 [S] are needed only with `lora`; w13_scale float32 [E, 2I] and w2_scale [E, H] only
    with fp8 w13 and w2.
    """
    num_tokens, top_k = ids.shape
    width = w2.shape[2]
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = ids.reshape(-1).long()
    pair_tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    pair_weights = weights.reshape(-1).float()
    for expert in torch.unique(flat_ids).tolist():
        pairs = torch.nonzero(flat_ids == expert).squeeze(1)
        tokens = pair_tokens[pairs]
        xs = x[tokens].float()
        gate_up = xs @ _expert_weight(w13, w13_scale, expert).T  # [n, 2I]
        if lora is not None:
            gate_up += _lora_delta(xs, lora.a13, lora.b13, expert, token_slots[tokens], slot_scales)
        hidden = F.silu(gate_up[:, :width]) * gate_up[:, width:]
        # the activation is rounded to the compute dtype, as a GEMM in that dtype would see it
        hidden = hidden.to(x.dtype).float()
        y = hidden @ _expert_weight(w2, w2_scale, expert).T
        if lora is not None:
            y += _lora_delta(hidden, lora.a2, lora.b2, expert, token_slots[tokens], slot_scales)
        out.index_add_(0, tokens, y * pair_weights[pairs, None])
    return out.to(x.dtype)


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [E, N, K], float32 scales [E, N]) of stacked expert weights w [E, N, K]: kernels/quant's
    per-output-channel quantizer over every expert's rows (rows are quantized independently, so
    this equals quantizing each expert, or each of gate and up, on its own)."""
    experts, rows, k = w.shape
    quantized, scales = quantize_weight(w.reshape(experts * rows, k))
    return quantized.view(experts, rows, k), scales.view(experts, rows)


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, expert: int) -> torch.Tensor:
    """float32 [N, K]: expert `expert`'s weight of w [E, N, K], dequantized with its scale [E, N] if given."""
    if scale is None:
        return w[expert].float()
    return w[expert].float() * scale[expert, :, None]


def _lora_delta(
    xs: torch.Tensor, a: torch.Tensor, b: torch.Tensor, expert: int, slots: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """Per row of xs [n, K]: scale[s] * (x @ A[s, expert].T) @ B[s, expert].T, zero where s < 0."""
    delta = torch.zeros(xs.shape[0], b.shape[2], dtype=torch.float32, device=xs.device)
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(slots == slot).squeeze(1)
        shrunk = xs[rows] @ a[slot, expert].float().T
        delta[rows] = (shrunk @ b[slot, expert].float().T) * scales[slot]
    return delta
