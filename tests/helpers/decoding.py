"""The 8-token float64 micro target's token ids and prompts, its module-scoped fixture, and a drafter that drafts
one constant token (a legitimate point-mass draft whose acceptance a test can steer)."""

from __future__ import annotations

import pytest
import torch

from opd.models.dflash import DFlashDrafter
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
