"""Acceptance objectives: train a drafter on the acceptance the server realizes when it samples drafts from q.

A server that samples slot k's draft from the drafter's realized law q_k and verifies it with min(1, p̃/q) accepts
it with probability α_k = Σ_v min(p̃_k(v), q_k(v)) = 1 − TV(p̃_k, q_k), given the drafts before it. p̃_k is the
target at that slot processed as the server processes it (temperature, top-k, top-p: `processed_logprobs`), q_k
what the drafter samples from there (`realized_q`: DFlash's logits processed the same way; DFlash 2's selector
softmax at the temperature over its candidates, given the draft sampled at the slot before). α is differentiable
in q, and it is the quantity the paper's argmax labels only approximate at T > 0.

The objectives (`loss.objective`), each on replay's drafted blocks (the rollout sampled them in the serving mode):
- `neg_log_alpha`, `one_minus_alpha`: -log α_k or 1 - α_k per slot, on the paper's slot weights (`slot_weights`:
  the accepted prefix and the γ-decayed rejected stream, the step's denominators), so `first_rejected_only`,
  `lambda_*` and γ mean what they mean for the KL;
- `lk`: the LK hybrid λ KL(p̃ || softmax(logits / T)) + (1 - λ)(1 - α), λ = exp(-η sg[α]), on the same weights.
  The KL is on the drafter's whole-vocabulary distribution at the serving temperature: a DFlash 2 q lives on its
  k candidates, where KL(p̃ || q) is infinite;
- `expected_length`: per block, (1/(K-1)) Σ_k (1 - Π_{j<=k} α_j), the block's expected accepted length 1 + Σ_k
  Π_{j<=k} α_j turned into a loss in [0, 1], a mean over the step's blocks.

The slots after the first depend on the drafts sampled before them, and those drafts depend on the drafter too.
`loss.prefix_gradient: pathwise` treats the sampled prefix as data: the gradient reaches slot k's term through
q_k (and through each α_j of the product) only. `score` adds the score-function term of the prefix, sg[c_k (f_k -
b_k)] ∇ Σ_{j<k} log q_j(d_j), with b_k the mean of f_k over the chunk's other blocks, so that the sum is an
unbiased estimate of the gradient of E_{d~q}[Σ_k c_k f_k] when the slot weights c_k are fixed (exactly so for
`expected_length`; the per-slot objectives' weights follow the realized acceptance, as the paper's do). Its value
is zero: the reported loss is the objective's.

Memory is the KL loss's: blocks go through `chunked_loss` a chunk at a time, each chunk's logits, p̃ and q are
formed, reduced and dropped after that chunk's gradient is taken.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from opd.decoding.sampling import Sampling
from opd.decoding.verify import DraftQ, prob_of
from opd.distill.losses import LossTerms, StepNorm, processed_logprobs, slot_weights, valid_positions
from opd.models.lm_head import apply_head, chunked_loss
from opd.models.protocol import Drafter, chains
from opd.spec import LossSpec

_TINY = 1e-30  # α below this is a slot whose q misses p̃'s support: -log α is then -log of it, without gradient


def realized_q(drafter: Drafter, hidden: torch.Tensor, logits: torch.Tensor, predecessors: torch.Tensor,
               serving: Sampling) -> DraftQ:
    """The law the serving decoder samples each slot's draft from, differentiably: hidden [..., H] and logits
    [..., V] of the slots, predecessors [...] the token sampled before each (the anchor at the first slot).

    A drafter whose slots do not chain samples its processed logits (opd/decoding/verify.py, `sample_draft`); a
    chaining drafter samples the law its family defines given the predecessor (`ChainedDrafter.draft_law`: DFlash 2's
    selector over its top-k candidates, DSpark's logits over the whole vocabulary).
    """
    if not chains(drafter):
        return DraftQ(processed_logprobs(logits, serving).exp())
    return DraftQ(*drafter.draft_law(hidden, logits, predecessors, serving.temperature))


def served_acceptance(teacher_logprobs: torch.Tensor, q: DraftQ) -> torch.Tensor:
    """α [...] = Σ_v min(p̃(v), q(v)) per slot, from log p̃ [..., V] and q over the vocabulary or its `ids`."""
    p = teacher_logprobs.exp()
    if q.ids is not None:
        p = p.gather(-1, q.ids)
    return torch.minimum(p, q.probs.to(p.dtype)).sum(-1)


def slot_objective(objective: str, alpha: torch.Tensor, teacher_logprobs: torch.Tensor, logits: torch.Tensor,
                   serving: Sampling, eta: float, valid: torch.Tensor) -> torch.Tensor:
    """f [N, K-1] of each slot: the per-slot objectives, or for `expected_length` 1 - Π_{j<=k} α_j (α of the
    invalid slots past a response's end, a suffix, count as 1)."""
    if objective == "neg_log_alpha":
        return -torch.log(alpha.clamp_min(_TINY))
    if objective == "one_minus_alpha":
        return 1 - alpha
    if objective == "expected_length":
        return 1 - torch.where(valid, alpha, torch.ones_like(alpha)).cumprod(-1)
    if objective == "lk":
        student = torch.log_softmax(logits.to(teacher_logprobs.dtype) / serving.temperature, dim=-1)
        p = teacher_logprobs.exp()
        kl = (p * torch.where(p > 0, teacher_logprobs - student, 0.0)).sum(-1)
        mix = torch.exp(-eta * alpha.detach())
        return mix * kl + (1 - mix) * (1 - alpha)
    raise ValueError(f"loss.objective: {objective} is not an acceptance objective")


def prefix_score(values: torch.Tensor, coef: torch.Tensor, log_q_drafts: torch.Tensor) -> torch.Tensor:
    """Per block [N]: the score-function term Σ_k sg[c_k (f_k - b_k)] Σ_{j<k} log q_j(d_j), minus its own value (zero
    valued, gradient only). values, coef, log_q_drafts [N, K-1] (log q_j(d_j) at slot j; 0 where unknown)."""
    n = values.shape[0]
    f = values.detach()
    baseline = (f.sum(0, keepdim=True) - f) / (n - 1) if n > 1 else torch.zeros_like(f)
    before = log_q_drafts.cumsum(-1) - log_q_drafts  # Σ_{j<k}
    term = ((coef * (f - baseline)).detach() * before).sum(-1)
    return term - term.detach()


@dataclass
class BlockSlots:
    """A batch's blocks as the acceptance objectives read them."""

    predecessors: torch.Tensor  # [N, K-1] the token sampled before each slot (the anchor first): block_ids
    coef: torch.Tensor  # [N, K-1] each slot's fixed weight in the step's loss (0 for slots outside it)
    accepted_slot: torch.Tensor  # [N, K-1] bool: the slot is in I_acc (for the reported split)
    valid: torch.Tensor  # [N, K-1] bool


def block_slots(predecessors: torch.Tensor, accepted: torch.Tensor, position_mask: torch.Tensor | None,
                cfg: LossSpec, norm: StepNorm) -> BlockSlots:
    """Replayed blocks' slots: the paper's weights (`slot_weights`) for the per-slot objectives, 1 / ((K-1) x the
    step's blocks) at every valid slot for `expected_length`. predecessors [N, K-1]: each block's anchor then its
    drafts (`ScoredBatch.block_ids`)."""
    valid = valid_positions(predecessors.shape, position_mask, predecessors.device)
    accepted = accepted.to(predecessors.device)
    n, k1 = valid.shape
    acc_slot = torch.arange(1, k1 + 1, device=valid.device) <= accepted[:, None]
    if cfg.objective == "expected_length":
        coef = valid.to(torch.float64) / (k1 * max(1, norm.num_blocks))
        return BlockSlots(predecessors, coef, acc_slot & valid, valid)
    w = slot_weights(accepted, valid, cfg, norm)
    coef = torch.zeros(n * k1, dtype=torch.float64, device=valid.device).index_put((w.rows,), w.coef)
    return BlockSlots(predecessors, coef.view(n, k1), acc_slot & valid, valid)


def sft_block_slots(predecessors: torch.Tensor, valid: torch.Tensor, cfg: LossSpec, *, gamma: float,
                    log_weight_sum: float, step_blocks: int) -> BlockSlots:
    """SFT's slots (teacher-forced: each slot's predecessor is the data token before it): SFT's weights
    exp(-(k-1)/gamma) over the step's `log_weight_sum` for the per-slot objectives, 1 / ((K-1) x `step_blocks`) at
    every valid slot for `expected_length`. Every slot counts as accepted (the data is the target's own text)."""
    k1 = valid.shape[1]
    if cfg.objective == "expected_length":
        coef = valid.to(torch.float64) / (k1 * max(1, step_blocks))
    else:
        offsets = torch.arange(k1, device=valid.device, dtype=torch.float64)
        coef = torch.exp(offsets * (-1.0 / gamma) - log_weight_sum).expand_as(valid) * valid
    return BlockSlots(predecessors, coef, valid, valid)


def acceptance_objective(drafter: Drafter, student: torch.Tensor, teacher: torch.Tensor, slots: BlockSlots,
                         cfg: LossSpec, *, serving: Sampling, teacher_processing: Sampling,
                         chunk_size: int | None = None) -> LossTerms:
    """This batch's part of the step's acceptance objective (`cfg.objective`) over `slots` (`block_slots` for
    Draft-OPD's replayed blocks, `sft_block_slots` for SFT's), differentiable w.r.t. the drafter's final hidden
    states `student` [N, K-1, H] and its selector. teacher [N, K-1, H]: the target's final-norm hidden states at
    the same slots. `teacher_processing`: p̃'s processing (the serving setting for `replay.teacher: served`)."""
    split = {"acc": 0.0, "rej": 0.0}
    per_chunk = max(1, (chunk_size or student.shape[0] * student.shape[1]) // student.shape[1])

    def block_loss(x: torch.Tensor, part: slice) -> torch.Tensor:
        logits = apply_head(drafter.student_head, x)
        with torch.no_grad():
            p_log = processed_logprobs(apply_head(drafter.teacher_head, teacher[part]), teacher_processing)
        before = slots.predecessors[part]
        q = realized_q(drafter, x, logits, before, serving)
        alpha = served_acceptance(p_log.to(q.probs.dtype), q)
        values = slot_objective(cfg.objective, alpha, p_log, logits, serving, cfg.lk_eta, slots.valid[part])
        coef = slots.coef[part].to(values.dtype)
        weighted = coef * values
        split["acc"] += float(weighted.detach()[slots.accepted_slot[part]].sum())
        split["rej"] += float(weighted.detach()[~slots.accepted_slot[part]].sum())
        out = weighted.sum(-1)
        if cfg.prefix_gradient == "score":
            out = out + prefix_score(values, coef, _log_q_of_drafts(q, before))
        return out

    ones = torch.ones(student.shape[0], dtype=torch.float64, device=student.device)
    head = [p for p in drafter.student_head.parameters() if p.requires_grad]  # DSpark's markov_w2; none for DFlash
    loss, _ = chunked_loss(None, student, block_loss, ones, per_chunk, [*head, *selector_params(drafter)])
    acc_set = slots.accepted_slot & (slots.coef > 0)
    return LossTerms(loss=loss, acc=torch.tensor(split["acc"], dtype=torch.float64),
                     rej=torch.tensor(split["rej"], dtype=torch.float64),
                     num_acc=int(acc_set.sum()), num_rej=int(((slots.coef > 0) & ~acc_set).sum()))


def _log_q_of_drafts(q: DraftQ, predecessors: torch.Tensor) -> torch.Tensor:
    """log q_j(d_j) [N, K-1] for the drafts d_j = predecessors[:, j + 1] (0 at the last slot, whose draft no later
    slot reads, and where d_j has no mass under the current q: a draft of older weights outside today's candidates)."""
    drafts = torch.cat([predecessors[:, 1:], predecessors[:, -1:]], 1)
    mass = prob_of(q, drafts)
    known = (mass > 0) & (torch.arange(drafts.shape[1], device=drafts.device) < drafts.shape[1] - 1)
    return torch.where(known, torch.log(torch.where(known, mass, torch.ones_like(mass))), 0.0)


def selector_params(drafter: Drafter) -> list[nn.Parameter]:
    """The selector's trainable parameters (none without a selector, or with a frozen one)."""
    return [p for p in drafter.selector.parameters() if p.requires_grad] if chains(drafter) else []
