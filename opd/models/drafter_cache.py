"""The drafter's inference-time context cache, shared by every drafter family (DFlash, EAGLE-3).

Rows of a batch advance at different speeds (ragged acceptance), so entries carry their own position and a
`valid` flag instead of assuming a dense prefix: a hole is simply an entry nobody can attend to. Only
target-verified context is cached; a block's own drafts never are.

A growing cache (`filled` None) extends by concatenation. A preallocated one (`filled` counts the entries written)
has fixed-shape tensors whose unwritten entries are invalid, so attending over the whole capacity equals attending
over the written prefix and every draft sees the same shapes (what CUDA graphs and torch.compile need).

Context may also be deferred (`defer`, a `PendingContext`): the decoder hands over the verified features after each
step, and the next draft projects them in the same forward as its block, as z-lab's drafter does (K-norm and RoPE
once over context and block, not once for each). Compaction, which runs before that draft, only says where the
pending entries go (`place_pending`); `take_pending` and `fold` write them there when they are projected, so the
cache a draft attends to is the one an eager `append` followed by the same packing would have made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PendingContext:
    """Verified context not yet projected: target features [B,T,n*H] at `positions` [B,T] and `valid` [B,T] (a
    DFlash block reads the context alone, so the token after each position is not kept).

    Where its entries go is compaction's word (`DrafterCache.place_pending`): row b's T entries start at column
    `columns[b]` (None: where the cache's entries end, the same column for every row), the cache is then `length`
    entries long (None: its own length plus T) and its validity is `valid_after` (None: the old flags followed by
    these). `start` is the cache's length when the entries were taken for writing."""

    features: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    columns: torch.Tensor | None = None
    length: int | None = None
    valid_after: torch.Tensor | None = None
    start: int = 0

    @property
    def width(self) -> int:
        return self.positions.shape[1]

    def into(self, old: torch.Tensor, new: torch.Tensor, dim: int, static: bool) -> torch.Tensor:
        """`old` (a cache tensor, entries along `dim`) with these entries' values `new` written where they go:
        in place in a preallocated cache, else by concatenation (and packing, and cropping to `length`)."""
        if static:
            if self.columns is None:
                old.narrow(dim, self.start, self.width).copy_(new)
            else:
                place(old, dim, self.columns, new)
            return old
        out = torch.cat([old, new], dim=dim)
        if self.columns is not None:
            move_block(out, dim, self.columns, self.start, self.width)
        return out if self.length in (None, out.shape[dim]) else out.narrow(dim, 0, self.length)


def place(x: torch.Tensor, dim: int, columns: torch.Tensor, source: torch.Tensor) -> None:
    """In place: row b of `source` (its entries along `dim`, batch first) goes to columns columns[b].. of x."""
    block = source.shape[dim]
    index = columns[:, None] + torch.arange(block, device=columns.device)  # [B, block]
    shape = [len(columns)] + [1] * (x.dim() - 1)
    shape[dim] = block
    x.scatter_(dim, index.view(shape).expand_as(source), source)


def move_block(x: torch.Tensor, dim: int, used: torch.Tensor, start: int, block: int) -> None:
    """In place: the `block` entries of every row at columns start.. along `dim` move to columns used[b].... The
    block is copied out first, so a destination that overlaps it reads the old values."""
    place(x, dim, used, x.narrow(dim, start, block).clone())


@dataclass
class DrafterCache:
    """Per drafter layer K/V [B, kv_heads, L, d], each entry's position [B, L] and validity [B, L].

    `states` [B, L, H] is what a chain drafter (EAGLE-3) keeps besides K/V: its layer's output at every cached
    position, from which the first step of a chain starts. DFlash keeps none. `dense`: whoever fills the cache
    knows that every entry is valid and lies before the next anchor (a batch whose rows are all equally long;
    always at batch 1), so a block may attend to all of it without a mask."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor
    valid: torch.Tensor
    filled: int | None = None
    states: torch.Tensor | None = None
    dense: bool = False
    pending: PendingContext | None = None

    @classmethod
    def empty(cls, like: torch.Tensor, *, layers: int, batch_size: int, kv_heads: int, head_dim: int,
              capacity: int | None = None, state_size: int | None = None) -> DrafterCache:
        """An empty cache on `like`'s device and dtype; with `capacity`, preallocated to that many entries."""
        length = capacity or 0
        shape = (batch_size, kv_heads, length, head_dim)
        return cls(keys=[like.new_zeros(shape) for _ in range(layers)],
                   values=[like.new_zeros(shape) for _ in range(layers)],
                   positions=torch.zeros(batch_size, length, dtype=torch.long, device=like.device),
                   valid=torch.zeros(batch_size, length, dtype=torch.bool, device=like.device),
                   filled=None if capacity is None else 0,
                   states=None if state_size is None else like.new_zeros(batch_size, length, state_size))

    @property
    def length(self) -> int:
        return self.positions.shape[1] if self.filled is None else self.filled

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor, valid: torch.Tensor,
               states: torch.Tensor | None = None) -> None:
        """Add entries for `positions` [B, T] (in place): after the filled ones of a preallocated cache, whose
        shapes never change, or by concatenation."""
        valid = valid.to(torch.bool)
        if self.filled is None:
            self.keys = [torch.cat([old, k], dim=2) for old, (k, _) in zip(self.keys, kv)]
            self.values = [torch.cat([old, v], dim=2) for old, (_, v) in zip(self.values, kv)]
            self.positions = torch.cat([self.positions, positions], dim=1)
            self.valid = torch.cat([self.valid, valid], dim=1)
            if states is not None:
                assert self.states is not None  # a cache made with `state_size` is appended states, and only it
                self.states = torch.cat([self.states, states], dim=1)
            return
        start, end = self.filled, self.filled + positions.shape[1]
        if end > self.positions.shape[1]:
            raise ValueError(f"drafter cache capacity {self.positions.shape[1]} exceeded ({end} entries)")
        for old_k, old_v, (k, v) in zip(self.keys, self.values, kv):
            old_k[:, :, start:end] = k
            old_v[:, :, start:end] = v
        self.positions[:, start:end] = positions
        self.valid[:, start:end] = valid
        if states is not None:
            assert self.states is not None
            self.states[:, start:end] = states
        self.filled = end

    def defer(self, features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Hold verified context for the next draft to project (`PendingContext`); the drafter writes any earlier
        pending context first, so there is at most one."""
        if self.pending is not None:
            raise ValueError("drafter cache: context is already pending; write it (the drafter's commit_context) "
                             "before deferring more")
        self.pending = PendingContext(features, positions, valid if valid.dtype == torch.bool else valid.bool())

    def place_pending(self, columns: torch.Tensor | None, length: int | None,
                      valid_after: torch.Tensor | None) -> None:
        """Compaction's word on where the pending entries go (`PendingContext`'s fields of the same names)."""
        assert self.pending is not None, "place_pending is called only while context is pending"
        self.pending.columns, self.pending.length, self.pending.valid_after = columns, length, valid_after

    def take_pending(self) -> PendingContext | None:
        """The pending context, its positions and validity written (the cache's masks are then final), its K/V
        left for the drafter to write layer by layer (`write` or `fold`); None when nothing is pending."""
        p, self.pending = self.pending, None
        if p is None:
            return None
        p.start, static = self.length, self.filled is not None
        valid = p.valid_after if p.valid_after is not None else p.into(self.valid, p.valid, 1, static)
        self.positions, self.valid = p.into(self.positions, p.positions, 1, static), valid
        if static:
            self.filled = p.start + p.width if p.length is None else p.length
        return p

    def write(self, p: PendingContext, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one layer's K/V [B,kv_heads,T,d] of the taken context `p`."""
        static = self.filled is not None
        self.keys[layer] = p.into(self.keys[layer], k, 2, static)
        self.values[layer] = p.into(self.values[layer], v, 2, static)

    def fold(self, p: PendingContext, layer: int, k: torch.Tensor, v: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one layer's K/V of the taken context `p`, which are the first T of k, v [B,kv_heads,T+S,d] (a
        block's S follow), and return the layer's cached keys and values followed by the block's: what the block
        attends to. Where the entries are appended unmoved, one concatenation serves both."""
        end = p.start + p.width
        if self.filled is None and p.columns is None and p.length in (None, end):
            keys, values = torch.cat([self.keys[layer], k], dim=2), torch.cat([self.values[layer], v], dim=2)
            self.keys[layer], self.values[layer] = keys[:, :, :end], values[:, :, :end]
            return keys, values
        self.write(p, layer, k[:, :, : p.width], v[:, :, : p.width])
        return (torch.cat([self.keys[layer], k[:, :, p.width :]], dim=2),
                torch.cat([self.values[layer], v[:, :, p.width :]], dim=2))

    def crop(self, width: int) -> None:
        """Drop the entries past `width` (the longest row), pending context included when it is written."""
        if self.pending is not None:
            self.pending.length = width if self.pending.length is None else min(self.pending.length, width)
        if self.positions.shape[1] <= width:  # nothing to drop (at batch 1 the drafter appends only kept slots)
            return
        self.keys = [k[:, :, :width] for k in self.keys]
        self.values = [v[:, :, :width] for v in self.values]
        self.positions, self.valid = self.positions[:, :width], self.valid[:, :width]
        if self.states is not None:
            self.states = self.states[:, :width]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished sequences leave the batch; the drafter writes pending context
        first, `commit_context`, so that it is projected with the rows it was verified with)."""
        assert self.pending is None, "pending context is written before rows leave the batch"
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.positions = self.positions[rows]
        self.valid = self.valid[rows]
        if self.states is not None:
            self.states = self.states[rows]

    def visible_before(self, anchor_positions: torch.Tensor) -> torch.Tensor:
        """Bool [B, L]: the valid entries a block anchored at `anchor_positions` [B] may attend to (position before
        the anchor)."""
        return self.valid & (self.positions < anchor_positions[:, None])
