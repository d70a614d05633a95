"""DSpark's published SFT objective (arXiv 2607.05147, eq. 10), `models.drafter.sft_objective: dspark`.

At each drafted slot k (teacher-forced: its Markov predecessor is the data token before it), with q_k the drafter's
distribution (its logits with the Markov bias) and p_k the target's at the same position (T = 1):

    0.1 x CE(q_k, y_k) + 0.9 x ||p_k - q_k||_1 + 1.0 x BCE(c_k, 1 - ||p_k - q_k||_1 / 2),

y_k the data token (the target's own sample), c_k the confidence head's acceptance logit
(opd/distill/confidence_loss.py), and the label α_k = 1 - ||p_k - q_k||_1 / 2 = Σ_v min(p_k(v), q_k(v)) the acceptance
of a draft sampled from q_k, detached. The L1 term is the raw distance, not the total variation: the factor 1/2
belongs to the label only (NVIDIA's Megatron-Bridge trainer has it so; speculators' `tv` term is half of it).
Every slot is weighted exp(-(k-1)/gamma), the first drafted slot 1 (DSpark's anchor slot drafts: its k = 1 is the
published k = 0), as `sft_loss` weights cross-entropy, and the sum is over the step's weights, so micro-batches'
parts sum to the step's weighted mean. The published trainers divide by the slot count instead: a constant factor
for a fixed step layout.

The terms need the slot's logits and the target's whole distribution: formed a chunk of slots at a time
(`chunked_loss`), as every other loss here.
"""

from __future__ import annotations

import torch

from opd.decoding.sampling import Sampling
from opd.distill.confidence_loss import confidence_bce, confidence_logits, opd_confidence_loss
from opd.distill.family_terms import FamilyTerms, OpdSlots, SftSlots, terms_for
from opd.distill.losses import compute_dtype, exact_teacher_logprobs, sft_slot_weights
from opd.formats.dspark import DSparkSpec
from opd.formats.section import DrafterSection
from opd.models.lm_head import apply_head, chunked_loss
from opd.models.protocol import Drafter

CE_WEIGHT, L1_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0  # the paper's weights, the published trainers' defaults


def dspark_sft_loss(drafter: Drafter, student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, *,
                    gamma: float, position_mask: torch.Tensor | None = None, chunk_size: int | None = None,
                    log_weight_sum: float | None = None) -> torch.Tensor:
    """This batch's share of the step's DSpark objective, differentiable w.r.t. the drafter's rows student [N, K-1,
    W] (`block_hidden`'s [h; markov_w1[x]]), its Markov head and its confidence head. teacher [N, K-1, H]: the
    target's final-norm hidden states at the same slots; labels [N, K-1]: the data tokens (never read where masked).
    `log_weight_sum`: the step's (`sft_log_weight_sum` log-added over its micro-batches); default this batch's."""
    rows, coef = sft_slot_weights(student, position_mask, gamma, log_weight_sum)
    targets, views = labels.to(student.device).flatten()[rows], teacher.flatten(0, 1)[rows]
    head, confidence = drafter.student_head, confidence_logits(drafter)

    def slot_loss(x: torch.Tensor, part: slice) -> torch.Tensor:
        logits = apply_head(head, x)
        dtype = compute_dtype(logits)
        log_q = torch.log_softmax(logits.to(dtype), dim=-1)
        p = exact_teacher_logprobs(drafter.teacher_head, views[part], Sampling(1.0)).to(dtype).exp()
        ce = -log_q.gather(-1, targets[part, None]).squeeze(-1)
        l1 = (p - log_q.exp()).abs().sum(-1)
        bce = confidence_bce(confidence, x, 1 - l1.detach() / 2).to(dtype)
        return CE_WEIGHT * ce + L1_WEIGHT * l1 + CONFIDENCE_WEIGHT * bce

    trainable = [p for m in (head, confidence) for p in m.parameters() if p.requires_grad]
    loss, _ = chunked_loss(None, student.flatten(0, 1)[rows], slot_loss, coef, chunk_size or max(1, len(rows)),
                           trainable)
    return loss


@terms_for("dspark")
class DSparkTerms(FamilyTerms):
    """DSpark's terms: its confidence head learns the realized acceptance under Draft-OPD
    (`models.drafter.confidence_weight`, opd/distill/confidence_loss.py), and SFT may take DSpark's published
    objective (`models.drafter.sft_objective: dspark`)."""

    def opd(self, drafter: Drafter, slots: OpdSlots, trains: bool) -> torch.Tensor | float:
        weight = _dspark(slots.section).confidence_weight
        if not weight:
            return 0.0
        return weight * opd_confidence_loss(drafter, slots.hidden, slots.accepted, slots.position_mask,
                                            slots.norm.num_verified)

    def sft_objective(self, drafter: Drafter, slots: SftSlots, section: DrafterSection | None) -> torch.Tensor | None:
        if not self.sft_reads_target(section):
            return None
        return dspark_sft_loss(drafter, slots.hidden, slots.view(), slots.labels, gamma=slots.gamma,
                               position_mask=slots.position_mask, chunk_size=slots.chunk_size,
                               log_weight_sum=slots.log_weight_sum)

    def sft_reads_target(self, section: DrafterSection | None) -> bool:
        return section is not None and _dspark(section).sft_objective == "dspark"


def _dspark(section: DrafterSection) -> DSparkSpec:
    assert isinstance(section, DSparkSpec)  # the section of DSpark drafters, whose terms these are
    return section
