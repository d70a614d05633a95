"""Gated DeltaNet linear attention (`linear_attention`: Qwen3.5, Qwen3-Next), through transformers' own modules.

Its cache is a conv state and a recurrent state, with no per-token columns: the decoder cannot pack it per row,
and transformers' `crop` keeps the recurrent state advanced past rejected tokens, so the kind rolls each row back
itself (`RecurrentRollback`, opd/models/recurrent_rollback.py). It reads no mask: packed replay runs each drafted
block from the layer's state at its anchor (`LinearReplay`, opd/models/linear_replay.py). Per token it updates each
value head's dk × dv state, which no weight counts: decay (1), read (2), write (2) and the output's read (2), 7
FLOPs an element; packed replay advances each block's state over up to `SEGMENT` positions more.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from opd.models.deltanet import DeltaNetKernels, DeltaRule
from opd.models.layer_kind import LayerKind, register

RULE = DeltaRule("Gated DeltaNet", "GatedDeltaNet", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


@register
class GatedDeltaNet(LayerKind):
    name = "linear_attention"
    label = "linear-attention"
    columns = False

    @classmethod
    def fits(cls, config: Any) -> bool:
        """Gated DeltaNet's config fields (Qwen3.5, Qwen3-Next); Kimi Linear's layers share the layer type."""
        return hasattr(config, "linear_num_value_heads")

    def kernels(self, model: nn.Module) -> DeltaNetKernels:
        """Its modules and kernels, which the rollback and packed replay run their code around."""
        return DeltaNetKernels(model, self.layers, RULE)

    def static_cache_problem(self) -> str:
        return f"a target that has {self.label} layers (their recurrent states are rolled back per row in a growing cache)"

    def rollback(self, model: nn.Module) -> Any:
        from opd.models.recurrent_rollback import RecurrentRollback

        return RecurrentRollback(model, self.kernels(model))

    def replay(self, model: nn.Module) -> Any:
        from opd.models.linear_replay import LinearReplay

        return LinearReplay(model, self.kernels(model))

    def select_rows(self, layer: Any, keep: torch.Tensor) -> None:
        """transformers' linear-attention cache layers have no `batch_select_indices`; `reorder_cache` selects."""
        layer.reorder_cache(keep)

    def state_flops(self) -> int:
        c = self.config
        return 7 * len(self.layers) * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim

    def block_flops(self) -> int:
        from opd.models.linear_replay import SEGMENT

        return self.state_flops() * SEGMENT
