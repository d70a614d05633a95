"""Keeping the rollout caches as long as the text, not as long as the drafts.

Each verify step appends a K-slot block to every row of the target's KV cache and of the drafter's context
cache, but a row keeps only its anchor and its accepted drafts (accepted + 1 of the K). Left in place, the
rejected slots are masked holes and the caches grow by K per step while the text grows by τ, K/τ times faster.

So each row's entries are packed to the left: row b uses columns [0, used[b]) (prompt, then committed tokens in
order) and everything to its right is free. After a step, the block's slots move from the end of the cache to
columns used[b] .. used[b] + K − 1, and the cache is cropped to the longest row. Only the K new slots are copied
(the caches' own concatenation already copies the rest), the relative order of a row's entries never changes,
and every cached key carries its own rotary position, so attention over a row is the same set of keys as before:
the tokens stay identical. A row's free columns are masked by `row_mask`, so rows never see each other's data.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

from opd.errors import OpdError
from opd.models.drafter_cache import DrafterCache, move_block
from opd.models.layer_kind import TargetKinds


def row_mask(used: list[int], width: int, device: torch.device) -> torch.Tensor:
    """0/1 mask [B, width]: row b's first used[b] columns hold its entries, the rest are free."""
    return (torch.arange(width, device=device)[None, :] < torch.tensor(used, device=device)[:, None]).long()


def pack_block(x: torch.Tensor, dim: int, used: torch.Tensor, block: int, width: int) -> torch.Tensor:
    """Move the last `block` entries of x along `dim` (batch first) to columns used[b].., then crop to `width`.

    A row's slots past its new length land in its free columns, which its mask hides and the next block
    overwrites.
    """
    move_block(x, dim, used, x.shape[dim] - block, block)
    return x.narrow(dim, 0, width)


def compact(kinds: TargetKinds, target_cache: Cache, draft_cache: DrafterCache, used: list[int], kept: list[int],
            block: int, draft_block: int) -> list[int]:
    """Pack the block both caches just appended (the target's `block` slots, the drafter's first `draft_block` of
    them, which hold every kept slot; row b keeps its first kept[b]); returns the new `used`. `kinds`: the
    target's, which say which of its cache layers hold per-token columns.

    When every row ended at the same column (always at batch 1), each row's block already starts at its own next
    free column: nothing moves, the caches are only cropped, and the drafter's appended `valid` already is the
    packed layout's. A drafter cache whose new context is pending (`DrafterCache.defer`) is told where it goes
    instead, and the next draft writes it there."""
    new_used = [u + n for u, n in zip(used, kept)]
    width = max(new_used)
    uniform = min(used) == max(used)
    if draft_cache.pending is not None:
        columns = None if uniform else torch.tensor(used, device=draft_cache.positions.device)
        if columns is None:
            crop(kinds, target_cache, draft_cache, width)
        else:
            _pack_target(kinds, target_cache, columns, block, width)
            draft_cache.place_pending(columns, width, row_mask(new_used, width, columns.device).bool())
    elif uniform:
        crop(kinds, target_cache, draft_cache, width)
    else:
        columns = torch.tensor(used, device=draft_cache.positions.device)
        _pack_target(kinds, target_cache, columns, block, width)
        draft_cache.keys = [pack_block(k, 2, columns, draft_block, width) for k in draft_cache.keys]
        draft_cache.values = [pack_block(v, 2, columns, draft_block, width) for v in draft_cache.values]
        draft_cache.positions = pack_block(draft_cache.positions, 1, columns, draft_block, width)
        if draft_cache.states is not None:
            draft_cache.states = pack_block(draft_cache.states, 1, columns, draft_block, width)
        draft_cache.valid = row_mask(new_used, width, columns.device).bool()
    draft_cache.dense = min(new_used) == width
    return new_used


def _pack_target(kinds: TargetKinds, target_cache: Cache, columns: torch.Tensor, block: int, width: int) -> None:
    """The target's half of `compact`: its cache layers with per-token columns packed and cropped."""
    for layer in _dynamic_layers(kinds, target_cache):
        layer.keys = pack_block(layer.keys, 2, columns, block, width)
        layer.values = pack_block(layer.values, 2, columns, block, width)


def compact_static(target_cache: Cache, draft_cache: DrafterCache, used: list[int], kept: list[int],
                   block: int) -> list[int]:
    """The packing of fixed-shape caches (`rollout.static_cache`): the step wrote `block` slots at the same
    columns of every row, from the longest row's end; row b's first kept[b] move, in place, to its own next
    columns, and both write counters rewind to the new longest row, so the next block overwrites what was
    rejected. The caches then need only prompt + max_new_tokens + 2K columns, and attention runs over those
    instead of K per step. A drafter cache whose new context is pending is told where it goes (`compact`).
    Returns the new `used`."""
    assert draft_cache.filled is not None, "a static drafter cache counts the columns written"
    pending = draft_cache.pending is not None
    start = draft_cache.filled - (0 if pending else block)
    new_used = [u + n for u, n in zip(used, kept)]
    width = max(new_used)
    layers = _static_layers(target_cache)
    valid = row_mask(new_used, draft_cache.valid.shape[1], draft_cache.valid.device).bool()
    columns = None
    if min(used) != start or max(used) != start:
        columns = torch.tensor(used, device=draft_cache.positions.device)
        moved = [t for layer in layers for t in (layer.keys, layer.values)]
        if not pending:
            moved += [*draft_cache.keys, *draft_cache.values]
        for x in moved:
            move_block(x, 2, columns, start, block)
        if not pending:
            move_block(draft_cache.positions, 1, columns, start, block)
            if draft_cache.states is not None:
                move_block(draft_cache.states, 1, columns, start, block)
    for layer in layers:
        layer.crop(width - start - block)  # a negative count rewinds the layer's write counter
    if pending:
        draft_cache.place_pending(columns, width, valid)
    else:
        draft_cache.filled, draft_cache.valid = width, valid
    return new_used


def crop(kinds: TargetKinds, target_cache: Cache, draft_cache: DrafterCache, width: int) -> None:
    """Drop the columns past `width` (the longest remaining row): after a step, or after rows left the batch."""
    for layer in _dynamic_layers(kinds, target_cache):
        layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]
    draft_cache.crop(width)


def _static_layers(cache: Cache) -> list[StaticLayer]:
    """The target cache's fixed-shape layers (a full-attention target's: the decoder refuses static caches for
    sliding-window and linear-attention targets)."""
    bad = {type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer}
    if bad:
        raise OpdError(f"a static cache packs the target's KV cache per row; {sorted(bad)} cache layers are not "
                       "supported (plain StaticLayer only)")
    return list(cache.layers)


def _dynamic_layers(kinds: TargetKinds, cache: Cache) -> list[DynamicLayer]:
    """The target cache's layers with per-token columns (`LayerKind.columns`), which must be plain growing ones:
    HF's sliding-window layer keeps the batch's last window − 1 columns, not each row's, and would be corrupted by
    moving them. A target whose kinds narrow their keys keeps them as plain layers and applies the narrowing in its
    masks (opd/models/kind_masks.py). A recurrent kind's layers have no columns; its `rollback` rolls them back."""
    layers = kinds.column_layers(cache)
    bad = {type(layer).__name__ for layer in layers if not isinstance(layer, DynamicLayer) or layer.is_sliding}
    if bad:
        raise OpdError(f"speculative decoding packs the target's KV cache per row; {sorted(bad)} cache layers "
                       "are not supported (plain DynamicLayer only)")
    return layers
