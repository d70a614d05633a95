"""The drafter's inference-time context cache, shared by every drafter family (DFlash, EAGLE-3).

Rows of a batch advance at different speeds (ragged acceptance), so entries carry their own position and a
`valid` flag instead of assuming a dense prefix: a hole is simply an entry nobody can attend to. Only
target-verified context is cached; a block's own drafts never are.

A growing cache (`filled` None) extends by concatenation. A preallocated one (`filled` counts the entries written)
has fixed-shape tensors whose unwritten entries are invalid, so attending over the whole capacity equals attending
over the written prefix and every draft sees the same shapes (what CUDA graphs and torch.compile need).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished sequences leave the batch)."""
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
