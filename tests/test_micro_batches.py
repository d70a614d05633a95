"""Token-budget micro-batches (opd/distill/micro_batches.py): the same loss and gradient as fixed micro-batches on
ragged lengths, in float64; no micro-batch over the budget; a sequence over it alone is cut at block boundaries,
exactly, in the learner and in the scorer; SFT likewise; a budget that cannot hold one block or one context is
refused in one line by the spec, before any compute."""

from __future__ import annotations

import pytest
import torch

from opd.cli import main
from opd.distill.micro_batches import learner_plan, learner_size, merge, padded_tokens, record_parts, replay_groups
from opd.distill.replay import pack, score
from opd.models.build import build_models
from opd.spec import SftSpec, SpecError, load_spec
from opd.tiny.micro import micro_drafter, micro_target
from opd.train.learner import Learner
from opd.train.sft import sft_backward, sft_micro_batches
from tests.helpers.records import EXAMPLES, synthetic_record

K = 4  # the micro assets' drafter
# Short prompts and responses, so the smallest budget the spec allows (the longest context plus one block) is
# below some sequences' learner rows and the cut at block boundaries is exercised.
SHORT = ["data.max_prompt_tokens=4", "rollout.max_new_tokens=30", "optim.grad_clip=0", "models.dtype=float64"]


def _records() -> list:
    """Ragged: responses of 6 to 30 tokens with uneven acceptance."""
    return [synthetic_record(i, [5, 6, 7][: 1 + i % 3], length, vocab=90, k=K)
            for i, length in enumerate([30, 6, 17, 9, 24, 12])]


def _step(spec_file, records, overrides) -> tuple[float, list[torch.Tensor], Learner, list]:
    """One learner step on `records` scored one sequence per scorer micro-batch: loss, gradients, the learner."""
    spec = load_spec(spec_file, [*SHORT, *overrides])
    models = build_models(spec)
    learner = Learner(spec, models.drafter)
    scored = [score(models.target, [r], block_size=K) for r in records]
    loss = learner.train_step(scored).loss
    return loss, [p.grad.clone() for p in learner.drafter.parameters()], learner, scored


@pytest.mark.parametrize("budget", [38, 90, 400])
def test_token_budget_gives_the_fixed_micro_batches_loss_and_gradient(micro_spec_file, budget):
    records = _records()
    fixed_loss, fixed, _, _ = _step(micro_spec_file, records, ["optim.micro_batch_size=1"])
    loss, grads, learner, scored = _step(micro_spec_file, records, [f"optim.micro_batch_tokens={budget}"])
    assert loss == pytest.approx(fixed_loss, rel=1e-12)
    for got, want in zip(grads, fixed):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    plan = learner._plan(scored)
    sizes = [padded_tokens([learner_size(row, K) for row in group]) for group in plan]
    assert max(sizes) <= budget  # none over the budget, cut sequences included
    parts = sum(len(group) for group in plan)
    if budget == 38:  # the longest context (34) plus one block: every long sequence is cut, one block a part
        assert parts > len(records)
    if budget == 400:  # several whole sequences share a micro-batch
        assert len(plan) < len(records) and parts == len(records)


def test_a_merged_micro_batch_is_its_rows_padded(micro_spec_file):
    spec = load_spec(micro_spec_file, [*SHORT, "optim.micro_batch_tokens=400"])
    models = build_models(spec)
    records = _records()[:3]
    together = score(models.target, records, block_size=K)
    rows = [row for group in learner_plan([together], 10_000, K) for row in group]
    merged = merge(sorted(rows, key=lambda r: -r.context_valid.shape[1]))
    assert merged.num_blocks == together.num_blocks and merged.features.shape == together.features.shape
    assert int(merged.context_valid.sum()) == int(together.context_valid.sum())


