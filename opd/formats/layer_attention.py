"""Which keys a DFlash drafter layer's block queries may see besides the structural rule (context before the
anchor, the block's own rows): z-lab's per-layer causality and sliding window.

z-lab's `DFlashDraftModel` (dflash 0.1.0, `Qwen3DFlashAttention`) makes a `sliding_attention` layer causal with a
window of `sliding_window` positions and a `full_attention` layer bidirectional, unless the config's top-level
`is_causal` sets every layer's causality. Distances are in positions, context keys included: a query at position
p sees keys at positions k with p − k < window and, when the layer is not causal, k − p < window; a causal layer
sees k <= p only. The plain DFlash layer (bidirectional, no window) adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads where a rule is applied, so a spec's formats import stays light
    import torch


@dataclass(frozen=True)
class LayerAttention:
    """One drafter layer's rule: `causal` within the block, and a `window` in positions (None: unlimited)."""

    causal: bool = False
    window: int | None = None

    @property
    def plain(self) -> bool:
        """The original DFlash layer: nothing beyond the structural mask."""
        return not self.causal and self.window is None

    def sees(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """Bool, broadcast of query_positions [..., S, 1] against key_positions [..., 1, T]: what this rule allows."""
        import torch

        distance = query_positions - key_positions  # > 0: the key lies before the query
        visible = torch.ones_like(distance, dtype=torch.bool)
        if self.causal:
            visible &= distance >= 0
        if self.window is not None:
            visible &= distance < self.window
            if not self.causal:
                visible &= -distance < self.window
        return visible

    def first_key(self, first_query: int) -> int:
        """The lowest position any query at or after `first_query` can see (0 without a window): keys before it
        need no compute."""
        return 0 if self.window is None else max(0, first_query - self.window + 1)
