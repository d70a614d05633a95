"""Kimi Delta Attention (Kimi Linear's `linear_attention` layers), through transformers' own module: a Gated DeltaNet
whose decay is per key channel instead of per head. Its module has Gated DeltaNet's structure (one causal conv over
q, k and v, a conv state and a recurrent state, a chunked and a recurrent kernel under module-level names), so the
kind runs Gated DeltaNet's rollback and packed replay around its own kernels; the gate's extra channel axis is
masked per position as the head axis is. Per token it updates each head's dk × dv state as Gated DeltaNet does
(the per-channel decay is still one multiply an element), 7 FLOPs an element.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from opd.models.deltanet import DeltaNetKernels, DeltaRule
from opd.models.kinds.gated_deltanet import GatedDeltaNet
from opd.models.layer_kind import register

RULE = DeltaRule("Kimi Delta Attention", "KimiLinearDeltaAttention", "chunk_kimi_delta_attention",
                 "recurrent_kimi_delta_attention")


@register
class KimiDeltaAttention(GatedDeltaNet):
    @classmethod
    def fits(cls, config: Any) -> bool:
        """Kimi Linear's config fields: one head count and one head width for q, k and v."""
        return hasattr(config, "linear_num_heads") and hasattr(config, "linear_head_dim")

    def kernels(self, model: nn.Module) -> DeltaNetKernels:
        return DeltaNetKernels(model, self.layers, RULE)

    def state_flops(self) -> int:
        c = self.config
        return 7 * len(self.layers) * c.linear_num_heads * c.linear_head_dim * c.linear_head_dim
