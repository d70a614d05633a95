"""Draft-OPD's acceptance-aware distillation loss (paper eq. 10-13) and DFlash's SFT loss.

A batch holds N drafted blocks of K-1 drafted positions (block position k = 1..K-1). Block m had r_m drafted
tokens accepted: positions k <= r_m form I_acc, the rest I_rej. Accepted positions are pulled towards the
target with forward KL (mode covering: keep all the mass the target accepts); rejected positions with reverse
KL (mode seeking: stop proposing what the target rejects), down-weighted by gamma^(k-1) because late positions
matter less once an earlier one is rejected. Each set is a weighted mean over its own positions, then the two
are mixed by lambda_acc / lambda_rej.

The means are over a whole optimizer step, not a micro-batch: `StepNorm` holds the step's |I_acc| and Z, known
from the acceptance counts before any forward. Each slot then carries a fixed coefficient, the step's loss is a
plain sum over slots, and micro-batch size, chunk size and the number of learner ranks cannot change the math.

Memory: at Qwen3's 151,936-token vocabulary one [slots, V] fp32 tensor is 0.6 MB per slot, so the loss never
holds all slots' logits. It takes hidden states (the student's, and the target's final-norm states from replay),
forms logits through the shared frozen LM head one chunk of slots at a time, and computes each chunk's gradient
w.r.t. the hidden states right away (`opd/models/lm_head.py`): transient memory is set by the chunk, not the response.

Numerics: log-softmax in fp32 at least (fp64 when the inputs are fp64). Only member slots are computed, so
padding (garbage or NaN) never touches the maths, and an empty set gives 0 with zero (not NaN) gradients.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from opd.decoding.sampling import Sampling
from opd.models.lm_head import SLOTS_PER_CHUNK, apply_head, chunked_loss, map_slots
from opd.spec import LossSpec, ReplaySpec, ServingSpec
from opd.zero_copy import ZeroCopy


@dataclass
class TopKTeacher(ZeroCopy):
    """Teacher distribution kept as its top-k tokens plus one tail bucket (for large vocabularies).

    `tail_logprob` is the exact log-mass of the other tokens when the full distribution was at hand
    (`teacher_distribution` fills it). Deriving it from the top-k log-probs instead rounds a peaked teacher's
    tail to exactly 0 in fp32, which makes the reverse KL infinite; None derives it (for sources that only
    report top-k log-probs).
    """

    ids: torch.Tensor  # [N, K-1, k] long
    logprobs: torch.Tensor  # [N, K-1, k] teacher log-probs of those tokens (temperature already applied)
    tail_logprob: torch.Tensor | None = None  # [N, K-1] log(1 - sum(exp(logprobs))); None = derive it

    def tail(self) -> torch.Tensor:
        """Log-mass of the tail bucket, [N, K-1]; -inf when the top-k tokens hold all the mass."""
        if self.tail_logprob is not None:
            return self.tail_logprob
        head = torch.logsumexp(self.logprobs, dim=-1).clamp(max=0.0)
        return torch.log(-torch.expm1(head))  # log(1 - e^head) without cancellation; mass clamped >= 0

    def rows(self, rows: torch.Tensor) -> TopKTeacher:
        """The selected flat slots (indices into N*(K-1)), as a [R, 1, k] teacher with its tail filled in
        (derived for those rows only, so a chunked loss does not derive the whole tail once per chunk)."""
        picked = TopKTeacher(self.ids.flatten(0, 1)[rows, None], self.logprobs.flatten(0, 1)[rows, None],
                             None if self.tail_logprob is None else self.tail_logprob.flatten(0, 1)[rows, None])
        picked.tail_logprob = picked.tail()
        return picked


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar, differentiable w.r.t. the student input: this batch's share of the step's L
    acc: torch.Tensor  # this batch's share of L_acc, detached
    rej: torch.Tensor  # this batch's share of L_rej, detached
    num_acc: int  # positions in I_acc (this batch)
    num_rej: int  # positions in I_rej (this batch)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs (log-softmax in half precision loses the tails), fp64 for fp64."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def teacher_distribution(teacher_logits: torch.Tensor, *, temperature: float = 1.0,
                         topk: int | None = None) -> torch.Tensor | TopKTeacher:
    """Teacher log-probs at temperature T: the full [N, K-1, V] tensor, or a TopKTeacher when `topk` is set.

    Detached: the target is frozen, so no gradient may flow into it. `topk` >= V keeps the whole vocabulary
    (with an empty tail), which lets a tiny-vocabulary run share a config with a large one.
    """
    with torch.no_grad():
        scaled = teacher_logits.to(compute_dtype(teacher_logits)) / temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        if topk is None:
            return logprobs
        top, ids = logprobs.topk(min(topk, logprobs.shape[-1]), dim=-1)
        tail = logprobs.scatter(-1, ids, -math.inf).logsumexp(dim=-1)
        return TopKTeacher(ids=ids, logprobs=top, tail_logprob=tail)


def processed_logprobs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """log p̃ [..., V]: logits processed as verification processes the target's (`target_probs`: temperature, then
    top-k, then top-p, renormalised; greedy is the argmax's point mass), in fp32 or fp64 as the logits come, and
    differentiable (the drafter's processed logits are its q)."""
    x = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    if sampling.greedy:
        return torch.full_like(x, -math.inf).scatter(-1, x.argmax(-1, keepdim=True), 0.0)
    x = x / sampling.temperature
    if 0 < sampling.top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(sampling.top_k, dim=-1).values[..., -1:], -math.inf)
    logp = torch.log_softmax(x, dim=-1)
    if sampling.top_p < 1.0:
        with torch.no_grad():
            sorted_p, order = logp.exp().sort(dim=-1, descending=True)
            drop = torch.zeros_like(sorted_p, dtype=torch.bool).scatter(
                -1, order, (sorted_p.cumsum(-1) - sorted_p) >= sampling.top_p)
        logp = logp.masked_fill(drop, -math.inf)
        logp = logp - logp.logsumexp(-1, keepdim=True)
    return logp


