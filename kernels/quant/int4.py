"""4-bit group-wise weights with 16-bit activations (W4A16): the GEMM a projection with an
`Int4Weight` takes. CUDA tensors take the Triton kernel (int4_gemm.py), or, for a step of at most
TINYGEMM_MAX_TOKENS rows of a weight that keeps a copy in the tensor cores' layout, torch's tinygemm
kernel (int4_mma.py); anything else takes the torch reference, which dequantizes. Adapters are not
quantized: the LoRA kernels add their delta on top of this base GEMM, as for any base weight."""

from __future__ import annotations

import torch

from kernels.quant.int4_gemm import int4_gemm
from kernels.quant.int4_mma import TINYGEMM_MAX_TOKENS, tinygemm_linear
from kernels.quant.int4_reference import Int4Weight, int4_linear_reference


def takes_tinygemm(weight: Int4Weight, num_tokens: int) -> bool:
    """Whether a CUDA step of num_tokens rows multiplies this weight through tinygemm."""
    return weight.tensor_cores is not None and num_tokens <= TINYGEMM_MAX_TOKENS


def int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] → [T, N] in x's dtype: x @ W.T (+ bias [N]) for the 4-bit weight W [N, K]."""
    if not x.is_cuda:
        return int4_linear_reference(x, weight, bias)
    y = tinygemm_linear(x, weight.tensor_cores) if takes_tinygemm(weight, x.shape[0]) else int4_gemm(x, weight)
    return y if bias is None else y.add_(bias)
