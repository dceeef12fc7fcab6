"""Rotary position embedding (RoPE), HF "rotate half" layout: dimension i pairs with i + head_dim/2.

Supported `rope_scaling` types: none / "default" and "llama3" (Llama 3.1's frequency-dependent
stretch of the long wavelengths). Angles are computed per step from the positions rather than read
from a precomputed table: one tiny [T, head_dim/2] product, no max_context-sized buffer. The
rotation itself is kernels.fused.rope_and_cache_kv (q and k in one launch, with the KV-cache write).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """float32 [head_dim/2]: radians per position of each rotated pair."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """float32 [head_dim/2]: Llama 3.1 scaling. Wavelengths shorter than
    original_max / high_freq_factor are kept, those longer than original_max / low_freq_factor are
    divided by `factor`, and the band between is interpolated smoothly."""
    inv_freq = default_inv_freq(head_dim, theta)
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_max = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_max / low_freq_factor
    high_freq_wavelen = original_max / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled)


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The scaling's type name; old configs spell the key `type`, new ones `rope_type`."""
    if not scaling:
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, theta: float, scaling: dict[str, Any] | None, *, device: torch.device | str
    ) -> None:
        super().__init__()
        kind = rope_type(scaling)
        if kind == "default":
            inv_freq = default_inv_freq(head_dim, theta)
        elif kind == "llama3":
            inv_freq = llama3_inv_freq(head_dim, theta, scaling)
        else:
            raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, llama3)")
        # float32 whatever the model dtype: angles at large positions need the mantissa
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] in `dtype` for int64 positions [T]; computed in float32 as HF does."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim/2] radians
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)