def test_the_scorer_cuts_a_sequence_over_its_budget_at_block_boundaries_exactly():
    target = micro_target(seed=0, vocab_size=91, layer_ids=[0, 2])
    record = synthetic_record(3, [5, 6], 30, vocab=90, k=K)
    budget = len(record.prompt_ids) + len(record.response_ids) + K - 2  # the spec's least: the text, one block
    whole = score(target, [record], block_size=K)
    parts = record_parts(record, budget, K, "draft_opd")
    assert len(parts) > 1 and [a for p in parts for a in p.anchors] == record.anchors
    assert all(len(pack(p, K, "draft_opd").ids) <= budget for p in parts)
    cut = [score(target, [p], block_size=K) for p in parts]
    torch.testing.assert_close(torch.cat([c.teacher for c in cut]), whole.teacher, rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.cat([c.accepted for c in cut]), whole.accepted)
    assert torch.equal(torch.cat([c.position_mask for c in cut]), whole.position_mask)
    groups = replay_groups([record, synthetic_record(4, [7], 6, vocab=90, k=K)], budget, K, "draft_opd")
    assert all(padded_tokens([(len(pack(r, K, "draft_opd").ids),) for r in g]) <= budget for g in groups)


def test_sft_token_budget_gives_the_fixed_gradient_and_stays_within_it():
    target = micro_target(seed=0, vocab_size=64, layer_ids=[0, 2])
    drafter = micro_drafter(target, seed=1, num_layers=2, block_size=4)
    results = {}
    for tokens in (None, 60):
        sft = SftSpec(anchors_per_seq=5, gamma=3.0, max_length=10, batch_size=3, micro_batch_size=1,
                      micro_batch_tokens=tokens)
        step = sft_backward(target, drafter, EXAMPLES, sft, chunk_size=4, generator=torch.Generator().manual_seed(5))
        results[tokens] = step.loss, [p.grad.clone() for p in drafter.parameters()]
        drafter.zero_grad(set_to_none=True)
    assert results[60][0] == pytest.approx(results[None][0], rel=1e-12)
    for got, want in zip(results[60][1], results[None][1]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    batches = sft_micro_batches(EXAMPLES, anchors_per_seq=5, max_length=10, block_size=4, micro_batch_size=1,
                                generator=torch.Generator().manual_seed(5), micro_batch_tokens=60)
    assert len(batches) < len(EXAMPLES)  # two short sequences share one
    assert all(b.ids.numel() + b.block_valid.numel() * 4 <= 60 for b in batches)


@pytest.mark.parametrize("setting, expected", [
    ("optim.micro_batch_tokens=3", "optim.micro_batch_tokens: 3 tokens is smaller than one block of 4 (expected at "
                                   "least 216)"),
    ("optim.micro_batch_tokens=100", "optim.micro_batch_tokens: 100 tokens is below the longest context, "
                                     "data.max_prompt_tokens + rollout.max_new_tokens = 212, plus one block "
                                     "(expected at least 216)"),
    ("replay.micro_batch_tokens=2", "replay.micro_batch_tokens: 2 tokens is smaller than one block of 4"),
    ("sft.micro_batch_tokens=100", "sft.micro_batch_tokens: 100 tokens is below one sequence of sft.max_length 3072"),
])
def test_a_budget_that_cannot_hold_one_block_or_context_is_one_line(micro_spec_file, capsys, setting, expected):
    assert main(["validate", str(micro_spec_file), "--set", setting]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


@pytest.mark.parametrize("settings, expected", [
    (["optim.micro_batch_tokens=400", "resources.learner.replicas=3"],
     "optim.batch_size: 4 sequences per update do not split over resources.learner.replicas 3"),
    (["optim.micro_batch_tokens=400", "resources.learner.replicas=2", "optim.backend=deepspeed"],
     "optim.micro_batch_tokens: with backend deepspeed and 2 learner replicas"),
])
def test_accumulation_incompatible_with_the_learner_replicas_is_one_line(micro_spec_file, settings, expected):
    with pytest.raises(SpecError) as err:
        load_spec(micro_spec_file, [*settings, "resources.cluster.num_cpus=8"], check_paths=False)
    assert err.value.messages == [m for m in err.value.messages if expected in m] and len(err.value.messages) == 1
