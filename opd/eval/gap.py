"""Where a drafter loses to the ceiling: its gap to the argmax oracle, split by slot, on stored target samples.

Distillation aims at a drafter that drafts the target's argmax. On one sample, a drafter's block from anchor a and
the oracle's from the same anchor see the same committed text, so slot by slot (while the drafter's block is
still alive, i.e. every earlier draft was accepted) there are four outcomes for committed token c, the target's
argmax g and the draft d:

    both      c = g = d   both accept
    lost      c = g ≠ d   the oracle accepts, the drafter does not: its argmax is not the target's
    won       c = d ≠ g   the drafter accepts where the oracle would not (T > 0 only: c was sampled off the argmax)
    neither   c ≠ g, c ≠ d

`lost` is what distillation can still take; `neither` is out of reach of any point-mass drafter. Splitting `lost`
by block position and by the target's top-1 probability and entropy at the slot (under the serving setting's
temperature, top-k and top-p) says whether the drafter misses the argmax where the target is sure (capacity, or
a state the drafter was never trained on) or where its mass is spread (the objective: a KL fit spends itself on
the whole distribution, while at T > 0 only the argmax's own mass p_T(argmax) is ever accepted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from opd.decoding.record import SequenceRecord
from opd.decoding.sampling import Sampling, target_probs
from opd.eval.ceiling import text_states
from opd.models.lm_head import SLOTS_PER_CHUNK, map_slots, teacher_head
from opd.models.target import Target

OUTCOMES = ("both", "lost", "won", "neither")
TOP1_EDGES = (0.0, 0.5, 0.7, 0.9, 0.99, 1.0)  # buckets of the target's top-1 probability at the slot
ENTROPY_EDGES = (0.0, 0.1, 0.5, 1.0, 2.0, float("inf"))  # nats, under the serving setting's processing


@dataclass
class SlotFacts:
    """The target at every response position of one sample: entry j describes response token j's slot."""

    argmax: torch.Tensor  # [n] long
    top1: torch.Tensor  # [n] max probability under the setting's processing
    entropy: torch.Tensor  # [n] nats, same distribution


@torch.no_grad()
def slot_facts(target: Target, samples: list[SequenceRecord], sampling: Sampling,
               batch_size: int = 8) -> list[SlotFacts]:
    """One decoder forward per batch and one LM-head pass over every response position, a chunk at a time (no
    [T, V] tensor is formed whole). The argmax is the unprocessed one (temperature and top-k/top-p keep it)."""
    processing = sampling if not sampling.greedy else Sampling(1.0)

    def reduce(logits: torch.Tensor, _: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = target_probs(logits, processing)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        return logits.argmax(-1), probs.max(-1).values, entropy

    out = []
    for _, hidden in text_states(target, samples, batch_size):
        argmax, top1, entropy = map_slots(teacher_head(target), hidden, reduce, SLOTS_PER_CHUNK)
        out.append(SlotFacts(argmax.cpu(), top1.float().cpu(), entropy.float().cpu()))
    return out


@dataclass
class Split:
    """Outcome counts of live slots, by one key (block position, or a bucket of top-1 probability or entropy)."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # key -> outcome -> live slots

    def add(self, key: str, outcome: str) -> None:
        self.counts.setdefault(key, dict.fromkeys(OUTCOMES, 0))[outcome] += 1

    def rows(self) -> list[dict]:
        """Per key: live slots, each outcome's share of them, and the key's share of all `lost` slots."""
        lost = sum(c["lost"] for c in self.counts.values()) or 1
        out = []
        for key, c in self.counts.items():
            n = sum(c.values())
            out.append({"key": key, "slots": n, **{o: c[o] / n for o in OUTCOMES}, "share_of_lost": c["lost"] / lost})
        return out


@dataclass
class GapReport:
    """One drafter's gap to the ceiling on one setting's samples."""

    tau: float  # the drafter's τ on these samples (this project's: mean over sequences)
    ceiling: float  # the argmax oracle's τ, same samples and rule
    by_position: Split
    by_top1: Split
    by_entropy: Split

    @property
    def ceiling_share(self) -> float:
        """The share of the reachable gain (τ − 1) the drafter takes."""
        return (self.tau - 1) / max(1e-9, self.ceiling - 1)

    def totals(self) -> dict[str, float]:
        counts = {o: sum(c[o] for c in self.by_position.counts.values()) for o in OUTCOMES}
        n = sum(counts.values()) or 1
        return {o: counts[o] / n for o in OUTCOMES}


def gap_report(records: list[SequenceRecord], facts: list[SlotFacts], block_size: int,
               oracle_tau: float) -> GapReport:
    """Classify every live slot of a drafter's rebuilt blocks (`records`, e.g. `rebuild_records` on the samples)."""
    report = GapReport(_tau(records), oracle_tau, Split(), Split(), Split())
    for rec, fact in zip(records, facts):
        response = rec.response_ids
        for anchor, draft, accepted in zip(rec.anchors, rec.drafts, rec.accepted):
            for k in range(1, min(accepted + 1, block_size - 1) + 1):  # live: every earlier draft accepted
                j = anchor + k
                if j >= len(response):
                    break
                outcome = _outcome(response[j], int(fact.argmax[j]), draft[k - 1])
                report.by_position.add(f"k={k}", outcome)
                report.by_top1.add(_bucket(float(fact.top1[j]), TOP1_EDGES), outcome)
                report.by_entropy.add(_bucket(float(fact.entropy[j]), ENTROPY_EDGES), outcome)
    for split in (report.by_position, report.by_top1, report.by_entropy):
        split.counts = dict(sorted(split.counts.items(), key=lambda kv: _order(kv[0])))
    return report


def _outcome(committed: int, argmax: int, draft: int) -> str:
    if committed == argmax:
        return "both" if draft == argmax else "lost"
    return "won" if draft == committed else "neither"


def _bucket(value: float, edges: tuple[float, ...]) -> str:
    for low, high in zip(edges, edges[1:]):
        if value < high or high == edges[-1]:
            return f"[{low:g}, {high:g})"
    raise ValueError(value)


def _order(key: str) -> float:
    return float(key[2:]) if key.startswith("k=") else float(key[1:].split(",")[0])


def _tau(records: list[SequenceRecord]) -> float:
    per = [rec.tau for rec in records if rec.accepted]
    return sum(per) / max(1, len(per))
