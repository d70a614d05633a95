"""The random-anchor ablation: blocks drafted at random response positions instead of at verification anchors.

It keeps the `SequenceRecord` format, so scorer and learner never know which mode produced a batch. The blocks
are drafted by the current drafter on the target's features of the committed sequence, and their acceptance is
what verification would have given: the length of the prefix that matches the committed continuation (the
committed text is a target sample, so "sample the target and accept while equal" is the acceptance rule).

Only blocks whose K−1 drafted slots all land on committed response tokens are drafted: a slot past the end of
the response has nothing to be verified against, and the record format (which replay reads) makes every slot of
a block exist, so such a slot would be scored as a rejection although nothing rejected it. A response too short
for any whole block keeps the blocks its rollout verified.

Sized for a long response: the target runs without its LM head (only its features are read), and the drafts are
argmax'd a chunk of slots at a time (`opd/models/lm_head.py`), so no [T, V] or [slots, V] tensor is formed whole.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from opd.decoding.record import SequenceRecord
from opd.models.lm_head import SLOTS_PER_CHUNK, argmax
from opd.models.protocol import Drafter
from opd.models.target import Target


@torch.no_grad()
def redraft_at_random_anchors(target: Target, drafter: Drafter, record: SequenceRecord, num_anchors: int,
                              generator: torch.Generator) -> SequenceRecord:
    """A copy of `record` whose blocks start at random anchors a whose whole block is verifiable (a+1 .. a+K−1
    are all response tokens); a response shorter than one block keeps the rollout's own, verified, blocks.

    The drafts are the argmax of the drafter's training call (`block_hidden`) fed the committed text, which is
    what the family drafts only when no slot reads the draft before it: the spec allows random anchors to the
    families whose section says so (`random_anchors`)."""
    response, k1 = record.response_ids, drafter.block_size - 1
    candidates = verifiable_anchors(len(response), k1)
    if candidates < 1:
        return record
    pick = torch.randperm(candidates, generator=generator)[: min(num_anchors, candidates)].sort().values.tolist()
    committed = torch.tensor([record.prompt_ids + response], device=target.device)
    _, features = target.hidden_states(committed)  # the decoder alone: no [T, V] logits
    prompt_len = len(record.prompt_ids)
    block_inputs = torch.tensor([[response[a : a + k1] for a in pick]], device=target.device)
    anchor_positions = torch.tensor([[prompt_len + a for a in pick]], device=target.device)
    valid = torch.ones(committed.shape, dtype=torch.bool, device=target.device)
    hidden = drafter.block_hidden(features, committed, valid, anchor_positions, block_inputs)
    drafts = argmax(drafter.student_head, hidden[0], SLOTS_PER_CHUNK).tolist()
    accepted = [_matching_prefix(d, response[a + 1 : a + 1 + k1]) for a, d in zip(pick, drafts)]
    return replace(record, anchors=pick, drafts=drafts, accepted=accepted)


def verifiable_anchors(response_len: int, drafted: int) -> int:
    """How many anchors 0..n−1 have all `drafted` slots inside the response (slot k predicts index a + k)."""
    return max(0, response_len - drafted)


def _matching_prefix(draft: list[int], committed: list[int]) -> int:
    n = 0
    while n < len(committed) and draft[n] == committed[n]:
        n += 1
    return n
