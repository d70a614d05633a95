"""bf16 training: the drafter computes and publishes bf16, while AdamW steps fp32 master weights with fp32 states,
so every parameter tensor moves as it does in fp32 (plain AdamW on bf16 rounds RMSNorm updates away), and a
resumed run continues exactly as an uninterrupted one."""

from __future__ import annotations

import pytest
import torch

from opd.errors import OpdError
from opd.models.build import build_models
from opd.spec import load_spec
from opd.train.learner import Learner
from opd.train.local import LocalTrainer
from opd.train.master_weights import MasterWeights

STEPS = 8  # at lr 1e-3: 0.008 of movement at most, two bf16 ulps at 1.0; each step alone is under half an ulp


@pytest.fixture
def scored(micro_spec_file) -> list:
    """The micro-batches of one step of real rollouts, scored by the fp32 micro target."""
    trainer = LocalTrainer(load_spec(micro_spec_file), track=False)
    return [mb for i in range(2) for mb in trainer.scorer(trainer.rollout.run(i)).micro_batches]


def _learner(micro_spec_file, dtype: str, weights: dict | None = None) -> Learner:
    """A learner on the micro drafter in `dtype`, starting from `weights` (loaded before the masters are made)."""
    spec = load_spec(micro_spec_file, [f"models.dtype={dtype}", f"steps={STEPS}"])
    drafter = build_models(spec).drafter
    if weights is not None:
        drafter.load_state_dict({k: v.to(drafter.fc.weight.dtype) for k, v in weights.items()})
    return Learner(spec, drafter)


def _train(learner: Learner, steps: list, n: int = STEPS) -> list[float]:
    return [learner.train_step(steps).loss for _ in range(n)]


def _unmoved(before: dict, learner: Learner) -> list[str]:
    """The drafter tensors whose published (model) weights did not change at all."""
    return [k for k, v in learner.drafter.state_dict().items() if torch.equal(v, before[k])]


def test_a_bf16_learner_moves_every_tensor_as_fp32_does(micro_spec_file, scored):
    bf16 = _learner(micro_spec_file, "bfloat16")
    start = {k: v.clone() for k, v in bf16.drafter.state_dict().items()}
    fp32 = _learner(micro_spec_file, "float32", start)  # the same start, so only the arithmetic differs
    losses16, losses32 = _train(bf16, scored), _train(fp32, scored)
    assert _unmoved(start, bf16) == []  # RMSNorm weights included
    assert losses16[-1] < 0.7 * losses16[0] and losses16 == pytest.approx(losses32, rel=0.02)
    assert isinstance(bf16.optimizer, MasterWeights) and type(fp32.optimizer) is torch.optim.AdamW
    names = [name for name, _ in bf16.drafter.named_parameters()]
    for name, master, param, reference in zip(names, bf16.optimizer.masters, bf16.drafter.parameters(),
                                              fp32.drafter.parameters()):
        assert master.dtype == torch.float32 and torch.equal(param, master.to(torch.bfloat16)), name
        moved = reference.detach() - start[name].float()
        assert (master - start[name].float() - moved).norm() < 0.1 * moved.norm(), name
    moments = [t for s in bf16.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert len(moments) == 2 * len(names) and all(t.dtype == torch.float32 for t in moments)


def test_plain_adamw_on_bf16_weights_leaves_the_rmsnorm_weights_unmoved(micro_spec_file, scored, monkeypatch):
    """The defect the test above catches: the optimizer before master weights, on the same steps."""
    monkeypatch.setattr("opd.train.learner.adamw", lambda params, masters, **options: torch.optim.AdamW(params,
                                                                                                        **options))
    plain = _learner(micro_spec_file, "bfloat16")
    start = {k: v.clone() for k, v in plain.drafter.state_dict().items()}
    _train(plain, scored)
    norms = [k for k in start if k.endswith("norm.weight")]
    assert len(norms) == 6 and set(norms) <= set(_unmoved(start, plain))


def test_a_bf16_learner_resumes_exactly(micro_spec_file, scored, tmp_path):
    straight = _learner(micro_spec_file, "bfloat16")
    start = {k: v.clone() for k, v in straight.drafter.state_dict().items()}
    losses = _train(straight, scored)
    first = _learner(micro_spec_file, "bfloat16", start)
    _train(first, scored, 3)
    torch.save({"learner": first.state_dict(), "drafter": first.drafter.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert all(v.dtype == torch.bfloat16 for v in saved["drafter"].values())  # the masters are in the learner's
    resumed = _learner(micro_spec_file, "bfloat16", saved["drafter"])
    resumed.load_state_dict(saved["learner"])
    assert _train(resumed, scored, STEPS - 3) == losses[3:]
    for a, b in zip(resumed.optimizer.masters, straight.optimizer.masters):
        assert torch.equal(a, b)
    for k, v in straight.drafter.state_dict().items():
        assert torch.equal(resumed.drafter.state_dict()[k], v), k


def test_a_bf16_run_resumes_from_its_checkpoint_to_the_uninterrupted_drafter(micro_spec_file, tmp_path):
    spec = load_spec(micro_spec_file, ["models.dtype=bfloat16", "eval.every=0"])
    straight = LocalTrainer(spec, track=False)
    result = straight.run()
    crashed = load_spec(micro_spec_file, ["models.dtype=bfloat16", "eval.every=0",
                                          f"tracking.run_dir={tmp_path / 'crash'}"])
    LocalTrainer(crashed, track=False).run(stop_after=3)  # the last checkpoint is step 2's
    resumed = LocalTrainer(crashed, track=False)
    assert resumed.run().losses == result.losses[2:]
    for k, v in straight.learner.drafter.state_dict().items():
        assert torch.equal(resumed.learner.drafter.state_dict()[k], v), k


def test_master_weights_refuse_a_state_without_masters(micro_spec_file):
    learner = _learner(micro_spec_file, "bfloat16")
    plain = torch.optim.AdamW(learner.drafter.parameters()).state_dict()
    with pytest.raises(OpdError, match="no fp32 master weights"):
        learner.optimizer.load_state_dict(plain)
