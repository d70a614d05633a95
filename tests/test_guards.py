"""Numerics and broadcast integrity: a bad step is skipped and counted, corrupted weights are refused."""

from __future__ import annotations

import pytest
import torch

from opd.errors import OpdError
from opd.spec import load_spec
from opd.train.local import LocalTrainer
from opd.weights import WeightSnapshot


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
