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
        self.accepted = [min(r, room) for r, room in zip(self.accepted, self.rooms)]

    def ends_unrejected(self, block: int) -> bool:
        """Whether block `block`'s accepted drafts run to the response end (its slots from `accepted` on lie past
        the sample: nothing rejected them)."""
        return self.accepted[block] >= self.room(block)

    def room(self, block: int) -> int:
        """The response tokens after block `block`'s anchor: drafted position k lies inside the response iff
        k <= room, and no block can write more than its room."""
        return len(self.response_ids) - 1 - self.anchors[block]

    @property
    def rooms(self) -> list[int]:
        return [self.room(m) for m in range(len(self.anchors))]

    @property
    def written(self) -> list[int]:
        """Per block, the tokens it wrote into the response: its accepted drafts and the bonus, min(accepted + 1,
        room). Only a final block differs from accepted + 1: its bonus (or its accepted drafts past the first eos
        or the length limit) lies past the response end, was never committed, and is not counted, as z-lab's
        `dflash_generate` counts it. Over a record the counts sum to the response length − 1 (the prefill's
        token is no verification's)."""
        return [min(r + 1, room) for r, room in zip(self.accepted, self.rooms)]

    @property
    def num_steps(self) -> int:
        return len(self.anchors)

    @property
    def tau(self) -> float:
        """Mean acceptance length of this sequence: tokens written per verification (`written`)."""
        return sum(self.written) / max(1, len(self.accepted))
