"""The masks of a target whose attention kinds narrow their keys (sliding-window, chunked), one per layer kind,
counted in positions.

transformers counts a sliding window (and an attention chunk) in cache columns, and its sliding cache layer keeps
the batch's last window − 1 columns. The speculative decoder packs each row's cache entries to the left and appends a verified
block after the longest row (opd/decoding/compaction.py), so in a shorter row a key's column is not its position:
HF's window would hide keys the row needs, and its sliding cache would have dropped them. So such a target keeps
every key in plain cache layers, and the window is applied here, by position: a key's position is its rank among
its row's attended columns (the 2-D mask's cumulative sum − 1: the prompt or packed cache in order, then the
block), a query's is its position id, and each kind narrows the causal mask by those positions (`LayerKind.sees`;
a sliding layer: q − window < p ≤ q, HF's `sliding_window_overlay` on positions). The masks are [B, 1, T, S], the
size HF's own builder makes.
"""

from __future__ import annotations

import torch

from opd.errors import OpdError
from opd.models.layer_kind import LayerKind


def kind_masks(kinds: dict[str, LayerKind], mask: torch.Tensor,
               position_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Bool masks [B, 1, T, S] per layer kind (`kinds`: the target's attention kinds by layer type) from a 2-D
    padding mask [B, S] over cache + new columns, or from a bool 4-D mask [B, 1, T, T] over the new rows alone
    (a custom pattern, such as the dense replay reference) that each kind then narrows."""
    if mask.dim() == 2:
        key_positions = mask.long().cumsum(-1) - 1
        rows = position_ids.shape[1] if position_ids is not None else key_positions.shape[1]
        queries = position_ids if position_ids is not None else key_positions[:, -rows:]
        allowed = mask.bool()[:, None, None, :] & (key_positions[:, None, None, :] <= queries[:, None, :, None])
    elif mask.dtype == torch.bool and mask.shape[-1] == mask.shape[-2]:
        rows = mask.shape[-2]
        default = torch.arange(rows, device=mask.device).expand(mask.shape[0], -1)
        queries = key_positions = position_ids if position_ids is not None else default
        allowed = mask
    else:
        raise OpdError("target attention_mask: a target with sliding-window or chunked layers takes a 2-D padding "
                       "mask or a bool 4-D mask over the new rows alone (no cache)")
    q, k = queries[:, None, :, None], key_positions[:, None, None, :]
    return {name: _narrowed(allowed, kind.sees(q, k)) for name, kind in kinds.items()}


def _narrowed(allowed: torch.Tensor, sees: torch.Tensor | None) -> torch.Tensor:
    return allowed if sees is None else allowed & sees
