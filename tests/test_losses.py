"""The acceptance-aware loss and the SFT loss match float64 brute-force references written from the formulas.

The references loop over blocks, positions and the vocabulary with scalar autograd ops, so they also give the
reference gradients. Sizes are tiny (V = 11): the point is the bookkeeping of sets, weights and directions.
"""

from __future__ import annotations

import math

import pytest
import torch

from opd.distill.losses import (
    TopKTeacher,
    acceptance_aware_loss,
    sft_log_weight_sum,
    sft_loss,
    teacher_distribution,
    topk_teacher,
)
from opd.models.lm_head import argmax
from opd.spec import LossSpec
from tests.helpers.loss_variants import VARIANTS

N, DRAFTED, V = 4, 5, 11  # blocks, K-1, vocabulary


def logits(seed: int, scale: float = 2.0, shape: tuple[int, ...] = (N, DRAFTED, V)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).requires_grad_()


def random_accepted(seed: int) -> torch.Tensor:
    """Random r_m in 0..K-1, with one block rejected at once and one fully accepted so both sets are used."""
    accepted = torch.randint(0, DRAFTED + 1, (N,), generator=torch.Generator().manual_seed(seed))
    accepted[:2] = torch.tensor([0, DRAFTED])
    return accepted


def probs(row: torch.Tensor) -> list[torch.Tensor]:
    """softmax of one row, written out."""
    exps = [torch.exp(row[v]) for v in range(len(row))]
    total = sum(exps)
    return [e / total for e in exps]


