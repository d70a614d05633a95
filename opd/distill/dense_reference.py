"""The naive definitions of what packed replay computes: the dense masks that block-sparse attention replaced (the
teacher's [L, L] packed replay mask and the student's [M*K, C+M*K] block mask), and, for a target whose
linear-attention layers read no mask, one forward per block of its own text.

Nothing in the pipeline uses them (at Qwen3 shapes an [L, L] mask is what must never be formed); the tests check the
block-sparse paths against them and bench/scale.py measures what they cost, so both import them from here.
"""

from __future__ import annotations

import torch

from opd.distill.replay import PackedSequence
from opd.models.target import Target


def dense_teacher_mask(p: PackedSequence, block_size: int, length: int) -> torch.Tensor:
    """[length, length] bool: causal over the prefix; block m sees prefix <= its anchor and itself causally."""
    mask = torch.zeros(length, length, dtype=torch.bool)
    mask[: p.prefix_len, : p.prefix_len] = torch.ones(p.prefix_len, p.prefix_len, dtype=torch.bool).tril()
    span = block_size - 2
    for m, anchor in enumerate(p.anchors if p.prefix_len < len(p.ids) else []):
        start = p.prefix_len + m * span
        rows = slice(start, start + span)
        mask[rows, : anchor + 1] = True
        mask[rows, start : start + span] = torch.ones(span, span, dtype=torch.bool).tril()
    for i in range(len(p.ids), length):  # padding rows attend to themselves so no row is all-masked
        mask[i, i] = True
    return mask


def dense_teacher_masks(packed: list[PackedSequence], block_size: int, length: int) -> torch.Tensor:
    return torch.stack([dense_teacher_mask(p, block_size, length) for p in packed])[:, None]


def dense_block_mask(context_valid: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Bool [B,1,M*K,C+M*K]: block m sees valid context before its anchor and all of its own block."""
    batch, num_blocks = anchors.shape
    positions = torch.arange(context_valid.shape[1])
    sees_context = context_valid[:, None, :] & (positions[None, None, :] < anchors[:, :, None])
    sees_context = sees_context.repeat_interleave(block_size, dim=1)
    block_of = torch.arange(num_blocks * block_size) // block_size
    sees_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


@torch.no_grad()
def per_block_states(target: Target, packed: list[PackedSequence], block_size: int, length: int) -> torch.Tensor:
    """Final-norm hidden states [B, length, H] laid out as `packed`, each part from a forward of its own text:
    a row's prefix from a forward over the prefix alone, block m's rows from a forward over the prefix up to its
    anchor followed by the block's tokens (zeros at padding)."""
    span = block_size - 2
    out = torch.zeros(len(packed), length, target.hidden_size, dtype=target.dtype, device=target.device)
    for b, p in enumerate(packed):
        out[b, : p.prefix_len] = target.hidden_states(torch.tensor([p.ids[: p.prefix_len]], device=target.device))[0][0]
        for m, anchor in enumerate(p.anchors if p.prefix_len < len(p.ids) else []):
            start = p.prefix_len + m * span
            own = p.ids[: anchor + 1] + p.ids[start : start + span]
            own_states = target.hidden_states(torch.tensor([own], device=target.device))[0]
            out[b, start : start + span] = own_states[0, anchor + 1 :]
    return out
