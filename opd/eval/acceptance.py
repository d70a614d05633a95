"""Acceptance statistics of speculative-decoding records: τ, the survival curve and the first-rejection histogram.

τ is reported two ways, as the DFlash benchmark and serving engines do: the mean of per-response means, and
token-weighted (all committed tokens over all verification steps). The first carries a 95% interval over the
prompts (normal approximation, ± 1.96 standard errors of the per-response means): the spread a seed sweep does
not show, which is what decides whether a few-percent difference on 64 prompts means anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from opd.decoding.record import SequenceRecord

Z95 = 1.96


@dataclass
class AcceptanceStats:
    tau: float  # mean over responses of each response's mean acceptance length
    tau_token_weighted: float  # committed tokens / verification steps, over all responses
    survival: list[float]  # survival[k-1] = P(accepted >= k), k = 1..K-1
    first_rejection: list[float]  # share of blocks first rejected at position k = 1..K-1, then "full accept"
    steps: int
    tau_ci: float = 0.0  # half-width of the 95% interval of `tau` over the responses

    @classmethod
    def from_records(cls, records: list[SequenceRecord], block_size: int) -> AcceptanceStats:
        accepted = [r for rec in records for r in rec.accepted]
        steps = max(1, len(accepted))
        drafted = block_size - 1
        survival = [sum(r >= k for r in accepted) / steps for k in range(1, drafted + 1)]
        histogram = [sum(r == k - 1 for r in accepted) / steps for k in range(1, drafted + 1)]
        histogram.append(sum(r == drafted for r in accepted) / steps)
        per_response = [rec.tau for rec in records if rec.accepted]
        return cls(
            tau=sum(per_response) / max(1, len(per_response)),
            tau_token_weighted=sum(r + 1 for r in accepted) / steps,
            survival=survival,
            first_rejection=histogram,
            steps=len(accepted),
            tau_ci=interval(per_response),
        )


def interval(values: list[float]) -> float:
    """Half-width of the 95% interval of the mean of `values` (0 for fewer than two)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return Z95 * math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def pooled_interval(records: list[SequenceRecord]) -> float:
    """Half-width of the 95% interval of the pooled τ (committed tokens / verifications) over the responses: a
    ratio of sums, so its standard error is the delta method's, sqrt(sum (t_i - τ s_i)^2 / (n (n-1))) / mean s_i,
    with t_i the response's committed tokens and s_i its verifications (0 for fewer than two responses)."""
    pairs = [(sum(r + 1 for r in rec.accepted), len(rec.accepted)) for rec in records if rec.accepted]
    n = len(pairs)
    if n < 2:
        return 0.0
    tau = sum(t for t, _ in pairs) / sum(s for _, s in pairs)
    mean_steps = sum(s for _, s in pairs) / n
    return Z95 * math.sqrt(sum((t - tau * s) ** 2 for t, s in pairs) / (n * (n - 1))) / mean_steps
