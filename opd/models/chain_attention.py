"""EAGLE-3's chain attention, which P-EAGLE's chain reads too: each drafted step of M blocks attends to the context
columns before its anchor and to its own block's earlier steps, a chunk of blocks at a time, checkpointed in
training so backward holds no chunk x context scores."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from opd.models.packed_attention import grouped_sdpa


def row_chunks(rows: int, chunk: int) -> list[slice]:
    """Slices of at most `chunk` of `rows` rows (one empty slice for none)."""
    return [slice(start, start + chunk) for start in range(0, max(rows, 1), chunk)]


def chain_attention(q: torch.Tensor, context_k: torch.Tensor, context_v: torch.Tensor, chain_k: torch.Tensor,
                    chain_v: torch.Tensor, visible: torch.Tensor, scale: float, chunk_rows: int) -> torch.Tensor:
    """One chain step for M blocks: q [B,heads,M,d] against the context columns `visible` [B,M,T] (before each
    anchor) and the block's own steps chain_k/v [B,kv,M,S,d]; a chunk of blocks per call, checkpointed in
    training so backward holds no chunk x context scores."""
    steps = chain_k.shape[3]
    outs = []
    for part in row_chunks(q.shape[2], max(1, chunk_rows // max(steps, 1))):
        args = (q[:, :, part], context_k, context_v, chain_k[:, :, part], chain_v[:, :, part], visible[:, part], scale)
        outs.append(checkpoint(_chain_chunk, *args, use_reentrant=False) if torch.is_grad_enabled()
                    else _chain_chunk(*args))
    return torch.cat(outs, dim=2)


def _chain_chunk(q: torch.Tensor, context_k: torch.Tensor, context_v: torch.Tensor, chain_k: torch.Tensor,
                 chain_v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    blocks, steps = chain_k.shape[2], chain_k.shape[3]
    keys = torch.cat([context_k, chain_k.flatten(2, 3)], dim=2)
    values = torch.cat([context_v, chain_v.flatten(2, 3)], dim=2)
    own = torch.arange(blocks * steps, device=q.device) // steps == torch.arange(blocks, device=q.device)[:, None]
    mask = torch.cat([visible, own.expand(len(visible), -1, -1)], dim=2)
    return grouped_sdpa(q, keys, values, mask[:, None], scale)
