"""The student head of a family whose logits are the target's LM head plus a bias its own head adds (DSpark's
Markov term, XPress's refiner readout): rows [h; x] of a slot's final hidden and the head's own features."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn


class BiasedLogits(nn.Module):
    """[h; x] -> lm_head(h) + bias(x). Only `bias` trains: the LM head is the target's, frozen."""

    def __init__(self, head: nn.Module, bias: nn.Linear, hidden_size: int) -> None:
        super().__init__()
        self._parts = (head, bias)  # not submodules: the drafter owns them
        self.hidden_size = hidden_size

    @property
    def weight(self) -> torch.Tensor:
        """The LM head's weight (callers cast hidden rows to its dtype)."""
        return cast(torch.Tensor, self._parts[0].weight)

    def parameters(self, recurse: bool = True):  # type: ignore[override]
        return self._parts[1].parameters(recurse)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        head, bias = self._parts
        hidden, own = rows[..., : self.hidden_size], rows[..., self.hidden_size :]
        return head(hidden) + bias(own.to(bias.weight.dtype)).to(rows.dtype)
