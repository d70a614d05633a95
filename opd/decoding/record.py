"""What rollout records for one sequence: the committed text and, per verification step, the drafting facts.

These are token ids and small integers only, so they are cheap to move between nodes; everything heavy is
recomputed by replay next to the learner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

UNDRAFTED = -1  # the draft_version of a target sample whose blocks are still to be rebuilt (opd/sources/rebuild.py)


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

    @classmethod
    def from_text(cls, key: int, prompt_ids: list[int], response_ids: list[int], eos_id: int) -> SequenceRecord:
        """A target sample without blocks: what any lossless sampler gives, before the rebuild."""
        return cls(key=key, prompt_ids=list(prompt_ids), response_ids=list(response_ids), draft_version=UNDRAFTED,
                   finish_reason="eos" if eos_id in response_ids else "length")

    def clip_to_response(self) -> None:
        """Apply the final-block rule: a block counts only the accepted drafts that lie inside the response.

        The decoder's last block may have accepted drafts past the first eos or beyond max_new_tokens; those are cut
        from the response, so they are not part of the sample and no rebuild from the text could recover them.
        After clipping, a block whose accepted drafts reach the response end (anchor + accepted + 1 == response
        length) has no rejection inside the sample: replay scores none of its slots from there on
        (`opd/distill/replay.py`), since nothing verified them against a committed token."""
        last = len(self.response_ids) - 1
        self.accepted = [min(r, last - a) for a, r in zip(self.anchors, self.accepted)]

    def ends_unrejected(self, block: int) -> bool:
        """Whether block `block`'s accepted drafts run to the response end (its slots from `accepted` on lie past
        the sample: nothing rejected them)."""
        return self.anchors[block] + self.accepted[block] + 1 >= len(self.response_ids)

    @property
    def num_steps(self) -> int:
        return len(self.anchors)

    @property
    def tau(self) -> float:
        """Mean acceptance length of this sequence: tokens committed per verification, bonus included."""
        return sum(r + 1 for r in self.accepted) / max(1, len(self.accepted))
