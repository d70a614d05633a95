"""The selector term of a DFlash 2 drafter's loss: its candidate selector's q against the teacher restricted to the
candidates, at the slots the main loss weighs.

A DFlash 2 slot drafts from q, the selector's softmax over the top-k candidates of the drafter's logits, scored
given the draft before it (opd/models/dflash2.py). The paper's loss (Eqs. 10-13) is a full-vocabulary KL, which
q, zero outside its k candidates, cannot enter: that KL is infinite wherever the teacher has mass elsewhere. So the
paper's loss trains the drafter's logits, as for DFlash, and this term trains the selector: at each slot the
forward KL from p̃, the teacher restricted to the slot's candidates and renormalised, to q. It ranks the candidates
as the target ranks them, which is what both the selector's argmax path (point-mass serving) and a draw from q
(sampled serving) need once the right token is among the candidates, which the main loss sees to.

- The predecessor at slot k is what the rollout scored it with: the anchor at the first slot, then the block's
  drafts (`ScoredBatch.block_ids`); replay's teacher reads the same context, so the two condition alike, accepted
  and rejected slots.
- The candidates are the student's top-k, taken without gradient, and their logits (q's unary term) enter
  detached: the logits are the main loss's to train, so this term reaches only the selector's projection and
  codebooks, and the drafter's hidden through the selector's gate. The gradient then needs no vocabulary-sized
  graph: the logits of a chunk of slots are formed, top-k'd and dropped.
- Each slot's weight is the main loss's (`slot_weights`): γ, the accepted and rejected streams and the step's
  denominators mean what they mean there, and `loss.selector_weight` scales the term against it.

SFT (`sft_selector_loss`) is the same term with the data token as the teacher: the cross-entropy of q at the label,
the predecessor the data token before it (teacher forcing, as the rest of SFT), at slots whose label is among the
candidates (elsewhere q cannot hold it; SFT's cross-entropy on the logits sees to those), weighted as SFT's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from opd.decoding.sampling import Sampling
from opd.distill.family_terms import FamilyTerms, OpdSlots, SftSlots, terms_for
from opd.distill.losses import StepNorm, exact_teacher_logprobs, kl_divergence, slot_weights, valid_positions
from opd.models.dflash2 import CandidateSelector, DFlash2Drafter
from opd.models.lm_head import apply_head, chunks
from opd.models.protocol import Drafter
from opd.spec import LossSpec


def selector_loss(selector: CandidateSelector, head: nn.Module, teacher_head: nn.Module, student: torch.Tensor,
                  teacher: torch.Tensor, predecessors: torch.Tensor, accepted: torch.Tensor,
                  position_mask: torch.Tensor, cfg: LossSpec, norm: StepNorm, *,
                  teacher_processing: Sampling = Sampling(1.0), chunk_size: int | None = None) -> torch.Tensor:
    """This batch's part of the step's selector term: sum over weighted slots of coef x KL(p̃ || q).

    student [N, K-1, H]: the drafter's final hidden states (with grad); teacher [N, K-1, H]: the target's final-norm
    hidden states; predecessors [N, K-1]: the token each slot's candidates were scored after."""
    shape = student.shape[:2]
    valid = valid_positions(shape, position_mask, student.device)
    w = slot_weights(accepted.to(student.device), valid, cfg, norm)
    targets = teacher.flatten(0, 1)[w.rows]

    def restricted(part: slice, candidates: torch.Tensor) -> torch.Tensor:
        logprobs = exact_teacher_logprobs(teacher_head, targets[part], teacher_processing).gather(-1, candidates)
        return torch.log_softmax(logprobs, dim=-1)

    return _term(selector, head, student.flatten(0, 1)[w.rows], predecessors.flatten().to(student.device)[w.rows],
                 w.coef, restricted, chunk_size)


