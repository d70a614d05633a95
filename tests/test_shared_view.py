"""The scorer of a rebuilt source runs the target over each micro-batch's text once (`CommittedView`): the rebuild's
features and the teacher's states come from that forward, which is charged once; the packed layout's teacher adds
a forward of the drafted blocks alone over the view's keys and values. Compared with the unshared path (the
rebuild's own forward, then the scorer's micro-batches) on the micro models."""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace

import pytest
import torch

from opd.distill.replay import CommittedView, pack, replay_mode, score
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


def counted(monkeypatch, scorer: Scorer) -> list[tuple[str, int]]:
    """Each target forward's kind (`text`: the view, with keys and values kept; `rows`: any other) and batch size,
    appended as it runs."""
    calls = []
    for name, kind in (("hidden_states", "rows"), ("text_states", "text")):
        original = getattr(scorer.target, name)

        def run(ids, original=original, kind=kind, **kwargs):
            calls.append((kind, ids.shape[0]))
            return original(ids, **kwargs)

        monkeypatch.setattr(scorer.target, name, run)
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
    assert calls == [("rows", 2), ("rows", 2)]  # one forward per micro-batch, nothing else
    assert any(r.anchors for r in shared.batch.records)

    unshared = unshared_item(scorer, batch, monkeypatch, calls)
    assert_same(shared, unshared)

    text = sum(scorer.params.forward(len(r.prompt_ids) + len(r.response_ids)) for r in batch.records)
    assert shared.batch.flops.target_forward == unshared.batch.flops.target_forward  # the rebuild charges it
    assert shared.scorer_flops == unshared.scorer_flops - text  # the teacher does not, again
    assert shared.scorer_flops == scorer.params.forward(0, logits=sum(int(mb.position_mask.sum())
                                                                      for mb in shared.micro_batches))


def unshared_item(scorer: Scorer, batch, monkeypatch, calls: list) -> ScoredItem:
    """The same batch scored the unshared way: the rebuild's own forward over the rollout batch (4 sequences),
    then the teacher's per micro-batch (2 + 2)."""
    with monkeypatch.context() as m:
        m.setattr(Scorer, "shares_forward", property(lambda self: False))
        calls.clear()
        item = scorer(batch)
        assert calls == [("rows", 4), ("rows", 2), ("rows", 2)]
    return item


@pytest.mark.parametrize("sets", [[], ["replay.teacher_topk=5"], ["rollout.temperature=0"]])
def test_the_packed_teacher_runs_its_blocks_over_the_views_keys_and_values(micro_spec_file, tmp_path,
                                                                          monkeypatch, sets):
    """draft_opd: the blocks alone over the view's cached text equal the whole packed row (to float32 rounding:
    the text's keys come from a forward of another shape), and the text is charged once."""
    scorer, batch = scorer_and_batch(micro_spec_file, tmp_path, "rollout.source=target", *sets)
    assert scorer.shares_forward and replay_mode(scorer.spec) == "draft_opd"
    calls = counted(monkeypatch, scorer)
    shared = scorer(batch)
    assert calls == [("text", 2), ("text", 2), ("rows", 2), ("rows", 2)]  # views, then each micro-batch's blocks
    assert sum(len(a) for r in shared.batch.records for a in r.drafts) > 0

    unshared = unshared_item(scorer, batch, monkeypatch, calls)
    assert shared.batch.records == unshared.batch.records
    assert shared.acceptance.keys() == unshared.acceptance.keys()
    for name in shared.acceptance:
        torch.testing.assert_close(shared.acceptance[name], unshared.acceptance[name], rtol=1e-4, atol=1e-5)
    for x, y in zip(shared.micro_batches, unshared.micro_batches, strict=True):
        valid = x.context_valid  # past a row's prefix the packed row holds its blocks, the view the text
        torch.testing.assert_close(x.features[valid], y.features[valid], rtol=1e-4, atol=1e-5)
        assert_close_tensors(replace(x, features=None), replace(y, features=None))

    k, mode = scorer.spec.models.drafter.block_size, "draft_opd"
    blocks = sum(len(p.ids) - p.prefix_len for p in (pack(r, k, mode) for r in shared.batch.records))
    assert blocks > 0
    assert shared.batch.flops.target_forward == unshared.batch.flops.target_forward
    assert shared.scorer_flops == scorer.params.forward(blocks, logits=sum(int(mb.position_mask.sum())
                                                                           for mb in shared.micro_batches))


def assert_close_tensors(x, y) -> None:
    """Every tensor field of two dataclasses: integer and bool fields equal, float ones to fp32 rounding."""
    for field in fields(x):
        u, v = getattr(x, field.name), getattr(y, field.name)
        if is_dataclass(u):
            assert_close_tensors(u, v)
        elif u is None or not u.is_floating_point():
            assert (u is None and v is None) or torch.equal(u, v), field.name
        else:
            torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-5, msg=field.name)


def test_speculative_rollouts_run_the_target_as_before(micro_spec_file, tmp_path, monkeypatch):
    """Blocks drafted at rollout time (no rebuild): one teacher forward per micro-batch, nothing shared."""
    scorer, batch = scorer_and_batch(micro_spec_file, tmp_path, "loss.first_rejected_only=true")
    assert not scorer.shares_forward
    calls = counted(monkeypatch, scorer)
    scorer(batch)
    assert calls == [("rows", 2), ("rows", 2)]


def test_a_view_scores_only_its_own_texts_and_the_packed_layout_only_with_its_keys(micro_spec_file, tmp_path):
    scorer, batch = scorer_and_batch(micro_spec_file, tmp_path, "loss.first_rejected_only=true")
    records, k = batch.records[:2], scorer.spec.models.drafter.block_size
    view = CommittedView.of(scorer.target, records, k)
    assert [f.shape[0] for f in view.rows()] == [len(r.prompt_ids) + len(r.response_ids) for r in records]
    with pytest.raises(ValueError, match="needs its keys and values"):
        score(scorer.target, records, block_size=k, mode="draft_opd", view=view)
    with pytest.raises(ValueError, match="text lengths"):
        score(scorer.target, records[:1], block_size=k, mode="committed", view=view)
    with pytest.raises(ValueError, match="text lengths"):
        score(scorer.target, records[:1], block_size=k, mode="draft_opd",
              view=CommittedView.of(scorer.target, records, k, keep_kv=True))


def test_greedy_target_rollouts_train_like_speculative_ones_through_the_shared_forward(micro_spec_file, tmp_path):
    """End to end: the rebuilt blocks and the teacher read from one forward still give the speculative path's
    steps (tests/test_rollout_sources.py checks the packed layout the same way)."""
    greedy = ["rollout.temperature=0", "optim.lr=0.03", "steps=4", "eval.every=0", "loss.first_rejected_only=true"]
    runs = [LocalTrainer(load_spec(micro_spec_file, [*greedy, f"tracking.run_dir={tmp_path / name}", *sets]),
                         track=False).run().losses
            for name, sets in (("speculative", []), ("target", ["rollout.source=target"]))]
    assert runs[1] == pytest.approx(runs[0], rel=1e-6)
