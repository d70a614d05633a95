"""Packed replay equals the naive per-anchor loop it replaces (float64, max abs diff < 1e-9)."""

from __future__ import annotations

import pytest
import torch

from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.distill.anchors import redraft_at_random_anchors
from opd.distill.losses import TopKTeacher, teacher_distribution
from opd.distill.replay import score, student_hidden
from opd.distill.scored_batch import ScoredBatch
from opd.tiny.micro import micro_drafter, micro_target

EOS, MASK, K = 6, 7, 4
PROMPTS = [[1, 2, 3], [4, 5], [1, 1, 1, 1, 2], [3, 0, 2, 2]]


@pytest.fixture(scope="module")
def models():
    target = micro_target(seed=0, vocab_size=8, layer_ids=[0, 2, 3])
    return target, micro_drafter(target, seed=1, num_layers=2, block_size=K, mask_token_id=MASK)


@pytest.fixture(scope="module")
def records(models):
    target, drafter = models
    decoder = SpeculativeDecoder(target, drafter, eos_id=EOS)
    return decoder.generate(PROMPTS, Sampling(temperature=1.0), max_new_tokens=16, seed=4)


def naive_teacher(target, rec, mode):
    """One plain causal target forward per anchor: p at every drafted (or, naive, committed) slot."""
    out = []
    committed = rec.prompt_ids + rec.response_ids
    for anchor, draft, r in zip(rec.anchors, rec.drafts, rec.accepted):
        a = len(rec.prompt_ids) + anchor
        block = draft[: K - 2] if mode == "draft_opd" else committed[a + 1 : a + K - 1]
        ids = committed[: a + 1] + block
        slots = min(K - 1, len(committed) - 1 - a)  # naive: the committed tokens that exist
        if mode == "draft_opd":  # every drafted slot, but none past the response end in a block not rejected before it
            slots = r if anchor + r + 1 == len(rec.response_ids) else K - 1
        out.append(target(torch.tensor([ids])).logits[0, a : a + slots])
    return out


def naive_student(target, drafter, rec):
    """One cached single-block `draft` per anchor, its context rebuilt from scratch each time."""
    out = []
    committed = rec.prompt_ids + rec.response_ids
    for anchor in rec.anchors:
        a = len(rec.prompt_ids) + anchor
        features = target(torch.tensor([committed[:a]])).features
        cache = drafter.new_cache(1)
        drafter.extend_cache(cache, features, torch.arange(a)[None], torch.ones(1, a, dtype=torch.bool))
        _, logits = drafter.draft(cache, torch.tensor([committed[a]]), torch.tensor([a]))
        out.append(logits[0])
    return out


def check_against_naive(target, drafter, records, mode):
    batch = score(target, records, block_size=K, mode=mode)
    accepted, mask = batch.accepted, batch.position_mask
    teacher = teacher_distribution(target.lm_head(batch.teacher))  # the learner's exact teacher from hidden states
    student = drafter.logits(student_hidden(drafter, batch))
    i = 0
    for rec in records:
        for t_ref, s_ref in zip(naive_teacher(target, rec, mode), naive_student(target, drafter, rec)):
            n = len(t_ref)  # naive mode: fewer slots near the end of the response
            ref = teacher_distribution(t_ref[None])[0]
            assert (teacher[i, :n] - ref).abs().max() < 1e-9
            assert mask[i, :n].all() and not mask[i, n:].any()
            assert (student[i] - s_ref).abs().max() < 1e-9
            i += 1
    assert i == len(accepted) > len(records)


@pytest.mark.parametrize("mode", ["draft_opd", "naive"])
def test_packed_replay_equals_per_anchor_loop(models, records, mode):
    check_against_naive(*models, records, mode)


def test_random_anchor_replay_equals_per_anchor_loop(models, records):
    target, drafter = models
    g = torch.Generator().manual_seed(0)
    redrafted = [redraft_at_random_anchors(target, drafter, r, 5, g) for r in records]
    assert any(r.anchors != o.anchors for r, o in zip(redrafted, records))
    check_against_naive(target, drafter, [r for r in redrafted if r.anchors], "draft_opd")


