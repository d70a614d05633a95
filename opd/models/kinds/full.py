"""Full attention (`full_attention`): every causally earlier key, a cache of per-token columns that the decoder packs
per row, and nothing counted beyond the weights: the `LayerKind` defaults. Attention sinks (gpt-oss) need nothing
here: the model's own attention takes them in decoding, and packed replay adds the `s_aux` HF hands it.

Llama 4's full-attention layers carry no RoPE, and with `attn_temperature_tuning` transformers scales their queries
by log(1 + ⌊(column + 1) / floor_scale⌋), counting the cache's columns, not the query's position. The decoder's
per-row packing and packed replay's drafted blocks put queries at columns other than their positions, so such a
layer is refused.
"""

from __future__ import annotations

from torch import nn

from opd.errors import OpdError
from opd.models.layer_kind import LayerKind, register


@register
class FullAttention(LayerKind):
    name = "full_attention"
    label = "full-attention"

    def check(self, model: nn.Module) -> None:
        nope = getattr(self.config, "no_rope_layers", None) or []
        tuned = [i for i in self.layers if i < len(nope) and not nope[i]]
        if getattr(self.config, "attn_temperature_tuning", False) and tuned:
            raise OpdError(f"target {type(model).__name__}: layers {tuned} scale their queries by cache column "
                           "(attn_temperature_tuning on layers without RoPE), which the decoder's per-row packing "
                           "and packed replay move (docs/guides/target-layer-kind.md)")
        super().check(model)