def kl(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """KL(a || b) = sum_v a_v (log a_v - log b_v), skipping a_v = 0."""
    return sum((x * (torch.log(x) - torch.log(y)) for x, y in zip(a, b) if x > 0), torch.zeros((), dtype=torch.float64))


def surprisal(q: list[torch.Tensor], p: list[torch.Tensor]) -> torch.Tensor:
    """-log P(the target accepts a token drawn from q) = -log sum_v q_v p_v."""
    return -torch.log(sum(x * y for x, y in zip(q, p)))


def buckets(dist: list[torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    """The top-k bucket distribution: the listed tokens, then 1 - their sum."""
    top = [dist[i] for i in ids]
    return top + [1 - sum(top)]


def reference_loss(student: torch.Tensor, teacher_logits: torch.Tensor, accepted: torch.Tensor, cfg: LossSpec,
                   mask: torch.Tensor | None = None, top_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Paper eq. 10-13 and the ablation switches, one (m, k) at a time."""
    acc_num = rej_num = student.sum() * 0  # keeps the graph when every position is masked
    acc_den = rej_den = 0.0
    for m in range(student.shape[0]):
        r = int(accepted[m])
        for k in range(1, student.shape[1] + 1):
            if mask is not None and not mask[m, k - 1]:
                continue
            q, p = probs(student[m, k - 1]), probs(teacher_logits[m, k - 1])
            if top_ids is not None:
                q, p = buckets(q, top_ids[m, k - 1].tolist()), buckets(p, top_ids[m, k - 1].tolist())
            if k <= r:
                w = cfg.gamma ** (k - 1) if cfg.accepted_decay else 1.0
                acc_num = acc_num + w * (kl(q, p) if cfg.kl_mode == "all_reverse" else kl(p, q))
                acc_num = acc_num + w * cfg.acceptance_weight * surprisal(q, p)
                acc_den += w
            elif not cfg.first_rejected_only or k == r + 1:
                w = cfg.gamma ** (k - 1) if cfg.rejected_decay else 1.0
                rej_num = rej_num + w * (kl(p, q) if cfg.kl_mode == "all_forward" else kl(q, p))
                rej_num = rej_num + w * cfg.acceptance_weight * surprisal(q, p)
                rej_den += w
    l_acc = acc_num / acc_den if acc_den else acc_num
    l_rej = rej_num / rej_den if rej_den else rej_num
    lam_acc, lam_rej = (cfg.lambda_acc if acc_den else 0.0), (cfg.lambda_rej if rej_den else 0.0)  # empty: no share
    if lam_acc + lam_rej == 0:
        return acc_num * 0 + rej_num * 0
    return (lam_acc * l_acc + lam_rej * l_rej) / (lam_acc + lam_rej)


def assert_matches_reference(student: torch.Tensor, teacher_logits: torch.Tensor, accepted: torch.Tensor,
                             cfg: LossSpec, mask: torch.Tensor | None = None, topk: int | None = None) -> None:
    """Loss and gradient w.r.t. the student logits both equal the brute-force reference's."""
    teacher = teacher_distribution(teacher_logits, topk=topk)
    top_ids = teacher.ids if isinstance(teacher, TopKTeacher) and topk < V else None
    terms = acceptance_aware_loss(student, teacher, accepted, cfg, position_mask=mask)
    (grad,) = torch.autograd.grad(terms.loss, student)
    expected = reference_loss(student, teacher_logits, accepted, cfg, mask, top_ids)
    (expected_grad,) = torch.autograd.grad(expected, student, allow_unused=True, materialize_grads=True)
    assert torch.isfinite(terms.loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(terms.loss, expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_every_variant_matches_the_reference(variant: str) -> None:
    cfg = LossSpec(**VARIANTS[variant])
    assert_matches_reference(logits(1), logits(2).detach(), random_accepted(3), cfg)


def test_set_sizes_and_terms_are_reported() -> None:
    accepted = torch.tensor([0, DRAFTED, 2, 4])
    terms = acceptance_aware_loss(logits(1), teacher_distribution(logits(2)), accepted, LossSpec())
    assert (terms.num_acc, terms.num_rej) == (DRAFTED + 2 + 4, DRAFTED + 3 + 1)
    first = acceptance_aware_loss(logits(1), teacher_distribution(logits(2)), accepted,
                                  LossSpec(first_rejected_only=True))
    assert first.num_rej == 3
    assert not terms.acc.requires_grad and not terms.rej.requires_grad
    torch.testing.assert_close(terms.loss.detach(), (terms.acc + terms.rej) / 2)


@pytest.mark.parametrize("topk", [V, V - 1])
def test_topk_with_at_most_one_tail_token_equals_the_full_loss(topk: int) -> None:
    student, teacher_logits, accepted = logits(4), logits(5), random_accepted(6)
    full = acceptance_aware_loss(student, teacher_distribution(teacher_logits), accepted, LossSpec())
    top = acceptance_aware_loss(student, teacher_distribution(teacher_logits, topk=topk), accepted, LossSpec())
    torch.testing.assert_close(top.loss, full.loss, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("variant", ["mixed", "all_forward", "all_reverse"])
def test_topk_matches_the_bucketed_reference(variant: str) -> None:
    cfg = LossSpec(**VARIANTS[variant])
    assert_matches_reference(logits(7), logits(8).detach(), random_accepted(9), cfg, topk=3)


def test_topk_tail_derived_from_logprobs_equals_the_stored_one() -> None:
    student, accepted = logits(10), random_accepted(11)
    stored = teacher_distribution(logits(12), topk=4)
    derived = TopKTeacher(ids=stored.ids, logprobs=stored.logprobs)
    torch.testing.assert_close(derived.tail(), stored.tail(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(acceptance_aware_loss(student, derived, accepted, LossSpec()).loss,
                               acceptance_aware_loss(student, stored, accepted, LossSpec()).loss)


def test_teacher_temperature_and_topk_values() -> None:
    raw = logits(13).detach()
    torch.testing.assert_close(teacher_distribution(raw, temperature=2.0), torch.log_softmax(raw / 2, dim=-1))
    top = teacher_distribution(raw, temperature=2.0, topk=3)
    expected, ids = torch.log_softmax(raw / 2, dim=-1).topk(3, dim=-1)
    torch.testing.assert_close(top.logprobs, expected)
    assert torch.equal(top.ids, ids)
    torch.testing.assert_close(top.tail().exp(), 1 - expected.exp().sum(-1))
    assert teacher_distribution(raw, topk=10 * V).ids.shape[-1] == V


EDGES = {
    "nothing_accepted": (torch.zeros(N, dtype=torch.long), None),
    "everything_accepted": (torch.full((N,), DRAFTED), None),
    "one_block_fully_accepted": (torch.tensor([DRAFTED]), None),
    "one_position_left": (torch.tensor([1, 3, 0, 5]), torch.zeros(N, DRAFTED, dtype=torch.bool).index_put_(
        (torch.tensor(2), torch.tensor(3)), torch.tensor(True))),
    "everything_masked": (torch.tensor([1, 3, 0, 5]), torch.zeros(N, DRAFTED, dtype=torch.bool)),
}


@pytest.mark.parametrize("edge", EDGES, ids=list(EDGES))
@pytest.mark.parametrize("topk", [None, 3])
def test_edge_cases_have_finite_correct_gradients(edge: str, topk: int | None) -> None:
    accepted, mask = EDGES[edge]
    shape = (len(accepted), DRAFTED, V)
    assert_matches_reference(logits(14, shape=shape), logits(15, shape=shape).detach(), accepted, LossSpec(),
                             mask, topk)


@pytest.mark.parametrize("topk", [None, 3])
def test_tokens_the_teacher_rules_out_add_nothing_to_forward_kl(topk: int | None) -> None:
    teacher_logits = logits(31).detach()
    teacher_logits[..., 3:] = -math.inf  # p = 0 beyond three tokens; top-3 leaves a tail of exactly 0
    assert_matches_reference(logits(32), teacher_logits, random_accepted(33), LossSpec(kl_mode="all_forward"),
                             topk=topk)


def test_empty_sets_are_zero_not_nan() -> None:
    student, teacher = logits(16), teacher_distribution(logits(17))
    all_accepted = acceptance_aware_loss(student, teacher, torch.full((N,), DRAFTED), LossSpec())
    none_accepted = acceptance_aware_loss(student, teacher, torch.zeros(N, dtype=torch.long), LossSpec())
    assert (all_accepted.num_rej, all_accepted.rej.item(), none_accepted.num_acc, none_accepted.acc.item()) == (
        0, 0.0, 0, 0.0)


def test_gradcheck_on_a_tiny_case() -> None:
    student, teacher = logits(18, shape=(2, 3, 4)), teacher_distribution(logits(19, shape=(2, 3, 4)))
    accepted, cfg = torch.tensor([1, 3]), LossSpec(lambda_rej=0.5)
    assert torch.autograd.gradcheck(lambda s: acceptance_aware_loss(s, teacher, accepted, cfg).loss, (student,))


@pytest.mark.parametrize("mode", ["mixed", "all_forward", "all_reverse"])
@pytest.mark.parametrize("topk", [None, 3])
def test_student_equal_to_teacher_gives_zero_loss(mode: str, topk: int | None) -> None:
    student = logits(20, scale=10.0).float()
    teacher = teacher_distribution(student, topk=topk)
    loss = acceptance_aware_loss(student, teacher, random_accepted(21), LossSpec(kl_mode=mode)).loss
    assert abs(loss.item()) < 1e-6


def test_gradient_reaches_only_the_student() -> None:
    student, teacher_logits = logits(22), logits(23)
    full, top = teacher_distribution(teacher_logits), teacher_distribution(teacher_logits, topk=3)
    assert not full.requires_grad and not top.logprobs.requires_grad and not top.tail().requires_grad
    raw_teacher = torch.log_softmax(teacher_logits.detach(), -1).requires_grad_()
    acceptance_aware_loss(student, raw_teacher, random_accepted(24), LossSpec()).loss.backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    assert raw_teacher.grad is None and teacher_logits.grad is None


@pytest.mark.parametrize("topk", [None, 3])
def test_large_logits_and_bf16_are_stable(topk: int | None) -> None:
    student = (torch.rand(N, DRAFTED, V, generator=torch.Generator().manual_seed(25)) * 100 - 50).bfloat16()
    teacher = teacher_distribution(logits(26, scale=50.0).bfloat16(), topk=topk)  # peaked: fp32 tails underflow
    accepted = random_accepted(27)
    half = student.clone().requires_grad_()
    terms = acceptance_aware_loss(half, teacher, accepted, LossSpec())
    terms.loss.backward()
    assert torch.isfinite(terms.loss) and torch.isfinite(half.grad).all() and half.grad.dtype == torch.bfloat16
    single = acceptance_aware_loss(student.float(), teacher, accepted, LossSpec()).loss
    torch.testing.assert_close(terms.loss, single)


def reference_sft(student: torch.Tensor, labels: torch.Tensor, gamma: float, mask: torch.Tensor) -> torch.Tensor:
    """sum_(m,k) w_k * -log q(label) / sum w_k over unmasked positions, w_k = exp(-(k-1)/gamma)."""
    num, den = 0.0, 0.0
    for m in range(student.shape[0]):
        for k in range(1, student.shape[1] + 1):
            if mask[m, k - 1]:
                w = math.exp(-(k - 1) / gamma)
                num = num - w * torch.log(probs(student[m, k - 1])[int(labels[m, k - 1])])
                den += w
    return num / den


def test_sft_loss_matches_the_weighted_ce_reference_and_ignores_padding() -> None:
    student = logits(28)
    labels = torch.randint(0, V, (N, DRAFTED), generator=torch.Generator().manual_seed(29))
    mask = torch.rand(N, DRAFTED, generator=torch.Generator().manual_seed(30)) > 0.3
    padded = student.detach().masked_fill(~mask.unsqueeze(-1), math.nan).requires_grad_()
    loss = sft_loss(padded, labels.masked_fill(~mask, -100), gamma=2.0, position_mask=mask)
    expected = reference_sft(student, labels, 2.0, mask)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-14)
    (grad,), (expected_grad,) = torch.autograd.grad(loss, padded), torch.autograd.grad(expected, student)
    torch.testing.assert_close(grad, expected_grad)
    unmasked = sft_loss(student, labels, gamma=2.0)
    torch.testing.assert_close(unmasked, reference_sft(student, labels, 2.0, torch.ones_like(mask)))


# ------------------------------------------------------------------------------------------------ the LM head helper


def head_and_hidden(seed: int, rows: int = N) -> tuple[torch.nn.Linear, torch.Tensor]:
    """A float64 LM head [V, H=6] and hidden states [rows, DRAFTED, 6]."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(6, V, bias=False).double().requires_grad_(False)
    head.weight.copy_(torch.randn(V, 6, generator=gen, dtype=torch.float64))
    return head, torch.randn(rows, DRAFTED, 6, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_map_slots_equals_the_whole_tensor(chunk: int) -> None:
    head, hidden = head_and_hidden(40)
    assert torch.equal(argmax(head, hidden, chunk), head(hidden).argmax(-1))
    whole = teacher_distribution(head(hidden), temperature=0.7, topk=3)
    chunked = topk_teacher(head, hidden, temperature=0.7, topk=3, chunk=chunk)
    assert torch.equal(chunked.ids, whole.ids) and chunked.ids.shape == (N, DRAFTED, 3)
    torch.testing.assert_close(chunked.logprobs, whole.logprobs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(chunked.tail_logprob, whole.tail_logprob, rtol=1e-12, atol=1e-14)
    assert argmax(head, hidden[:0], chunk).shape == (0, DRAFTED)  # no slot: still the right shape


@pytest.mark.parametrize("chunk", [1, 4, None])
def test_chunked_hidden_state_sft_loss_equals_the_logits_loss(chunk: int | None) -> None:
    head, hidden = head_and_hidden(41)
    hidden.requires_grad_()
    labels = torch.randint(0, V, (N, DRAFTED), generator=torch.Generator().manual_seed(42))
    mask = torch.rand(N, DRAFTED, generator=torch.Generator().manual_seed(43)) > 0.3
    expected = sft_loss(head(hidden), labels, gamma=2.0, position_mask=mask)
    loss = sft_loss(hidden, labels, gamma=2.0, position_mask=mask, head=head, chunk_size=chunk)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    (grad,), (expected_grad,) = torch.autograd.grad(loss, hidden), torch.autograd.grad(expected, hidden)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-14)


def test_sft_parts_with_the_steps_weight_sum_add_up_to_the_whole_loss() -> None:
    student, mask = logits(44), torch.rand(N, DRAFTED, generator=torch.Generator().manual_seed(45)) > 0.3
    labels = torch.randint(0, V, (N, DRAFTED), generator=torch.Generator().manual_seed(46))
    whole = sft_loss(student, labels, gamma=3.0, position_mask=mask)
    halves = [slice(0, 1), slice(1, N)]
    log_sum = math.log(sum(math.exp(sft_log_weight_sum(mask[h], 3.0)) for h in halves))
    parts = [sft_loss(student[h], labels[h], gamma=3.0, position_mask=mask[h], log_weight_sum=log_sum)
             for h in halves]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(sft_loss(student[halves[1]], labels[halves[1]], gamma=3.0,
                                       position_mask=mask[halves[1]]), parts[1])  # its own mean is another number
