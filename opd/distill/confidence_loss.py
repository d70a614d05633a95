"""A DSpark drafter's confidence head, trained: binary cross-entropy of its acceptance logit at each slot.

The head predicts c_k, the probability that slot k's draft is accepted given that the slots before it were: the
quantity a server with variable-length verification multiplies along the block (Π_{j<=k} c_j) to decide how far to
verify. Two labels teach it that:

- SFT (DSpark's published objective, opd/distill/dspark_loss.py): the analytical acceptance α_k = Σ_v min(p_k(v),
  q_k(v)) = 1 - ||p_k - q_k||_1 / 2 of a draft sampled from q at a teacher-forced slot, a soft label, detached;
- Draft-OPD (`models.drafter.confidence_weight`, `opd_confidence_loss`): the rollout's realized acceptance, 1 at the slots
  the target accepted and 0 at the first rejected one. The slots after it were never verified, so they carry no
  label (a conditional acceptance given a rejected prefix does not exist). Drafted as the server drafts them, the
  label is a draw whose mean is the acceptance the head should predict, so the expected loss is the BCE against it.

The head reads the slot's training row [h_k; markov_w1[x_k]] (`block_hidden`), so its gradient reaches the
backbone and markov_w1 as speculators' DSpark training lets it. Its input is a few hundred numbers per slot and no
vocabulary-sized tensor is formed, so it needs no chunking.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn
from torch.nn.functional import binary_cross_entropy_with_logits

from opd.distill.losses import compute_dtype, position_sets, valid_positions
from opd.errors import OpdError
from opd.models.protocol import Drafter


class _Confident(Protocol):
    @property
    def confidence_logits(self) -> nn.Module: ...


def confidence_logits(drafter: Drafter) -> nn.Module:
    """The drafter's confidence head on training rows (-> logits); one line naming the field when it has none
    (the spec refuses the objectives that need one for other families, opd/spec/rules.py)."""
    if not hasattr(drafter, "confidence_logits"):
        raise OpdError(f"models.drafter.kind: {type(drafter).__name__} has no confidence head (expected dspark)")
    return cast(_Confident, drafter).confidence_logits


def confidence_bce(head: nn.Module, rows: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """BCE(σ(head(rows_r)), labels_r) per row [R] of rows [R, W] (labels [R] in [0, 1], detached), in fp32 at least
    (fp64 for fp64 rows)."""
    dtype = compute_dtype(rows)
    return binary_cross_entropy_with_logits(head(rows).to(dtype), labels.detach().to(dtype), reduction="none")


def realized_acceptance(accepted: torch.Tensor, position_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels [N, K-1]: 1 at the accepted slots, verified [N, K-1]: the accepted slots and the first rejected one)
    of blocks with r_m = accepted [N] drafts accepted, restricted to the valid slots."""
    acc, first_rejected = position_sets(accepted, position_mask.bool(), first_rejected_only=True)
    return acc.to(torch.float64), acc | first_rejected


def opd_confidence_loss(drafter: Drafter, student: torch.Tensor, accepted: torch.Tensor,
                        position_mask: torch.Tensor | None, step_verified: int) -> torch.Tensor:
    """This batch's part of the step's mean BCE between the confidence head at the drafted slots (student [N, K-1,
    W], `block_hidden`'s rows with grad) and the realized acceptance; `step_verified`: the step's verified slots
    (`StepNorm.num_verified`)."""
    valid = valid_positions(student.shape[:2], position_mask, student.device)
    labels, verified = realized_acceptance(accepted.to(student.device), valid)
    return confidence_bce(confidence_logits(drafter), student[verified], labels[verified]).sum() / max(1, step_verified)
