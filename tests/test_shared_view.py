"""The committed-layout scorer of a rebuilt source runs the target once per micro-batch (`CommittedView`): the
rebuild's features and the teacher's states come from one forward, which is charged once. Compared with the
unshared path (rebuild's own forward, then `score_micro_batches`) on the micro models."""

from __future__ import annotations

from dataclasses import fields, is_dataclass

import pytest
import torch

from opd.replay import CommittedView, replay_mode, score
from opd.spec import load_spec
from opd.train.local import LocalTrainer
from opd.train.messages import ScoredItem
from opd.train.scorer import Scorer


def scorer_and_batch(micro_spec_file, tmp_path, *sets: str):
    """A started local trainer's scorer and one rollout batch of 4 sequences (2 micro-batches of 2)."""
    spec = load_spec(micro_spec_file, ["eval.every=0", f"tracking.run_dir={tmp_path / 'run'}", "rollout.batch_size=4",
                                       "optim.batch_size=4", "optim.micro_batch_size=2", *sets])
    trainer = LocalTrainer(spec, track=False)
    trainer.start(evaluate=False)
    return trainer.scorer, trainer.rollout.run(0)


def counted(monkeypatch, scorer: Scorer) -> list[int]:
    """Each `target.hidden_states` call's batch size, appended as it runs."""
    calls, original = [], scorer.target.hidden_states

    def hidden_states(ids, **kwargs):
        calls.append(ids.shape[0])
        return original(ids, **kwargs)

    monkeypatch.setattr(scorer.target, "hidden_states", hidden_states)
    return calls


def assert_same(a: ScoredItem, b: ScoredItem) -> None:
    assert a.batch.records == b.batch.records and a.batch.draft_version == b.batch.draft_version
    assert a.acceptance.keys() == b.acceptance.keys()
    assert len(a.micro_batches) == len(b.micro_batches)
    for x, y in zip(a.micro_batches, b.micro_batches):
        assert_equal_tensors(x, y)


def assert_equal_tensors(x, y) -> None:
    """Every tensor field of two dataclasses (a top-k teacher's too) bit for bit."""
    for field in fields(x):
        u, v = getattr(x, field.name), getattr(y, field.name)
        if is_dataclass(u):
            assert_equal_tensors(u, v)
        else:
            assert (u is None and v is None) or torch.equal(u, v), field.name


@pytest.mark.parametrize("sets", [[], ["replay.teacher_topk=5"], ["rollout.temperature=0"]])
def test_the_shared_forward_scores_exactly_as_two_forwards_and_is_charged_once(micro_spec_file, tmp_path,
                                                                               monkeypatch, sets):
    scorer, batch = scorer_and_batch(micro_spec_file, tmp_path, "rollout.source=target",
                                     "loss.first_rejected_only=true", *sets)
    assert scorer.shares_forward and replay_mode(scorer.spec) == "committed"
    calls = counted(monkeypatch, scorer)
    shared = scorer(batch)
    assert calls == [2, 2]  # one forward per micro-batch, nothing else
    assert any(r.anchors for r in shared.batch.records)

    with monkeypatch.context() as m:
        m.setattr(Scorer, "shares_forward", property(lambda self: False))
        calls.clear()
        unshared = scorer(batch)
        assert calls == [4, 2, 2]  # the rebuild's forward over the rollout batch, then the teacher's per micro-batch
    assert_same(shared, unshared)

    text = sum(scorer.params.forward(len(r.prompt_ids) + len(r.response_ids)) for r in batch.records)
    assert shared.batch.flops.target_forward == unshared.batch.flops.target_forward  # the rebuild charges it
    assert shared.scorer_flops == unshared.scorer_flops - text  # the teacher does not, again
    assert shared.scorer_flops == scorer.params.forward(0, logits=sum(int(mb.position_mask.sum())
                                                                      for mb in shared.micro_batches))


@pytest.mark.parametrize("sets", [["rollout.source=target"], ["loss.first_rejected_only=true"]])
def test_other_layouts_and_sources_run_the_target_as_before(micro_spec_file, tmp_path, monkeypatch, sets):
    """Packed draft_opd replay of rebuilt blocks, and speculative rollouts in the committed layout: no sharing."""
    scorer, batch = scorer_and_batch(micro_spec_file, tmp_path, *sets)
    assert not scorer.shares_forward
    calls = counted(monkeypatch, scorer)
    scorer(batch)
    assert calls == ([4] if scorer.spec.rollout.rebuilt else []) + [2, 2]


def test_a_view_scores_only_the_committed_layout_of_its_own_texts(micro_spec_file, tmp_path):
    scorer, batch = scorer_and_batch(micro_spec_file, tmp_path, "loss.first_rejected_only=true")
    records, k = batch.records[:2], scorer.spec.models.drafter.block_size
    view = CommittedView.of(scorer.target, records, k)
    assert [f.shape[0] for f in view.rows()] == [len(r.prompt_ids) + len(r.response_ids) for r in records]
    with pytest.raises(ValueError, match="needs mode 'committed', got 'draft_opd'"):
        score(scorer.target, records, block_size=k, mode="draft_opd", view=view)
    with pytest.raises(ValueError, match="text lengths"):
        score(scorer.target, records[:1], block_size=k, mode="committed", view=view)


def test_greedy_target_rollouts_train_like_speculative_ones_through_the_shared_forward(micro_spec_file, tmp_path):
    """End to end: the rebuilt blocks and the teacher read from one forward still give the speculative path's
    steps (tests/test_rollout_sources.py checks the packed layout the same way)."""
    greedy = ["rollout.temperature=0", "optim.lr=0.03", "steps=4", "eval.every=0", "loss.first_rejected_only=true"]
    runs = [LocalTrainer(load_spec(micro_spec_file, [*greedy, f"tracking.run_dir={tmp_path / name}", *sets]),
                         track=False).run().losses
            for name, sets in (("speculative", []), ("target", ["rollout.source=target"]))]
    assert runs[1] == pytest.approx(runs[0], rel=1e-6)
