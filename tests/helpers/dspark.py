"""DSpark drafters for tests: a random one whose Markov head's bias competes with the logits."""

from __future__ import annotations

from dataclasses import fields

import torch

from opd.formats.dflash import DFlashConfig
from opd.formats.dspark import DSparkConfig
from opd.models.dspark import DSparkDrafter
from opd.models.lm_head import teacher_head
from opd.tiny.micro import micro_drafter
from tests.helpers.decoding import MASK


def dspark_drafter(target, seed: int = 1, block_size: int = 4, rank: int = 4) -> DSparkDrafter:
    """A DSpark drafter on a random DFlash backbone, its Markov head scaled so its bias competes with the logits."""
    base = micro_drafter(target, seed=seed, block_size=block_size, mask_token_id=MASK)
    config = DSparkConfig(**{f.name: getattr(base.config, f.name) for f in fields(DFlashConfig)}, markov_rank=rank)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = DSparkDrafter(config, target.embed_tokens, target.lm_head, teacher_head(target))
        drafter.load_state_dict(base.state_dict(), strict=False)
        sharpen(drafter)
    return drafter


@torch.no_grad()
def sharpen(drafter: DSparkDrafter) -> None:
    """The Markov head scaled up, so that its bias changes the drafts (a random one barely moves the logits)."""
    drafter.markov_head.markov_w1.weight.mul_(30.0)
    drafter.markov_head.markov_w2.weight.mul_(15.0)
