"""Sliding-window attention (`sliding_attention`, with or without sinks): a query at position q sees keys at
positions p with q − window < p ≤ q (HF's `sliding_window_overlay`, on positions).

transformers counts the window in cache columns, and its sliding cache layer keeps the batch's last window − 1
columns. The decoder packs each row's cache to the left (opd/decoding/compaction.py), so in a shorter row a key's
column is not its position: such a target keeps every key in plain cache layers and the window is applied by
position, in the decoder's masks (`kind_masks`) and in packed replay's (`packed_attention`). flash-attn and a
static cache count the window in columns and are refused. Sinks (gpt-oss) enter packed replay's softmax from the
`s_aux` HF hands the attention function (`packed_attention.with_sink_key`); the model's own attention takes them in
decoding.
"""

from __future__ import annotations

import torch
from torch import nn

from opd.errors import OpdError
from opd.models.layer_kind import LayerKind, register


@register
class SlidingAttention(LayerKind):
    name = "sliding_attention"
    label = "sliding-window"

    @property
    def window(self) -> int:
        return int(self.config.sliding_window)

    @property
    def narrows(self) -> bool:
        return True

    def sees(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return queries - keys < self.window

    def lowest_key(self, position: int) -> int:
        return max(0, position - self.window + 1)

    def check(self, model: nn.Module) -> None:
        if not getattr(self.config, "sliding_window", None):
            raise OpdError(f"target {type(model).__name__}: sliding-window layers without a `sliding_window` in its "
                           "config")
        super().check(model)
