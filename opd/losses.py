"""Draft-OPD's acceptance-aware distillation loss (paper eq. 10-13) and DFlash's SFT loss.

A batch holds N drafted blocks of K-1 drafted positions (block position k = 1..K-1). Block m had r_m drafted
tokens accepted: positions k <= r_m form I_acc, the rest I_rej. Accepted positions are pulled towards the
target with forward KL (mode covering: keep all the mass the target accepts); rejected positions with reverse
KL (mode seeking: stop proposing what the target rejects), down-weighted by gamma^(k-1) because late positions
matter less once an earlier one is rejected. Each set is a weighted mean over its own positions, then the two
are mixed by lambda_acc / lambda_rej.

Numerics: logits arrive in bf16/fp32 (fp64 in tests) and are computed in fp32 at least, in log space. Only the
rows that belong to a set are gathered and only the KL direction that set needs is computed, so padding rows
never touch the maths (garbage or NaN there is harmless) and no [N, K-1, V] fp64 temporary is made unless the
input is fp64. Weighted means are softmaxes of log-weights, so any gamma is safe and an empty set gives 0 with
zero (not NaN) gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from opd.spec import LossSpec


@dataclass
class TopKTeacher:
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


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar, differentiable w.r.t. the student logits
    acc: torch.Tensor  # L_acc, detached
    rej: torch.Tensor  # L_rej, detached
    num_acc: int  # positions in I_acc
    num_rej: int  # positions in I_rej


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs (log-softmax in half precision loses the tails), fp64 for fp64."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def teacher_distribution(teacher_logits: torch.Tensor, *, temperature: float = 1.0,
                         topk: int | None = None) -> torch.Tensor | TopKTeacher:
    """Teacher log-probs at temperature T: the full [N, K-1, V] tensor, or a TopKTeacher when `topk` is set.

    Detached: the target is frozen, so no gradient may flow into it. `topk` >= V keeps the whole vocabulary
    (with an empty tail), which lets a tiny-vocabulary run share a config with a large one.
    """
    with torch.no_grad():
        scaled = teacher_logits.to(_compute_dtype(teacher_logits)) / temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        if topk is None:
            return logprobs
        top, ids = logprobs.topk(min(topk, logprobs.shape[-1]), dim=-1)
        tail = logprobs.scatter(-1, ids, -math.inf).logsumexp(dim=-1)
        return TopKTeacher(ids=ids, logprobs=top, tail_logprob=tail)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) over the last dim from log-probs; terms with a = 0 are 0 (xlogy), with finite gradients."""
    a = log_a.exp()
    gap = torch.where(a > 0, log_a - log_b, 0.0)  # masks -inf - -inf before it can reach the product
    return (a * gap).sum(dim=-1)


def _member_rows(members: torch.Tensor) -> torch.Tensor:
    """Flat row indices (into [N*(K-1)]) of the positions in a set."""
    return members.flatten().nonzero().squeeze(-1)


def _weighted_mean(values: torch.Tensor, rows: torch.Tensor, drafted: int, log_decay: float) -> torch.Tensor:
    """sum(w v) / sum(w) with w = exp((k-1) log_decay): a softmax of log-weights, so no weight underflows
    and an empty set gives 0."""
    offsets = (rows % drafted).to(values.dtype)  # k - 1
    return (torch.softmax(offsets * log_decay, dim=0) * values).sum()


