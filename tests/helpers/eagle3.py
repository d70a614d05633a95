"""An EAGLE-3 drafter that accepts more than a random one: its head reads the target's rows for its draft ids."""

from __future__ import annotations

import torch

from opd.models.eagle3 import Eagle3Drafter
from opd.tiny.micro import micro_eagle3


def trained_like(target, seed: int = 1, block_size: int = 4, draft_vocab_size: int = 6) -> Eagle3Drafter:
    """A random drafter whose head reads the target's head rows for its draft ids, so more chains get accepted."""
    drafter = micro_eagle3(target, seed=seed, block_size=block_size, draft_vocab_size=draft_vocab_size)
    head_reads_target_rows(drafter, target)
    return drafter


@torch.no_grad()
def head_reads_target_rows(drafter, target) -> None:
    """Copy the target's LM-head rows of the draft vocabulary into the drafter's own head (EAGLE-3, P-EAGLE), so
    a random chain drafts what the target would more often than chance."""
    drafter.lm_head.weight.copy_(target.lm_head.weight[drafter.vocab_ids])
