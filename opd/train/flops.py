"""FLOP accounting, so arms (Draft-OPD, continued SFT, ablations) are compared at matched training compute.

The usual dense estimate: a forward costs 2·P·tokens and a forward+backward 6·P·tokens, where P counts the
weights a token passes through (the LM head included, the embedding lookup excluded). Attention's
sequence-length term is left out on purpose: it is small at these lengths and the same for every arm.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn


def target_matmul_params(model: nn.Module) -> int:
    """Weights a target token passes through: everything but the input embedding, the LM head included
    (even when it is tied to the embedding)."""
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters() if p is not embed and p is not head)
    return body + head.numel()


def drafter_matmul_params(drafter: nn.Module) -> int:
    """The drafter's own weights plus the shared LM head it applies to every drafted slot."""
    return sum(p.numel() for p in drafter.parameters()) + drafter.lm_head.weight.numel()


@dataclass
class FlopCounter:
    target_forward: float = 0.0  # rollout prefill/verification and teacher replay
    drafter_forward: float = 0.0  # drafting in rollout (and random-anchor redrafting)
    drafter_train: float = 0.0  # student forward + backward in the learner

    @property
    def total(self) -> float:
        return self.target_forward + self.drafter_forward + self.drafter_train

    def add_target(self, params: int, tokens: int) -> None:
        self.target_forward += 2.0 * params * tokens

    def add_drafter(self, params: int, tokens: int, *, train: bool) -> None:
        if train:
            self.drafter_train += 6.0 * params * tokens
        else:
            self.drafter_forward += 2.0 * params * tokens

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}
