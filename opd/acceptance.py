"""Acceptance statistics of speculative-decoding records: τ, the survival curve and the first-rejection histogram.

τ is reported two ways, as the DFlash benchmark and serving engines do: the mean of per-response means, and
token-weighted (all committed tokens over all verification steps).
"""

from __future__ import annotations

from dataclasses import dataclass

from opd.decoding.record import SequenceRecord


@dataclass
class AcceptanceStats:
    tau: float  # mean over responses of each response's mean acceptance length
    tau_token_weighted: float  # committed tokens / verification steps, over all responses
    survival: list[float]  # survival[k-1] = P(accepted >= k), k = 1..K-1
    first_rejection: list[float]  # share of blocks first rejected at position k = 1..K-1, then "full accept"
    steps: int

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
        )