def _bucket_logprobs(student: torch.Tensor, teacher: TopKTeacher,
                     rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher log-probs over the k+1 buckets (top-k ids, then the tail) of the selected rows.

    The student's tail is the logsumexp of its other tokens rather than log(1 - sum), which would cancel to
    garbage exactly when the student is confident. With k = V there is no tail bucket.
    """
    ids = teacher.ids.flatten(0, 1)[rows]
    teacher_top = teacher.logprobs.detach().flatten(0, 1)[rows].to(student.dtype)
    student_top = student.gather(-1, ids)
    if ids.shape[-1] >= student.shape[-1]:
        return student_top, teacher_top
    student_tail = student.scatter(-1, ids, -math.inf).logsumexp(dim=-1, keepdim=True)
    teacher_tail = teacher.tail().detach().flatten(0, 1)[rows].to(student.dtype).unsqueeze(-1)
    return torch.cat([student_top, student_tail], -1), torch.cat([teacher_top, teacher_tail], -1)


def _set_loss(student_logits: torch.Tensor, teacher: torch.Tensor | TopKTeacher, members: torch.Tensor, *,
              forward: bool, log_decay: float) -> torch.Tensor:
    """Weighted mean KL over one position set: forward KL(p || q) or reverse KL(q || p)."""
    rows = _member_rows(members)
    teacher_ref = teacher.logprobs if isinstance(teacher, TopKTeacher) else teacher
    dtype = _compute_dtype(student_logits, teacher_ref)
    student = torch.log_softmax(student_logits.flatten(0, 1)[rows].to(dtype), dim=-1)
    if isinstance(teacher, TopKTeacher):
        student, target = _bucket_logprobs(student, teacher, rows)
    else:
        target = teacher.detach().flatten(0, 1)[rows].to(dtype)
    divergence = _kl(target, student) if forward else _kl(student, target)
    return _weighted_mean(divergence, rows, student_logits.shape[1], log_decay)


def _position_sets(accepted: torch.Tensor, valid: torch.Tensor,
                   first_rejected_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """I_acc = {k <= r_m} and I_rej = {k > r_m} (or only k = r_m + 1), both restricted to valid positions."""
    k = torch.arange(1, valid.shape[1] + 1, device=valid.device)
    r = accepted.to(valid.device).unsqueeze(1)
    rejected = k > r if not first_rejected_only else k == r + 1
    return valid & (k <= r), valid & rejected


def _valid_positions(student_logits: torch.Tensor, position_mask: torch.Tensor | None) -> torch.Tensor:
    """The [N, K-1] positions that count; a mask of the wrong shape is an error, not a broadcast."""
    shape = student_logits.shape[:2]
    if position_mask is None:
        return torch.ones(shape, dtype=torch.bool, device=student_logits.device)
    if position_mask.shape != shape:
        raise ValueError(f"position_mask has shape {tuple(position_mask.shape)}, expected {tuple(shape)}")
    return position_mask.to(device=student_logits.device, dtype=torch.bool)


_FORWARD = {"mixed": (True, False), "all_forward": (True, True), "all_reverse": (False, False)}  # (acc, rej)


def acceptance_aware_loss(student_logits: torch.Tensor, teacher: torch.Tensor | TopKTeacher,
                          accepted: torch.Tensor, cfg: LossSpec,
                          position_mask: torch.Tensor | None = None) -> LossTerms:
    """L = (lambda_acc L_acc + lambda_rej L_rej) / (lambda_acc + lambda_rej), paper eq. 10-13 plus ablations.

    student_logits [N, K-1, V]; teacher: log-probs [N, K-1, V] or a TopKTeacher (see `teacher_distribution`);
    accepted [N]: r_m; position_mask [N, K-1]: False = padding, excluded everywhere.
    """
    if accepted.shape != student_logits.shape[:1]:
        raise ValueError(f"accepted has shape {tuple(accepted.shape)}, expected ({student_logits.shape[0]},)")
    valid = _valid_positions(student_logits, position_mask)
    acc_set, rej_set = _position_sets(accepted, valid, cfg.first_rejected_only)
    acc_forward, rej_forward = _FORWARD[cfg.kl_mode]
    log_gamma = math.log(cfg.gamma)
    acc = _set_loss(student_logits, teacher, acc_set, forward=acc_forward,
                    log_decay=log_gamma if cfg.accepted_decay else 0.0)
    rej = _set_loss(student_logits, teacher, rej_set, forward=rej_forward,
                    log_decay=log_gamma if cfg.rejected_decay else 0.0)
    loss = (cfg.lambda_acc * acc + cfg.lambda_rej * rej) / (cfg.lambda_acc + cfg.lambda_rej)
    return LossTerms(loss=loss, acc=acc.detach(), rej=rej.detach(),
                     num_acc=int(acc_set.sum()), num_rej=int(rej_set.sum()))


def sft_loss(student_logits: torch.Tensor, labels: torch.Tensor, *, gamma: float,
             position_mask: torch.Tensor | None = None) -> torch.Tensor:
    """DFlash SFT: cross-entropy against the data tokens, weighted exp(-(k-1)/gamma), mean over valid positions.

    Labels at masked positions are never read, so padding may hold any id.
    """
    rows = _member_rows(_valid_positions(student_logits, position_mask))
    logprobs = torch.log_softmax(student_logits.flatten(0, 1)[rows].to(_compute_dtype(student_logits)), dim=-1)
    targets = labels.to(student_logits.device).flatten()[rows].unsqueeze(-1)
    nll = -logprobs.gather(-1, targets).squeeze(-1)
    return _weighted_mean(nll, rows, student_logits.shape[1], -1.0 / gamma)
