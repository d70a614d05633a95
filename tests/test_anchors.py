"""The random-anchor ablation never scores a slot that nothing verified.

Replay makes every one of a block's K−1 slots exist and counts each slot after `accepted` as a rejection, so
a redrafted block must lie wholly inside the committed response: a slot past its end has no target token to be
checked against and would otherwise be trained as a rejection."""

from __future__ import annotations

import pytest
import torch

from opd.decoding.record import SequenceRecord
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.distill.anchors import redraft_at_random_anchors, verifiable_anchors
from opd.tiny.micro import micro_drafter, micro_target

EOS, MASK, K = 6, 63, 4  # 64 tokens: random rollouts rarely stop early, so responses are several blocks long


@pytest.fixture(scope="module")
def models():
    target = micro_target(seed=0, vocab_size=64, layer_ids=[0, 2])
    return target, micro_drafter(target, seed=1, num_layers=1, block_size=K, mask_token_id=MASK)


@pytest.fixture(scope="module")
def records(models):
    decoder = SpeculativeDecoder(*models, eos_id=EOS)
    return decoder.generate([[1, 2, 3], [4, 5], [3, 0, 2, 2]], Sampling(temperature=1.0), max_new_tokens=12, seed=3)


def _scored_slots(record: SequenceRecord) -> list[tuple[int, str]]:
    """(response index, accepted|rejected) of every slot replay scores, as it reads the record."""
    return [(anchor + k, "accepted" if k <= r else "rejected")
            for anchor, draft, r in zip(record.anchors, record.drafts, record.accepted)
            for k in range(1, len(draft) + 1)]


def test_every_redrafted_slot_lies_inside_the_response(models, records):
    target, drafter = models
    assert all(len(r.response_ids) >= K for r in records)
    for record in records:
        n = len(record.response_ids)
        # Ask for every anchor: the old sampler then always hit the response's last K−1 positions.
        redrafted = redraft_at_random_anchors(target, drafter, record, n, torch.Generator().manual_seed(0))
        assert redrafted.anchors, "a response longer than one block must get random blocks"
        assert len(redrafted.anchors) == verifiable_anchors(n, K - 1) == n - (K - 1)
        past_end = [(i, kind) for i, kind in _scored_slots(redrafted) if i >= n]
        assert not past_end, f"slots past the response end (length {n}) would be scored: {past_end}"


def test_acceptance_is_the_prefix_that_matches_the_committed_text(models, records):
    target, drafter = models
    for record in records:
        redrafted = redraft_at_random_anchors(target, drafter, record, 5, torch.Generator().manual_seed(1))
        for anchor, draft, r in zip(redrafted.anchors, redrafted.drafts, redrafted.accepted):
            committed = record.response_ids[anchor + 1 : anchor + K]
            assert len(draft) == len(committed) == K - 1
            assert draft[:r] == committed[:r] and (r == K - 1 or draft[r] != committed[r])


def test_a_response_shorter_than_a_block_keeps_its_verified_blocks(models):
    target, drafter = models
    short = SequenceRecord(key=0, prompt_ids=[1, 2], response_ids=[3, EOS], anchors=[0], drafts=[[3, 3, 3]],
                           accepted=[0])
    redrafted = redraft_at_random_anchors(target, drafter, short, 4, torch.Generator().manual_seed(0))
    assert (redrafted.anchors, redrafted.drafts, redrafted.accepted) == ([0], [[3, 3, 3]], [0])


def test_chunked_drafts_equal_the_full_logits_drafts(models, records, monkeypatch):
    """Features from the decoder alone and drafts argmax'd 2 slots at a time give what the full forward (its
    [T, V] logits) and all blocks' logits at once gave."""
    target, drafter = models
    monkeypatch.setattr("opd.distill.anchors.SLOTS_PER_CHUNK", 2)
    for record in records:
        redrafted = redraft_at_random_anchors(target, drafter, record, 6, torch.Generator().manual_seed(4))
        committed = torch.tensor([record.prompt_ids + record.response_ids])
        features = target(committed).features
        block_ids = torch.full((1, len(redrafted.anchors), K), MASK, dtype=torch.long)
        block_ids[0, :, 0] = torch.tensor([record.response_ids[a] for a in redrafted.anchors])
        anchor_positions = torch.tensor([[len(record.prompt_ids) + a for a in redrafted.anchors]])
        context = drafter.project_context(features)
        hidden = drafter.forward_blocks(context, torch.ones(context.shape[:2], dtype=torch.bool), block_ids,
                                        anchor_positions)
        assert len(redrafted.drafts) > 1 and redrafted.drafts == drafter.logits(hidden[0, :, 1:]).argmax(-1).tolist()