def sft_selector_loss(selector: CandidateSelector, head: nn.Module, student: torch.Tensor, labels: torch.Tensor,
                      predecessors: torch.Tensor, position_mask: torch.Tensor, *, gamma: float,
                      log_weight_sum: float, chunk_size: int | None = None) -> torch.Tensor:
    """SFT's selector term: -log q(label) at slots whose label is a candidate, weighted exp(-(k-1)/gamma) over the
    step's `log_weight_sum` (`sft_loss`'s weights). student [N, K-1, H]; labels, predecessors [N, K-1]."""
    valid = valid_positions(student.shape[:2], position_mask, student.device)
    rows = valid.flatten().nonzero().squeeze(-1)
    coef = torch.exp((rows % student.shape[1]).to(torch.float64) * (-1.0 / gamma) - log_weight_sum)
    wanted = labels.to(student.device).flatten()[rows]

    def one_hot(part: slice, candidates: torch.Tensor) -> torch.Tensor:
        hit = candidates == wanted[part, None]  # [c, k]; a row without its label holds no mass (skipped)
        return torch.where(hit, 0.0, -torch.inf)

    return _term(selector, head, student.flatten(0, 1)[rows], predecessors.flatten().to(student.device)[rows], coef,
                 one_hot, chunk_size)


def _term(selector: CandidateSelector, head: nn.Module, rows: torch.Tensor, before: torch.Tensor, coef: torch.Tensor,
          target: Callable[[slice, torch.Tensor], torch.Tensor], chunk_size: int | None) -> torch.Tensor:
    """sum_r coef_r KL(target_r || q_r) over the student's rows [R, H] in chunks: `target(part, candidates)` gives
    the target's log-probs over each row's candidates (all -inf: the row adds nothing)."""
    assert selector.top_k is not None  # a DFlash 2 config has all four selector fields (`_dflash2_fields`)
    dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    total = rows.new_zeros((), dtype=dtype)
    for part in chunks(len(rows), chunk_size or max(1, len(rows))):
        with torch.no_grad():
            unary, candidates = apply_head(head, rows[part]).topk(selector.top_k, dim=-1)
            log_p = target(part, candidates).to(dtype)
        gate = selector.hidden_projection(rows[part].to(selector.hidden_projection.weight.dtype))
        scores = selector.scores(gate, before[part], unary.to(gate.dtype), candidates)
        log_q = torch.log_softmax(scores.to(dtype), dim=-1)
        kl = torch.where(torch.isinf(log_p).all(-1), 0.0, kl_divergence(log_p, log_q))
        total = total + (coef[part].to(dtype) * kl).sum()
    return total


@terms_for("dflash2")
class SelectorTerms(FamilyTerms):
    """DFlash 2's terms: its candidate selector trains on the term above, `loss.selector_weight` of it, whenever a
    loss reads the selector (this term, or an acceptance objective, whose q is the selector's)."""

    def prepare(self, drafter: Drafter, wanted: bool) -> bool:
        _selector(drafter).requires_grad_(wanted)
        return wanted

    def opd(self, drafter: Drafter, slots: OpdSlots, trains: bool) -> torch.Tensor | float:
        weight = slots.loss.selector_weight
        if not (trains and weight > 0):
            return 0.0
        assert isinstance(slots.teacher, torch.Tensor)  # the spec refuses the selector term with a top-k teacher
        return weight * selector_loss(_selector(drafter), drafter.student_head, drafter.teacher_head, slots.hidden,
                                      slots.teacher, slots.predecessors, slots.accepted, slots.position_mask,
                                      slots.loss, slots.norm, teacher_processing=slots.teacher_processing,
                                      chunk_size=slots.chunk_size)

    def sft(self, drafter: Drafter, slots: SftSlots, selector_weight: float) -> torch.Tensor | float:
        if not selector_weight:
            return 0.0
        return selector_weight * sft_selector_loss(
            _selector(drafter), drafter.student_head, slots.hidden, slots.labels, slots.predecessors,
            slots.position_mask, gamma=slots.gamma, log_weight_sum=slots.log_weight_sum, chunk_size=slots.chunk_size)


def _selector(drafter: Drafter) -> CandidateSelector:
    assert isinstance(drafter, DFlash2Drafter)  # registered for DFlash 2 alone
    return drafter.selector
