"""The layers every drafter family builds from: RMSNorm, rotary position embeddings and the gated MLP, in the
Qwen3 form the public drafters use (DFlash's layers and EAGLE-3's midlayer alike)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

WIDE_DTYPES = (torch.float32, torch.float64)  # the dtypes RMSNorm computes in as they are


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm; computed in at least float32 (float64 stays float64 so tests can be exact)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The casts are skipped where they would not change the dtype: a decoding step runs a dozen norms on a few
        # rows each, where every dispatched no-op costs as much as the arithmetic.
        wide = x if x.dtype in WIDE_DTYPES else x.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (wide if wide.dtype == x.dtype else wide.to(x.dtype))


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [...,head_dim] for integer positions [...] (computed in float32, like HF, or float64)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    angles = positions.to(compute)[..., None] * _inverse_frequencies(head_dim, theta, positions.device, compute)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    # No cast where the dtype already is the computing one: a draft forms these tables every step.
    return (cos, sin) if dtype == compute else (cos.to(dtype), sin.to(dtype))


_INVERSE_FREQUENCIES: dict[tuple[int, float, torch.device, torch.dtype], torch.Tensor] = {}


def _inverse_frequencies(head_dim: int, theta: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """theta^(-2i/head_dim), formed once per RoPE, device and dtype rather than at every draft (outside inference
    mode, so that the training path may use the same tensor)."""
    key = (head_dim, theta, device, dtype)
    if key not in _INVERSE_FREQUENCIES:
        with torch.inference_mode(False):
            exponents = torch.arange(0, head_dim, 2, device=device).to(dtype) / head_dim
            _INVERSE_FREQUENCIES[key] = 1.0 / (theta**exponents)
    return _INVERSE_FREQUENCIES[key]


_HALF_SIGNS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _half_signs(width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[−1 × width/2, +1 × width/2], formed once per width, dtype and device (outside inference mode, so that the
    training path may use the same tensor)."""
    key = (width, dtype, device)
    if key not in _HALF_SIGNS:
        with torch.inference_mode(False):
            _HALF_SIGNS[key] = torch.ones(width, dtype=dtype, device=device).index_fill_(
                0, torch.arange(width // 2, device=device), -1)
    return _HALF_SIGNS[key]


def scaled_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B,T,head_dim] of a scaled RoPE, as transformers' rotary forward forms them (float32 angles, times
    the attention scaling)."""
    angles = positions.float()[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B,heads,T,d] by the half-split (NeoX) convention Qwen3 uses; cos/sin [B,T,d], or [B,1,T,d] as a
    draft forms them once for all its layers' queries and keys.

    The rotated half [−x₂, x₁] is x rolled by half its width times the signs [−1…, +1…]: two operations where
    slicing, negating and concatenating take four (a draft rotates the queries and keys of every layer), with
    the same values (a product by ±1 is exact)."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1) * _half_signs(x.shape[-1], x.dtype, x.device)
    if cos.dim() < x.dim():
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotated * sin


class MLPShape(Protocol):
    """What a feed-forward is sized by: any family's drafter config has both."""

    hidden_size: int
    intermediate_size: int


class GatedMLP(nn.Module):
    """SwiGLU feed-forward, as in Qwen3."""

    def __init__(self, config: MLPShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
