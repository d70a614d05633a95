"""XPress drafters for tests: a random one whose refiner's bias competes with the logits."""

from __future__ import annotations

import torch

from opd.formats.xpress import XPressConfig
from opd.models.lm_head import teacher_head
from opd.models.xpress import XPressDrafter
from opd.tiny.micro import micro_drafter
from tests.helpers.decoding import MASK

# rank 4, and 2 passes on a block of 4: fewer passes than drafted slots, so the last slot's draft depends on them
XPRESS = {"xpress_rank": 4, "xpress_mlp_ratio": 2, "jacobi_passes": 2}


def xpress_drafter(target, seed: int = 1, block_size: int = 4, passes: int = 2) -> XPressDrafter:
    """An XPress drafter on a random DFlash backbone, its refiner scaled so its bias changes the drafts."""
    base = micro_drafter(target, seed=seed, block_size=block_size, mask_token_id=MASK)
    config = XPressConfig.of(base.config, **(XPRESS | {"jacobi_passes": passes}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = XPressDrafter(config, target.embed_tokens, target.lm_head, teacher_head(target))
        drafter.load_state_dict(base.state_dict(), strict=False)
        sharpen(drafter)
    return drafter


@torch.no_grad()
def sharpen(drafter: XPressDrafter) -> None:
    """The refiner scaled up and its mixer drawn (a fresh one is zero), so that its bias, and the tokens fed to
    it, change the drafts (a random one barely moves the logits)."""
    head = drafter.refiner_head
    head.token_embed.weight.mul_(100.0)
    head.in_proj.weight.mul_(10.0)
    head.readout.weight.mul_(300.0)
    head.mix_l.normal_(std=1.0)
