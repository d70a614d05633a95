"""Sampling shared by speculative and autoregressive decoding: logit processing and keyed random numbers.

Random numbers are *keyed* by (seed, sequence key, response position, stream) instead of drawn from a global
generator. A sequence's output then depends only on its own key — not on which other sequences share its batch,
how many draft steps its neighbours needed, or which GPU it ran on — so batched, ragged and distributed decoding
are reproducible and can be compared with per-sequence decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:  # the type only, so importing the decoder loads neither pydantic nor the spec
    from opd.spec import TargetSampling

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Sampling:
    """How the *target* distribution is shaped; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    sample_drafts: bool = False  # drafts sampled from the drafter's q (same processing) instead of its argmax

    @classmethod
    def of(cls, setting: TargetSampling, *, sample_drafts: bool = False) -> Sampling:
        """From a spec's sampling setting: rollout's, an eval setting or the serving mode (`opd.spec.sampling`)."""
        return cls(setting.temperature, setting.top_k, setting.top_p, sample_drafts)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Softmax of temperature-scaled logits with top-k and top-p applied (float32, renormalised)."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


H = TypeVar("H", torch.Tensor, int)


def _hash32(x: H) -> H:
    """A 32-bit integer mixer on int64 tensors or Python ints (the same numbers: only the low 32 bits are kept, so
    int64 wrap-around is harmless)."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def keyed_uniform(seed: int, keys: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniform [0, 1) numbers, one per (key, position), identical whatever batch they are computed in."""
    salt = _hash32(seed * 0x9E3779B1 + stream)  # one number per call, so formed on the host
    x = _hash32(_hash32(keys.to(positions.dtype).expand_as(positions) + 0x632BE5AB) ^ salt)
    x = _hash32(x ^ (positions * 0x85EBCA77))
    return (x >> 8).float() / float(1 << 24)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling; `right=True` means a zero-probability token is never chosen."""
    cdf = probs.cumsum(-1)
    u = u.unsqueeze(-1) * cdf[..., -1:]
    idx = torch.searchsorted(cdf.contiguous(), u.contiguous(), right=True).squeeze(-1)
    return idx.clamp_max(probs.shape[-1] - 1)
