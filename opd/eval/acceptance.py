"""Acceptance statistics of speculative-decoding records: τ, the survival curve and the first-rejection histogram.

τ is reported two ways, as the DFlash benchmark and serving engines do: the mean of per-response means (the
authors' τ, z-lab's "Average Acceptance length"), and token-weighted (all written tokens over all verification
steps, the pooled τ). The first carries a 95% interval over the prompts (normal approximation, ± 1.96 standard
errors of the per-response means): the spread a seed sweep does not show, which is what decides whether a
few-percent difference on 64 prompts means anything.

One rule for the final block, as z-lab's `dflash_generate` counts it: a block counts only the tokens it wrote into
the response (`SequenceRecord.written`). A final block cut by the first eos or by the length limit wrote its
accepted drafts up to the end and, if it fits, the bonus; what lies past the end was never committed.
- τ (both kinds): such a block counts min(accepted + 1, room) tokens, so the written tokens of a response sum to
  its length − 1, and the authors' τ equals z-lab's figure on the same decodes.
- Survival curve: a block that ran into the response end before a rejection or its (K−1)th draft is censored, not
  rejected: the response end is no evidence of a rejection. It counts as accepted at every position inside the
  response and is absent from the positions past it. P(accepted >= k) is the Kaplan–Meier product, over positions
  j <= k, of the share of the blocks at risk at j (all earlier drafts accepted, j inside the response) that
  accepted draft j. With no censored block this is the plain share of blocks with accepted >= k.
- First-rejection histogram: the distribution the curve implies, S(k−1) − S(k) at position k and S(K−1) for a
  full accept, so a censored block adds no rejection at the response end; a final block that accepted all K−1
  drafts is a full accept whether or not its bonus fit.
- The ceiling (opd/eval/ceiling.py) is these statistics of the oracle's records, so it follows the same rule.
Training's inputs (anchors, accepted counts, replay's slots) are untouched: the rule changes what is counted,
not what was verified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from opd.decoding.record import SequenceRecord

Z95 = 1.96


@dataclass
class AcceptanceStats:
    tau: float  # mean over responses of each response's mean acceptance length
    tau_token_weighted: float  # written tokens / verification steps, over all responses
    survival: list[float]  # survival[k-1] = P(accepted >= k), k = 1..K-1
    first_rejection: list[float]  # share of blocks first rejected at position k = 1..K-1, then "full accept"
    steps: int
    tau_ci: float = 0.0  # half-width of the 95% interval of `tau` over the responses

    @classmethod
    def from_records(cls, records: list[SequenceRecord], block_size: int) -> AcceptanceStats:
        written = [w for rec in records for w in rec.written]
        accepted = torch.tensor([r for rec in records for r in rec.accepted], dtype=torch.long)
        rooms = torch.tensor([room for rec in records for room in rec.rooms], dtype=torch.long)
        curve = survival_curve(accepted[:, None] >= torch.arange(1, block_size), rooms)
        per_response = [rec.tau for rec in records if rec.accepted]
        return cls(
            tau=sum(per_response) / max(1, len(per_response)),
            tau_token_weighted=sum(written) / max(1, len(written)),
            survival=curve[1:],
            first_rejection=rejection_histogram(curve),
            steps=len(written),
            tau_ci=interval(per_response),
        )


def survival_curve(alive: torch.Tensor, rooms: torch.Tensor) -> list[float]:
    """S(k) = P(accepted >= k) for k = 0..K−1, censored at the response end (the module's rule). `alive` [N, K−1]:
    each block's P(accepted >= k), 0/1 when realised, expected when predicted; `rooms` [N]: position k of a block
    lies inside the response iff k <= room. S(0) is 1, or 0 when there is no block; a position no block is at risk
    at carries the previous value."""
    n, drafted = alive.shape
    alive = alive.double()
    inside = (torch.arange(1, drafted + 1) <= rooms[:, None]).double()
    reached = torch.cat([torch.ones(n, 1, dtype=torch.float64), alive], 1)[:, :drafted]  # P(accepted >= k - 1)
    at_risk, kept = (inside * reached).sum(0), (inside * alive).sum(0)
    share = torch.where(at_risk > 0, kept / at_risk.clamp_min(1e-300), 1.0)
    start = 1.0 if n else 0.0
    return [start] + (start * share.cumprod(0)).tolist()


def rejection_histogram(curve: list[float]) -> list[float]:
    """Share of blocks first rejected at position k = 1..K−1, then "full accept", from S(0..K−1)."""
    return [curve[k - 1] - curve[k] for k in range(1, len(curve))] + [curve[-1]]


def interval(values: list[float]) -> float:
    """Half-width of the 95% interval of the mean of `values` (0 for fewer than two)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return Z95 * math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def pooled_interval(records: list[SequenceRecord]) -> float:
    """Half-width of the 95% interval of the pooled τ (written tokens / verifications) over the responses: a
    ratio of sums, so its standard error is the delta method's, sqrt(sum (t_i - τ s_i)^2 / (n (n-1))) / mean s_i,
    with t_i the response's written tokens and s_i its verifications (0 for fewer than two responses)."""
    pairs = [(sum(rec.written), len(rec.accepted)) for rec in records if rec.accepted]
    n = len(pairs)
    if n < 2:
        return 0.0
    tau = sum(t for t, _ in pairs) / sum(s for _, s in pairs)
    mean_steps = sum(s for _, s in pairs) / n
    return Z95 * math.sqrt(sum((t - tau * s) ** 2 for t, s in pairs) / (n * (n - 1))) / mean_steps
