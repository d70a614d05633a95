"""Full attention (`full_attention`): every causally earlier key, a cache of per-token columns that the decoder packs
per row, and nothing counted beyond the weights: the `LayerKind` defaults. Attention sinks (gpt-oss) need nothing
here: the model's own attention takes them in decoding, and packed replay adds the `s_aux` HF hands it."""

from __future__ import annotations

from opd.models.layer_kind import LayerKind, register


@register
class FullAttention(LayerKind):
    name = "full_attention"
    label = "full-attention"
