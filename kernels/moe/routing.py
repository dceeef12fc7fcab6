"""Top-k softmax routing: one program per token picks its experts and their weights.

Semantics (reference.route_reference):
    probs = softmax(logits[t])             float32 over E experts
    (w, e) = the top_k largest probs, best first; w /= sum(w) if RENORMALIZE

Ties go to the lower expert id, as torch.topk on distinct values would; random router logits have none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_tokens"])
def _topk_softmax_kernel(
    logits_ptr, weights_ptr, ids_ptr,
    num_tokens, num_experts, logits_stride,
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    if token >= num_tokens:
        return
    experts = tl.arange(0, E_PAD)
    ok = experts < num_experts
    logits = tl.load(logits_ptr + token.to(tl.int64) * logits_stride + experts, mask=ok, other=-float("inf"))
    logits = logits.to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    probs = tl.where(ok, probs, -1.0)
    total = 0.0
    out = token.to(tl.int64) * TOP_K
    for k in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        # lowest id among the maxima
        best_id = tl.min(tl.where(probs == best, experts, E_PAD), axis=0)
        tl.store(weights_ptr + out + k, best)
        tl.store(ids_ptr + out + k, best_id)
        total += best
        probs = tl.where(experts == best_id, -1.0, probs)
    if RENORMALIZE:
        for k in tl.static_range(TOP_K):
            tl.store(weights_ptr + out + k, tl.load(weights_ptr + out + k) / total)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (any float dtype, unit column stride) → (weights float32 [T, top_k],
    expert ids int32 [T, top_k])."""
    num_tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in 1..{num_experts}")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    _topk_softmax_kernel[(num_tokens,)](
        logits, weights, ids,
        num_tokens, num_experts, logits.stride(0),
        TOP_K=top_k, E_PAD=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
    )  # fmt: skip
    return weights, ids
