"""DFlash 2 drafters for tests: a random one with a selector that competes with the logits, and the micro assets' one saved."""

from __future__ import annotations

import pytest
import torch

from opd.formats.dflash2 import DFlash2Config
from opd.models.dflash import DFlashDrafter
from opd.models.dflash2 import DFlash2Drafter
from opd.models.lm_head import teacher_head
from opd.models.target import load_target
from opd.tiny.micro import micro_drafter
from tests.helpers.decoding import MASK

DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 4, "selector_rank": 4, "selector_top_k": 4}


def dflash2_drafter(target, seed: int = 1, block_size: int = 4, base: DFlashDrafter | None = None,
                    codebook_scale: float = 40.0, kernel_noise: float = 0.3, **fields) -> DFlash2Drafter:
    """A DFlash 2 drafter for `target`: random (or `base`'s DFlash weights), with random base kernels around the
    identity and codebooks scaled so the selector's interaction competes with the logits."""
    base = base or micro_drafter(target, seed=seed, block_size=block_size, mask_token_id=MASK)
    config = DFlash2Config.of(base.config, DFLASH2 | fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = DFlash2Drafter(config, target.embed_tokens, target.lm_head, teacher_head(target))
        drafter.load_state_dict(base.state_dict(), strict=False)
        sharpen(drafter, codebook_scale, kernel_noise)
    return drafter


@torch.no_grad()
def sharpen(drafter: DFlash2Drafter, codebook_scale: float = 40.0, kernel_noise: float = 0.3) -> None:
    """Random base kernels around the identity (noise from the global RNG) and codebooks scaled up, so that the
    convolutions and the selector's interaction change the drafts (a random selector barely moves the logits)."""
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel.add_(kernel_noise * torch.randn_like(conv.base_kernel))
    selector = drafter.candidate_selector
    selector.predecessor_codebook.mul_(codebook_scale)
    selector.successor_codebook.mul_(codebook_scale)


@pytest.fixture
def micro_dflash2(micro_assets, tmp_path):
    """A DFlash 2 drafter for the micro assets' target, saved."""
    target = load_target(micro_assets["target"], dtype=torch.float32, layer_ids=[1, 2])
    base = DFlashDrafter.from_pretrained(micro_assets["drafter"], target)
    config = DFlash2Config.of(base.config, DFLASH2)
    drafter = DFlash2Drafter(config, target.embed_tokens, target.lm_head)
    drafter.load_state_dict(base.state_dict(), strict=False)
    drafter.save_pretrained(tmp_path / "dflash2")
    return str(tmp_path / "dflash2")
