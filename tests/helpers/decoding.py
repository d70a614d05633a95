"""The 8-token float64 micro target's token ids and prompts, its module-scoped fixture, a drafter that drafts
one constant token (a legitimate point-mass draft whose acceptance a test can steer), and the two references every
family's exactness tests hold decoding to: a block drafted alone, and the rebuild from the committed text."""

from __future__ import annotations

import pytest
import torch

from opd.decoding.record import SequenceRecord
from opd.models.dflash import DFlashDrafter
from opd.models.drafter_cache import DrafterCache
from opd.sources.rebuild import rebuild_records
from opd.tiny.micro import micro_drafter, micro_target

EOS, MASK = 6, 7
PROMPT = [1, 2, 3]
MIXED_PROMPTS = [[1, 2, 3], [4, 5], [1, 1, 1, 1, 2], [3], [2, 2], [0, 1, 2, 3, 4, 5], [5, 4], [1]]


@pytest.fixture(scope="module")
def target():
    """The float64 micro target with an 8-token vocabulary (no argmax ties), feeding layers 0, 2 and 3."""
    return micro_target(seed=0, vocab_size=8, layer_ids=[0, 2, 3])


class ConstantDrafter(DFlashDrafter):
    """Drafts the same token everywhere: a legitimate point-mass draft whose acceptance we can steer."""

    token: int = 0

    def draft(self, cache, anchor_ids, anchor_positions):
        tokens = torch.full((len(anchor_ids), self.block_size - 1), self.token, dtype=torch.long)
        return tokens, None


def constant_drafter(target, token: int, block_size: int = 4) -> ConstantDrafter:
    base = micro_drafter(target, block_size=block_size, mask_token_id=MASK)
    drafter = ConstantDrafter(base.config, target.embed_tokens, target.lm_head)
    drafter.token = token
    return drafter


def fresh_cache(drafter, features: torch.Tensor, ids: torch.Tensor, anchor: int) -> DrafterCache:
    """A new cache of the text `ids` [1, T] before absolute position `anchor` (and each entry's next token, for a
    drafter that reads it), as decoding holds it when it drafts the block there."""
    cache = drafter.new_cache(1)
    next_ids = ids[:, 1:anchor + 1] if drafter.reads_next_ids else None
    drafter.extend_cache(cache, features[:, :anchor], torch.arange(anchor)[None],
                         torch.ones(1, anchor, dtype=torch.bool), next_ids)
    return cache


def drafted_alone(drafter, features: torch.Tensor, ids: torch.Tensor, anchor: int):
    """(drafts [K-1], logits [K-1, V]) of the block at absolute position `anchor` of the text `ids` [1, T], drafted
    by itself from a fresh cache of the text before it, as decoding drafts a block."""
    drafts, logits = drafter.draft(fresh_cache(drafter, features, ids, anchor), ids[:, anchor],
                                   torch.tensor([anchor]))
    return drafts[0], logits[0]


def assert_rebuild_recovers(target, drafter, decoded, batch_size: int) -> None:
    """The rebuild (opd/sources/rebuild.py) gives decoding's records back from the committed text alone."""
    samples = [SequenceRecord.from_text(r.key, r.prompt_ids, r.response_ids, EOS) for r in decoded]
    rebuilt = rebuild_records(target, drafter, samples, batch_size=batch_size)
    assert [(r.anchors, r.drafts, r.accepted) for r in rebuilt] == [(r.anchors, r.drafts, r.accepted) for r in decoded]
