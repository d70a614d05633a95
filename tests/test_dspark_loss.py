"""DSpark's confidence head trained: the published SFT objective (opd/distill/dspark_loss.py) against a per-slot
written-out definition in float64, the head learning the acceptance it is told, Draft-OPD's realized-acceptance term
(opd/distill/confidence_loss.py), and the spec refusing both for a family without a confidence head."""

from __future__ import annotations

import pytest
import torch

from opd.distill.confidence_loss import opd_confidence_loss, realized_acceptance
from opd.formats.dspark import DSparkSpec
from opd.spec import SpecError, load_spec
from opd.tiny.micro import micro_target
from opd.train.sft import sft_batch_loss, sft_micro_batches
from tests.helpers.dspark import dspark_drafter
from tests.helpers.records import EXAMPLES

GAMMA = 2.0

PUBLISHED = DSparkSpec(sft_objective="dspark")  # the section that asks SFT for DSpark's published objective


@pytest.fixture(scope="module")
def target():
    return micro_target(seed=0, vocab_size=16, layer_ids=[0, 2, 3])


@pytest.fixture
def drafter(target):
    return dspark_drafter(target, block_size=5)


def _batch(block_size: int):
    (batch,) = sft_micro_batches(EXAMPLES, anchors_per_seq=5, max_length=12, block_size=block_size,
                                 micro_batch_size=3, generator=torch.Generator().manual_seed(2))
    assert batch.position_mask.sum() < batch.position_mask.numel()  # blocks running past a sequence's end
    return batch


def _dense_dspark_loss(target, drafter, batch) -> torch.Tensor:
    """The objective slot by slot, as the paper writes it: 0.1 CE + 0.9 ||p - q||_1 + BCE(σ(c), 1 - ||p - q||_1 / 2),
    each slot weighted exp(-(k-1)/γ), over the weights' sum."""
    hidden_t, features = target.hidden_states(batch.ids, attention_mask=batch.valid.long())
    rows = drafter.block_hidden(features, batch.ids, batch.valid, batch.anchor_pos, batch.inputs)
    h = drafter.config.hidden_size
    total, weights = torch.zeros((), dtype=torch.float64), 0.0
    for b, m in batch.block_valid.nonzero().tolist():
        for k in range(drafter.block_size - 1):
            if not batch.label_ok[b, m, k]:
                continue
            row = rows[b, m, k]
            q = torch.softmax(drafter.lm_head(row[:h]) + drafter.markov_head.markov_w2(row[h:]), -1)
            p = torch.softmax(target.lm_head(hidden_t[b, batch.input_pos[b, m, k]]), -1)
            l1 = (p - q).abs().sum()
            alpha = 1 - l1.detach() / 2
            c = torch.sigmoid(drafter.confidence_head.proj(row)[0])
            bce = -(alpha * torch.log(c) + (1 - alpha) * torch.log(1 - c))
            w = torch.exp(torch.tensor(-k / GAMMA, dtype=torch.float64))
            total = total + w * (0.1 * -torch.log(q[batch.labels[b, m, k]]) + 0.9 * l1 + bce)
            weights += float(w)
    return total / weights


def test_the_objective_equals_its_per_slot_definition(target, drafter):
    """Value and every parameter's gradient (backbone, both Markov tensors, the confidence head) in float64, the
    chunked path cut into chunks that do not divide the slots."""
    batch = _batch(drafter.block_size)
    _dense_dspark_loss(target, drafter, batch).backward()
    want = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad(set_to_none=True)
    loss = sft_batch_loss(target, drafter, batch, gamma=GAMMA, chunk_size=3, section=PUBLISHED)
    loss.backward()
    got = {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
    assert {"confidence_head.proj.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
            "fc.weight"} <= set(want) and set(got) == set(want)
    with torch.no_grad():
        torch.testing.assert_close(loss, _dense_dspark_loss(target, drafter, batch), rtol=1e-12, atol=1e-14)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-10, atol=1e-13, msg=name)


def _calibration_error(target, drafter, batch) -> float:
    """Mean |σ(c_k) - α_k| over the batch's slots: how far the head is from the acceptance it is taught."""
    with torch.no_grad():
        hidden_t, features = target.hidden_states(batch.ids, attention_mask=batch.valid.long())
        rows = drafter.block_hidden(features, batch.ids, batch.valid, batch.anchor_pos, batch.inputs)
        q = torch.softmax(drafter.student_head(rows), -1)
        views = hidden_t[torch.arange(len(batch.ids))[:, None, None], batch.input_pos]
        alpha = torch.minimum(q, torch.softmax(target.lm_head(views), -1)).sum(-1)
        c = torch.sigmoid(drafter.confidence_logits(rows))
        return float((c - alpha).abs()[batch.label_ok].mean())


def test_the_confidence_head_learns_the_acceptance(target, drafter):
    """Started confidently wrong (σ(c) ≈ 0.02), 40 steps of the objective bring the head to the drafts' acceptance;
    a head outside the loss's parameters, or a label it does not see, leaves the error where it was."""
    batch = _batch(drafter.block_size)
    with torch.no_grad():
        drafter.confidence_head.proj.bias.fill_(-4.0)
    before = _calibration_error(target, drafter, batch)
    optimizer = torch.optim.Adam(drafter.confidence_head.parameters(), lr=0.05)
    for _ in range(40):
        optimizer.zero_grad(set_to_none=True)
        sft_batch_loss(target, drafter, batch, gamma=GAMMA, chunk_size=64, section=PUBLISHED).backward()
        optimizer.step()
    after = _calibration_error(target, drafter, batch)
    assert before > 0.3 and after < before / 3, (before, after)


def test_realized_acceptance_labels_the_verified_slots():
    """1 at the accepted slots, 0 at the first rejected one, nothing after it or past a response's end."""
    accepted = torch.tensor([0, 2, 4, 1])
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[3, 1:] = False
    labels, verified = realized_acceptance(accepted, mask)
    assert verified.int().tolist() == [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert labels[verified].tolist() == [0, 1, 1, 0, 1, 1, 1, 1, 1]


def test_the_draft_opd_term_is_the_mean_bce_and_trains_the_head(target, drafter):
    rows = torch.randn(4, drafter.block_size - 1, drafter.config.hidden_size + drafter.config.markov_rank,
                       dtype=torch.float64, requires_grad=True)
    accepted, mask = torch.tensor([0, 2, 4, 1]), torch.ones(4, 4, dtype=torch.bool)
    loss = opd_confidence_loss(drafter, rows, accepted, mask, step_verified=20)
    labels, verified = realized_acceptance(accepted, mask)
    c = torch.sigmoid(drafter.confidence_head.proj(rows[verified])[:, 0])
    want = -(labels[verified] * c.log() + (1 - labels[verified]) * (1 - c).log()).sum() / 20
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    loss.backward()
    assert drafter.confidence_head.proj.weight.grad.abs().sum() > 0 and rows.grad[~verified].abs().sum() == 0


@pytest.mark.parametrize(("experiment", "change", "message"), [
    ("configs/tiny.yaml", "models.drafter.sft_objective=dspark",
     r"models.drafter.sft_objective: unknown key \(an option of kind dspark; expected kind: dspark"),
    ("configs/tiny-dflash2.yaml", "models.drafter.confidence_weight=1",
     r"models.drafter.confidence_weight: unknown key \(an option of kind dspark; expected kind: dspark"),
])
def test_a_family_without_a_confidence_head_is_refused_in_one_line(experiment, change, message):
    """The confidence head's options are DSpark's section's own, so another family's section refuses them."""
    with pytest.raises(SpecError, match=message):
        load_spec(experiment, [change])
