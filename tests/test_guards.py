"""Numerics and broadcast integrity: a bad step is skipped and counted, corrupted weights are refused."""

from __future__ import annotations

import pytest
import torch

from opd.errors import OpdError
from opd.spec import load_spec
from opd.train.local import LocalTrainer
from opd.train.messages import WeightSnapshot


def test_non_finite_steps_are_skipped_then_stop_the_run(micro_spec_file):
    trainer = LocalTrainer(load_spec(micro_spec_file, ["optim.max_nonfinite_steps=3"]), track=False)
    scored = trainer.scorer(trainer.rollout.run(0)).micro_batches
    for mb in scored:
        mb.teacher[..., 0] = float("nan")  # a poisoned teacher distribution
    before = {k: v.clone() for k, v in trainer.learner.drafter.state_dict().items()}
    for _ in range(2):
        assert trainer.learner.train_step(scored).skipped
    assert all(torch.equal(v, before[k]) for k, v in trainer.learner.drafter.state_dict().items())
    with pytest.raises(OpdError, match="3 non-finite steps in a row"):
        trainer.learner.train_step(scored)


def test_a_corrupted_or_mislabelled_snapshot_is_refused():
    snapshot = WeightSnapshot.of({"w": torch.ones(3, 2), "b": torch.zeros(2)}, version=4)
    assert snapshot.verified(4) is snapshot
    with pytest.raises(OpdError, match="expected 5"):
        snapshot.verified(5)
    snapshot.state["w"][0, 0] = 2.0  # one flipped value
    with pytest.raises(OpdError, match="checksum mismatch"):
        snapshot.verified(4)


def test_tau_collapse_is_logged_and_stops_the_run_when_asked(micro_spec_file, monkeypatch):
    from opd.eval.row import EvalRow
    from opd.train.evaluator import EvalResult

    taus = iter([3.0, 2.9, 1.0])  # steps 0, 2, 4: the last one falls below 0.8 x the best (3.0)

    def fake_evaluate(self, snapshot):
        return EvalResult(snapshot.version, [EvalRow("greedy", 4, next(taus), 0.0, [], [], 1.0, None, None, None)])

    monkeypatch.setattr("opd.train.evaluator.Evaluator.__call__", fake_evaluate)
    spec = load_spec(micro_spec_file, ["eval.collapse_ratio=0.8", "eval.stop_on_collapse=true"])
    trainer = LocalTrainer(spec, track=False)
    with pytest.raises(OpdError, match=r"τ collapsed at step 4: 1.000 < 0.8 x best 3.000"):
        trainer.run()
    assert not trainer.session._collapsed(2.9, 3.0) and trainer.session._collapsed(2.3, 3.0)
