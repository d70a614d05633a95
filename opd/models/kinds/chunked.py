"""Chunked attention (`chunked_attention`, Llama 4): a query at position q sees the causally earlier keys of its own
chunk of `attention_chunk_size` positions, p // chunk == q // chunk (HF's `chunked_overlay`, on positions).

As for a sliding window, transformers counts chunks in cache columns and keeps a chunked layer's keys in a sliding
cache layer, which the decoder's per-row packing would corrupt: the layer keeps every key in a plain cache layer and
its chunks are applied by position, in the decoder's masks (`kind_masks`) and in packed replay's
(`packed_attention`); flash-attn and a static cache are refused, as for every kind that narrows its keys.
"""

from __future__ import annotations

import torch
from torch import nn

from opd.errors import OpdError
from opd.models.layer_kind import LayerKind, register


@register
class ChunkedAttention(LayerKind):
    name = "chunked_attention"
    label = "chunked-attention"
    by_distance = False  # a chunk's bounds are fixed positions

    @property
    def chunk(self) -> int:
        return int(self.config.attention_chunk_size)

    @property
    def narrows(self) -> bool:
        return True

    def sees(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return queries // self.chunk == keys // self.chunk

    def lowest_key(self, position: int) -> int:
        return position - position % self.chunk

    def check(self, model: nn.Module) -> None:
        if not getattr(self.config, "attention_chunk_size", None):
            raise OpdError(f"target {type(model).__name__}: chunked-attention layers without an "
                           "`attention_chunk_size` in its config")
        super().check(model)