def teacher_processing(replay: ReplaySpec, serving: ServingSpec | None) -> Sampling:
    """How the losses process the target's logits: at `replay.teacher_temperature`, or as the server verifies
    (`replay.teacher: served`; the spec refuses it without a serving section)."""
    if replay.teacher == "served":
        assert serving is not None  # the spec refuses a served teacher without a serving section
        return Sampling.of(serving)
    return Sampling(replay.teacher_temperature)


def topk_teacher(head: torch.nn.Module, hidden: torch.Tensor, *, temperature: float, topk: int,
                 chunk: int = SLOTS_PER_CHUNK) -> TopKTeacher:
    """`teacher_distribution(head(hidden), topk=...)` for final-norm hidden states [N, K-1, H], with the exact
    tail, formed `chunk` slots at a time: no [slots, V] tensor whole."""

    def top(logits: torch.Tensor, _: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = teacher_distribution(logits, temperature=temperature, topk=topk)
        assert isinstance(t, TopKTeacher) and t.tail_logprob is not None  # with `topk`, top-k and its exact tail
        return t.ids, t.logprobs, t.tail_logprob

    return TopKTeacher(*map_slots(head, hidden, top, chunk))


# ------------------------------------------------------------------------------------------------ position sets


def position_sets(accepted: torch.Tensor, valid: torch.Tensor,
                  first_rejected_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """I_acc = {k <= r_m} and I_rej = {k > r_m} (or only k = r_m + 1), both restricted to valid positions."""
    k = torch.arange(1, valid.shape[1] + 1, device=valid.device)
    r = accepted.to(valid.device).unsqueeze(1)
    rejected = k > r if not first_rejected_only else k == r + 1
    return valid & (k <= r), valid & rejected


def valid_positions(shape: torch.Size, position_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The [N, K-1] positions that count; a mask of the wrong shape is an error, not a broadcast."""
    if position_mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if position_mask.shape != shape:
        raise ValueError(f"position_mask has shape {tuple(position_mask.shape)}, expected {tuple(shape)}")
    return position_mask.to(device=device, dtype=torch.bool)


def _log_decay(cfg: LossSpec) -> tuple[float, float]:
    """log of the per-position decay of (I_acc, I_rej): weight w_k = exp((k-1) log_decay)."""
    log_gamma = math.log(cfg.gamma)
    return (log_gamma if cfg.accepted_decay else 0.0), (log_gamma if cfg.rejected_decay else 0.0)


def _log_weight_sum(members: torch.Tensor, log_decay: float) -> float:
    """log sum_(m,k in set) w_k in float64 (-inf for an empty set); log space, so no small gamma underflows."""
    offsets = members.nonzero()[:, 1].to(torch.float64)
    return float(torch.logsumexp(offsets * log_decay, dim=0)) if len(offsets) else -math.inf


@dataclass(frozen=True)
class StepNorm:
    """Eq. 10-13's denominators for one optimizer step: log |I_acc| (or log sum of weights under accepted decay)
    and log Z, over every block of every micro-batch of the step, on every learner rank."""

    log_acc: float
    log_rej: float
    num_acc: int
    num_rej: int
    num_blocks: int = 0  # the step's drafted blocks (the acceptance objectives' `expected_length` is a mean over them)
    num_verified: int = 0  # the step's verified slots, accepted or first rejected (the confidence term's mean)

    @classmethod
    def of(cls, blocks: Iterable[tuple[torch.Tensor, torch.Tensor]], cfg: LossSpec) -> StepNorm:
        """From (accepted [N], position_mask [N, K-1]) of each micro-batch: small tensors, no forward needed."""
        acc_decay, rej_decay = _log_decay(cfg)
        log_acc = log_rej = -math.inf
        num_acc = num_rej = num_blocks = num_verified = 0
        for accepted, mask in blocks:
            acc_set, rej_set = position_sets(accepted, mask.bool(), cfg.first_rejected_only)
            log_acc = _logaddexp(log_acc, _log_weight_sum(acc_set, acc_decay))
            log_rej = _logaddexp(log_rej, _log_weight_sum(rej_set, rej_decay))
            num_acc, num_rej = num_acc + int(acc_set.sum()), num_rej + int(rej_set.sum())
            num_blocks += int(mask.bool().any(-1).sum())
            num_verified += int(torch.cat(position_sets(accepted, mask.bool(), True), -1).sum())
        return cls(log_acc, log_rej, num_acc, num_rej, num_blocks, num_verified)

    def mix(self, cfg: LossSpec) -> tuple[float, float]:
        """The weights of L_acc and L_rej in L. A step with an empty set is the other set's mean alone (naive
        mode has no rejected slot): mixing in a zero would silently scale the learning rate down."""
        lam_acc = cfg.lambda_acc if self.num_acc else 0.0
        lam_rej = cfg.lambda_rej if self.num_rej else 0.0
        total = lam_acc + lam_rej
        return (lam_acc / total, lam_rej / total) if total > 0 else (0.0, 0.0)


def _logaddexp(a: float, b: float) -> float:
    return b if a == -math.inf else a if b == -math.inf else max(a, b) + math.log1p(math.exp(-abs(a - b)))


@dataclass
class SlotWeights:
    """The member slots of one batch and their fixed coefficients in the step's loss."""

    rows: torch.Tensor  # [R] flat indices into N*(K-1)
    share: torch.Tensor  # [R] float64: w_k / sum of its set's weights over the step (the set's mean)
    coef: torch.Tensor  # [R] float64: share times the set's weight in L (`StepNorm.mix`)
    forward: torch.Tensor  # [R] bool: forward KL(p || q) (else reverse KL(q || p))
    accepted: torch.Tensor  # [R] bool: in I_acc (else I_rej)
    num_acc: int
    num_rej: int


_FORWARD = {"mixed": (True, False), "all_forward": (True, True), "all_reverse": (False, False)}  # (acc, rej)


def slot_weights(accepted: torch.Tensor, position_mask: torch.Tensor, cfg: LossSpec, norm: StepNorm) -> SlotWeights:
    """Coefficients such that the step's L = sum over slots of coef * KL (in that slot's direction)."""
    acc_set, rej_set = position_sets(accepted, position_mask, cfg.first_rejected_only)
    rows = (acc_set | rej_set).flatten().nonzero().squeeze(-1)
    is_acc = acc_set.flatten()[rows]
    offsets = (rows % position_mask.shape[1]).to(torch.float64)

    def per_set(acc_value: float, rej_value: float) -> torch.Tensor:
        return torch.where(is_acc, torch.full_like(offsets, acc_value), torch.full_like(offsets, rej_value))

    share = torch.exp(offsets * per_set(*_log_decay(cfg)) - per_set(norm.log_acc, norm.log_rej))
    acc_forward, rej_forward = _FORWARD[cfg.kl_mode]
    forward = (is_acc & acc_forward) | (~is_acc & rej_forward)
    return SlotWeights(rows, share, per_set(*norm.mix(cfg)) * share, forward, is_acc, int(acc_set.sum()),
                       int(rej_set.sum()))


# ------------------------------------------------------------------------------------------------ divergences


def kl_divergence(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) over the last dim from log-probs; terms with a = 0 are 0 (xlogy), with finite gradients."""
    a = log_a.exp()
    gap = torch.where(a > 0, log_a - log_b, 0.0)  # masks -inf - -inf before it can reach the product
    return (a * gap).sum(dim=-1)


def _bucket_logprobs(student: torch.Tensor, teacher: TopKTeacher) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher log-probs [R, k+1] over the buckets (top-k ids, then the tail) of R rows.

    The student's tail is the logsumexp of its other tokens rather than log(1 - sum), which would cancel to
    garbage exactly when the student is confident. With k = V there is no tail bucket.
    """
    ids = teacher.ids[:, 0]
    teacher_top = teacher.logprobs[:, 0].detach().to(student.dtype)
    student_top = student.gather(-1, ids)
    if ids.shape[-1] >= student.shape[-1]:
        return student_top, teacher_top
    student_tail = student.scatter(-1, ids, -math.inf).logsumexp(dim=-1, keepdim=True)
    teacher_tail = teacher.tail()[:, 0].detach().to(student.dtype).unsqueeze(-1)
    return torch.cat([student_top, student_tail], -1), torch.cat([teacher_top, teacher_tail], -1)


def _slot_divergence(student_logits: torch.Tensor, teacher: torch.Tensor | TopKTeacher, forward: torch.Tensor,
                     acceptance_weight: float = 0.0) -> torch.Tensor:
    """Per-row loss [R] between the student's logits [R, V] and the teacher's log-probs [R, V] (or top-k rows):
    KL, forward or reverse per row, plus `acceptance_weight` x the expected-acceptance term."""
    dtype = compute_dtype(student_logits, teacher.logprobs if isinstance(teacher, TopKTeacher) else teacher)
    student = torch.log_softmax(student_logits.to(dtype), dim=-1)
    if isinstance(teacher, TopKTeacher):
        student, target = _bucket_logprobs(student, teacher)
    else:
        target = teacher.detach().to(dtype)
    fwd = forward.unsqueeze(-1)
    kl = kl_divergence(torch.where(fwd, target, student), torch.where(fwd, student, target))
    if not acceptance_weight:
        return kl
    return kl + acceptance_weight * _rejection_surprisal(student, target)


def _rejection_surprisal(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """-log sum_x q(x) p(x) per row: minus the log-probability that the target accepts a token drawn from q.

    The diagnostic's acceptance p(argmax q) has no gradient; this is its smooth version (equal to it when q is a
    point mass), and it pulls q's mass onto the tokens the target will accept rather than spreading it over p's
    whole support as forward KL does. Over top-k buckets the tail counts as one token (exact when k = V).
    """
    return -torch.logsumexp(student + teacher, dim=-1)


# ------------------------------------------------------------------------------------------------ the losses


def acceptance_aware_loss(student: torch.Tensor, teacher: torch.Tensor | TopKTeacher, accepted: torch.Tensor,
                          cfg: LossSpec, position_mask: torch.Tensor | None = None, *,
                          head: torch.nn.Module | None = None, teacher_head: torch.nn.Module | None = None,
                          teacher_processing: Sampling = Sampling(1.0), norm: StepNorm | None = None,
                          chunk_size: int | None = None) -> LossTerms:
    """This batch's part of L = (lambda_acc L_acc + lambda_rej L_rej) / (lambda_acc + lambda_rej), paper eq. 10-13
    plus ablations; the parts of a step's micro-batches sum to the step's L.

    Without `head`: student logits [N, K-1, V] and teacher log-probs [N, K-1, V] (see `teacher_distribution`)
    or a TopKTeacher. With `head` (the shared frozen LM head): the drafter's final hidden states [N, K-1, H] and
    the target's final-norm hidden states [N, K-1, H] (teacher log-probs, processed by `teacher_processing`, are
    recomputed exactly, chunk by chunk, through `teacher_head`, default `head`: an EAGLE-3 drafter's own head drafts a
    smaller vocabulary, and the teacher is then the target's head over those ids, renormalised) or a TopKTeacher.
    accepted [N]: r_m; position_mask [N, K-1]: False = padding.
    `norm`: the step's denominators (default: this batch is the whole step). `chunk_size`: slots per chunk
    (default: all at once).
    """
    shape = student.shape[:2]
    if accepted.shape != shape[:1]:
        raise ValueError(f"accepted has shape {tuple(accepted.shape)}, expected ({shape[0]},)")
    valid = valid_positions(shape, position_mask, student.device)
    accepted = accepted.to(student.device)
    norm = norm or StepNorm.of([(accepted, valid)], cfg)
    w = slot_weights(accepted, valid, cfg, norm)
    rows = student.flatten(0, 1)[w.rows]

    def divergence(student_logits: torch.Tensor, part: slice) -> torch.Tensor:
        index = w.rows[part]
        target: torch.Tensor | TopKTeacher
        if isinstance(teacher, TopKTeacher):
            target = teacher.rows(index)
        elif head is None:
            target = teacher.flatten(0, 1)[index]
        else:
            target = exact_teacher_logprobs(teacher_head or head, teacher.flatten(0, 1)[index], teacher_processing)
        return _slot_divergence(student_logits, target, w.forward[part], cfg.acceptance_weight)

    loss, kl = chunked_loss(head, rows, divergence, w.coef, chunk_size or len(w.rows))
    shared = w.share * kl
    return LossTerms(loss=loss, acc=shared[w.accepted].sum(), rej=shared[~w.accepted].sum(), num_acc=w.num_acc,
                     num_rej=w.num_rej)


def exact_teacher_logprobs(head: torch.nn.Module | None, hidden: torch.Tensor, processing: Sampling) -> torch.Tensor:
    """Exact teacher log-probs from the target's final-norm hidden states (the same LM head the target ran),
    processed as `processing` says: a temperature (`replay.teacher_temperature`) or the serving setting. `head`
    None: the rows already are logits (`apply_head`)."""
    with torch.no_grad():
        return processed_logprobs(apply_head(head, hidden), processing)


def sft_slot_weights(student: torch.Tensor, position_mask: torch.Tensor | None, gamma: float,
                     log_weight_sum: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows: the valid slots of student [N, K-1, ...] flattened, coef: each one's exp(-(k-1)/gamma) over the step's
    weight sum, `log_weight_sum` in log, default this batch's): every SFT objective weights its slots so."""
    valid = valid_positions(student.shape[:2], position_mask, student.device)
    if log_weight_sum is None:
        log_weight_sum = sft_log_weight_sum(valid, gamma)
    rows = valid.flatten().nonzero().squeeze(-1)
    offsets = (rows % student.shape[1]).to(torch.float64)  # k - 1
    return rows, torch.exp(offsets * (-1.0 / gamma) - log_weight_sum)


def sft_loss(student: torch.Tensor, labels: torch.Tensor, *, gamma: float, position_mask: torch.Tensor | None = None,
             head: torch.nn.Module | None = None, chunk_size: int | None = None,
             log_weight_sum: float | None = None, teacher: torch.Tensor | None = None,
             teacher_head: torch.nn.Module | None = None) -> torch.Tensor:
    """DFlash SFT: cross-entropy against the data tokens, weighted exp(-(k-1)/gamma), mean over valid positions.

    Without `head`: student logits [N, K-1, V]. With `head` (the shared frozen LM head): the drafter's final
    hidden states [N, K-1, H], whose logits are formed `chunk_size` slots at a time (default: all at once).
    `log_weight_sum`: log of the weights' sum over the whole step (`sft_log_weight_sum` of every micro-batch's
    mask, log-added), so micro-batches' losses sum to the step's mean; default: this batch is the step.
    Labels at masked positions are never read, so padding may hold any id.
    With `teacher` (the target's final-norm hidden states [N, K-1, H] at the same slots) the target is the target's
    distribution through `teacher_head` instead of the data token, a soft cross-entropy (EAGLE-3's training-time
    test, over its draft vocabulary); `labels` are then unused.
    """
    rows, coef = sft_slot_weights(student, position_mask, gamma, log_weight_sum)
    targets = labels.to(student.device).flatten()[rows]

    soft = None if teacher is None else teacher.flatten(0, 1)[rows]

    def cross_entropy(student_logits: torch.Tensor, part: slice) -> torch.Tensor:
        logprobs = torch.log_softmax(student_logits.to(compute_dtype(student_logits)), dim=-1)
        if soft is None:
            return -logprobs.gather(-1, targets[part, None]).squeeze(-1)
        target = exact_teacher_logprobs(teacher_head, soft[part], Sampling(1.0)).to(logprobs.dtype)
        return -(target.exp() * logprobs).sum(-1)

    loss, _ = chunked_loss(head, student.flatten(0, 1)[rows], cross_entropy, coef, chunk_size or len(rows))
    return loss


def sft_log_weight_sum(position_mask: torch.Tensor, gamma: float) -> float:
    """log sum over valid positions [N, K-1] of exp(-(k-1)/gamma): an SFT step's denominator (-inf if empty)."""
    return _log_weight_sum(position_mask.bool(), -1.0 / gamma)
