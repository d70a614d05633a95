"""What rollout records for one sequence: the committed text and, per verification step, the drafting facts.

These are token ids and small integers only, so they are cheap to move between nodes; everything heavy is
recomputed by replay next to the learner.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SequenceRecord:
    """One speculative-decoding rollout.

    Block m starts at response index `anchors[m]` (the anchor is already committed), drafts `drafts[m]`
    (K−1 tokens meant for response indices anchors[m]+1 ..), of which the target accepted `accepted[m]`; the
    target's bonus token then sits at anchors[m] + accepted[m] + 1 and is the next anchor.
    """

    key: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    anchors: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    draft_version: int = 0
    finish_reason: str = ""  # "eos" or "length"

    @property
    def num_steps(self) -> int:
        return len(self.anchors)

    @property
    def tau(self) -> float:
        """Mean acceptance length of this sequence: tokens committed per verification, bonus included."""
        return sum(r + 1 for r in self.accepted) / max(1, len(self.accepted))