def test_random_anchor_acceptance_matches_verification(models):
    """Greedy rollout: redrafting at the verification anchors reproduces the recorded drafts and acceptance."""
    target, drafter = models
    rec = SpeculativeDecoder(target, drafter, eos_id=EOS).generate(PROMPTS[:1], Sampling(), max_new_tokens=12)[0]
    g = torch.Generator().manual_seed(0)
    every = redraft_at_random_anchors(target, drafter, rec, len(rec.response_ids), g)
    by_anchor = dict(zip(every.anchors, zip(every.drafts, every.accepted)))
    for anchor, draft, r in zip(rec.anchors, rec.drafts, rec.accepted):
        if anchor + 1 < len(rec.response_ids) and anchor + K <= len(rec.response_ids):
            assert by_anchor[anchor] == (draft, r)


def test_final_blocks_that_reach_the_response_end_are_in_the_cases(records):
    """The rule above is exercised: some final block's accepted drafts run to the response end."""
    assert any(rec.anchors and rec.anchors[-1] + rec.accepted[-1] + 1 == len(rec.response_ids) for rec in records)


def test_naive_mode_marks_all_committed_slots_accepted(models, records):
    batch = score(models[0], records, block_size=K, mode="naive")
    assert torch.equal(batch.position_mask.sum(-1), batch.accepted)


def test_committed_teacher_equals_the_packed_one_where_the_loss_reads(models, records):
    """First-rejection losses read slots k <= r only; there the target's view of the committed text equals the
    packed replay's (float64), and so do the loss and its gradient. The committed layout is prompt + response
    tokens long, the packed one longer."""
    from opd.distill.losses import acceptance_aware_loss
    from opd.distill.replay import pack
    from opd.spec import LossSpec

    target, drafter = models
    packed, committed = (score(target, records, block_size=K, mode=m) for m in ("draft_opd", "committed"))
    assert torch.equal(packed.accepted, committed.accepted)
    assert torch.equal(packed.position_mask, committed.position_mask)
    k = torch.arange(K - 1)
    read = (k[None] <= packed.accepted[:, None]) & packed.position_mask  # accepted prefix + first rejection
    assert read.sum() > len(packed.accepted)
    assert (packed.teacher[read] - committed.teacher[read]).abs().max() < 1e-9
    assert (packed.teacher[~read] - committed.teacher[~read]).abs().max() > 1e-3  # unread slots do differ
    cfg = LossSpec(kl_mode="all_forward", first_rejected_only=True)
    losses, grads = [], []
    for batch in (packed, committed):
        out = acceptance_aware_loss(student_hidden(drafter, batch), batch.teacher, batch.accepted, cfg,
                                    batch.position_mask, head=drafter.lm_head)
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None})
        drafter.zero_grad(set_to_none=True)
    assert (losses[0] - losses[1]).abs() < 1e-9
    assert all((grads[0][n] - grads[1][n]).abs().max() < 1e-9 for n in grads[0])
    for rec in records:
        assert len(pack(rec, K, "committed").ids) == len(rec.prompt_ids) + len(rec.response_ids)
        assert len(pack(rec, K, "draft_opd").ids) > len(pack(rec, K, "committed").ids) or not rec.anchors


def test_a_scored_batch_moves_a_top_k_teacher_whose_tail_is_derived():
    """A top-k teacher without its tail (None: derived where used, as `TopKTeacher` allows) moves with its batch
    (`ScoredBatch.to` read the missing tail's device and raised)."""
    logprobs = torch.log_softmax(torch.randn(2, 3, 5), -1)[..., :4]
    teacher = TopKTeacher(torch.arange(4).expand(2, 3, 4), logprobs)
    long, flag = {"dtype": torch.long}, {"dtype": torch.bool}
    batch = ScoredBatch(features=torch.zeros(1, 4, 8), context_valid=torch.ones(1, 4, **flag),
                        context_ids=torch.zeros(1, 4, **long), block_ids=torch.zeros(1, 2, 4, **long),
                        anchor_positions=torch.zeros(1, 2, **long), block_valid=torch.ones(1, 2, **flag),
                        accepted=torch.zeros(2, **long), position_mask=torch.ones(2, 3, **flag), teacher=teacher)
    moved = batch.to("cpu").teacher
    assert isinstance(moved, TopKTeacher) and moved.tail_logprob is None
    assert torch.equal(moved.tail(), teacher.tail())
