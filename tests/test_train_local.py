"""The single-process trainer: it learns, it only touches the drafter, and it resumes exactly."""

from __future__ import annotations

import pytest
import torch

from opd.errors import OpdError
from opd.spec import load_spec
from opd.train.checkpoint import STATE_FILE, latest_checkpoint
from opd.train.local import LocalTrainer


def test_learner_lowers_the_loss_on_a_fixed_batch(micro_spec_file):
    trainer = LocalTrainer(load_spec(micro_spec_file))
    scored = [mb for i in range(2) for mb in trainer.scorer(trainer.rollout.run(i)).micro_batches]
    losses = [trainer.learner.train_step(scored).loss for _ in range(12)]
    assert losses[-1] < 0.7 * losses[0], losses


def test_a_step_changes_only_the_drafter(micro_spec_file):
    trainer = LocalTrainer(load_spec(micro_spec_file))
    target = trainer.models.target
    target_before = {k: v.clone() for k, v in target.model.state_dict().items()}
    drafter_before = {k: v.clone() for k, v in trainer.learner.drafter.state_dict().items()}
    trainer.train_step()
    for k, v in target.model.state_dict().items():
        assert torch.equal(v, target_before[k]), k  # embedding and LM head included
    changed = [k for k, v in trainer.learner.drafter.state_dict().items() if not torch.equal(v, drafter_before[k])]
    assert changed and all(p.grad is None for p in target.model.parameters())


def test_resume_reaches_the_same_state_as_an_uninterrupted_run(micro_spec_file, tmp_path):
    spec = load_spec(micro_spec_file)
    straight = LocalTrainer(spec, track=False).run()
    assert straight.steps == spec.steps and set(straight.evals) == {0, 2, 4}
    crashed = load_spec(micro_spec_file, [f"tracking.run_dir={tmp_path / 'crash'}"])
    first = LocalTrainer(crashed, track=False).run(stop_after=3)  # dies after step 3; last checkpoint is step 2
    assert first.steps == 3
    resumed = LocalTrainer(crashed, track=False)
    second = resumed.run()
    assert second.steps == spec.steps and len(second.losses) == 2  # steps 3 and 4 again, nothing skipped
    assert second.losses == straight.losses[2:]
    a = LocalTrainer(spec, track=False)
    a.session.start()
    for k, v in a.learner.drafter.state_dict().items():
        assert torch.allclose(v, resumed.learner.drafter.state_dict()[k], atol=1e-6), k


def test_train_logs_an_mlflow_run(micro_spec_file):
    import mlflow

    spec = load_spec(micro_spec_file, ["steps=2", "eval.every=0"])
    result = LocalTrainer(spec).run()
    mlflow.set_tracking_uri(spec.tracking_uri)
    run = mlflow.get_run(result.run_id)
    assert run.data.params["optim.lr"] == "0.001"
    assert {"loss", "rollout_tau", "eval_tau_greedy", "flops_total", "policy_lag"} <= set(run.data.metrics)
    # the expected-acceptance diagnostic, on the rollouts and on held-out states of each eval setting
    assert {"rollout_expected_greedy_tau", "rollout_expected_greedy_slot_1",
            "eval_expected_greedy_on_greedy_tau"} <= set(run.data.metrics)
    history = mlflow.MlflowClient().get_metric_history(result.run_id, "loss")
    assert [m.step for m in history] == [1, 2]


def test_rollout_mix_alternates_settings_by_batch(micro_spec_file):
    """rollout.mix: batch i decodes with setting i mod (1 + len(mix)); the greedy batches are exactly what a
    greedy-only rollout makes, the others are sampled (and differ)."""
    from opd.decoding.sampling import Sampling
    from opd.train.rollout import rollout_sampling

    greedy = "rollout.temperature=0"
    mixed = load_spec(micro_spec_file, [greedy, "rollout.mix=[{temperature: 0.6, top_p: 0.95, top_k: 20}]"])
    assert [rollout_sampling(mixed, i) for i in range(3)] == [Sampling(), Sampling(0.6, 20, 0.95), Sampling()]
    plain = LocalTrainer(load_spec(micro_spec_file, [greedy]), track=False).rollout
    mix = LocalTrainer(mixed, track=False).rollout
    responses = [[r.response_ids for r in w.run(i).records] for w in (plain, mix) for i in range(2)]
    assert responses[0] == responses[2] and responses[1] != responses[3]


def test_rollout_diagnostic_is_the_greedy_acceptance_it_recorded(micro_spec_file):
    """On greedy rollouts the scorer's greedy expected acceptance is exactly what verification did: a_k = 1
    up to each block's accepted count, 0 at the first rejection."""
    both = "eval.sampling=[{name: greedy}, {name: sampled, temperature: 0.6}]"
    trainer = LocalTrainer(load_spec(micro_spec_file, [both, "rollout.temperature=0"]), track=False)
    item = trainer.scorer(trainer.rollout.run(0))
    a = item.acceptance["greedy"]
    accepted = torch.tensor([r for rec in item.batch.records for r in rec.accepted])
    assert torch.equal(a.cumprod(-1).sum(-1).long(), accepted)
    assert set(item.acceptance) == {"greedy", "sampled"} and a.shape[0] == len(accepted)


def test_required_version_bounds_how_far_rollout_runs_ahead(micro_spec_file):
    from opd.train.policy_lag import required_version

    # 2 rollout batches per step (optim 4 / rollout 2)
    lag0 = load_spec(micro_spec_file, ["resources.max_policy_lag=0"])
    assert [required_version(i, lag0) for i in range(6)] == [0, 0, 1, 1, 2, 2]
    lag1 = load_spec(micro_spec_file, ["resources.max_policy_lag=1"])
    assert [required_version(i, lag1) for i in range(6)] == [0, 0, 0, 0, 1, 1]
    every2 = load_spec(micro_spec_file, ["resources.max_policy_lag=1", "resources.broadcast_every=2"])
    assert [required_version(i, every2) for i in range(8)] == [0, 0, 0, 0, 2, 2, 2, 2]
    for spec in (lag0, lag1, every2, load_spec(micro_spec_file, ["resources.max_policy_lag=3",
                                                                 "resources.broadcast_every=3"])):
        r = spec.resources
        for i in range(40):
            step, need = i // 2, required_version(i, spec)
            assert need % r.broadcast_every == 0 and need <= step  # published by the time step `step` runs
            assert step - need <= r.max_policy_lag  # so the learner never finds it stale


def test_a_run_dir_refuses_to_resume_a_different_experiment(micro_spec_file, tmp_path):
    """Resuming with another learning rate (or warm drafter, loss, data...) would silently continue a different
    experiment from this one's weights; a longer step budget or another eval setting is fine."""
    run = [f"tracking.run_dir={tmp_path / 'r'}", "eval.every=0"]
    LocalTrainer(load_spec(micro_spec_file, run), track=False).run(stop_after=2)
    changed = LocalTrainer(load_spec(micro_spec_file, [*run, "optim.lr=0.5"]), track=False)
    with pytest.raises(OpdError, match=r"trained with optim\.lr=0\.001 but the spec now says 0\.5.*tracking\.run_dir"):
        changed.run()
    longer = LocalTrainer(load_spec(micro_spec_file, [*run, "steps=5", "eval.num_prompts=2"]), track=False).run()
    assert longer.steps == 5 and len(longer.losses) == 3


def test_a_run_from_before_a_new_spec_field_resumes_when_the_field_is_at_its_default(micro_spec_file, tmp_path):
    """A checkpoint saved by older code lacks fields added since; the code it trained with behaved as their
    default, so they count as unchanged there, and only a non-default value is refused, named as newer."""
    run = [f"tracking.run_dir={tmp_path / 'r'}", "eval.every=0"]
    LocalTrainer(load_spec(micro_spec_file, run), track=False).run(stop_after=2)
    path = latest_checkpoint(tmp_path / "r") / STATE_FILE
    state = torch.load(path, weights_only=False)
    del state["spec"]["rollout.source"]  # as if the run predated rollout sources
    torch.save(state, path)
    moved = LocalTrainer(load_spec(micro_spec_file, [*run, "rollout.source=target"]), track=False)
    with pytest.raises(OpdError, match=r"rollout\.source=speculative \(its default: the field is newer than the "
                                       r"run\) but the spec now says target"):
        moved.run()
    assert LocalTrainer(load_spec(micro_spec_file, [*run, "steps=3"]), track=False).run().steps == 3


def test_a_run_resumed_at_its_last_step_reports_its_checkpoint(micro_spec_file, tmp_path):
    """Killed after its final checkpoint but before `opd run` evaluated it: the resumed command takes no step and
    must still hand on the trained drafter, not None (which `held_out_eval` reads as the warm drafter)."""
    spec = load_spec(micro_spec_file, [f"tracking.run_dir={tmp_path / 'r'}", "eval.every=0", "steps=2"])
    first = LocalTrainer(spec, track=False).run()
    again = LocalTrainer(spec, track=False).run()
    assert first.checkpoint is not None and again.steps == 2 and again.losses == []
    assert again.checkpoint == first.checkpoint


class LateEvaluations:
    """An evaluator that decodes each snapshot only at the learner's next step, after its weights have moved on,
    as the Ray evaluator actor may; the last step waits for everything. It keeps the weights it evaluated."""

    def __init__(self, evaluator) -> None:
        self.evaluator, self.fresh, self.queued, self.evaluated = evaluator, [], [], {}

    def submit(self, snapshot) -> None:
        self.fresh.append(snapshot)

    def finished(self, wait: bool = False) -> list:
        due, self.queued = (self.queued + self.fresh, []) if wait else (self.queued, self.fresh)
        self.fresh = []
        results = []
        for snapshot in due:
            results.append(self.evaluator(snapshot))
            drafter = self.evaluator.models.drafter  # the copy it decoded with
            self.evaluated[results[-1].step] = {k: v.clone() for k, v in drafter.state_dict().items()}
        return results


def test_an_eval_that_comes_back_late_is_of_its_step_and_logged_at_it(micro_spec_file):
    """Held-out eval off the learner's path: results reach the learner a step later, yet they evaluate the
    weights of the step they name (not the newer ones), and MLflow has them at that step."""
    import mlflow

    spec = load_spec(micro_spec_file)  # 4 steps, eval every 2: steps 0, 2, 4
    late = LocalTrainer(spec)
    evals = late.session.evals = LateEvaluations(late.session.evals.evaluator)
    late.start()
    weights = {0: {k: v.clone() for k, v in late.session.drafter.state_dict().items()}}
    reports = []
    for _ in range(spec.steps):
        reports.append(late.train_step())
        weights[late.session.step] = {k: v.clone() for k, v in late.session.drafter.state_dict().items()}
    late.session.close()
    assert [sorted(r.evals) for r in reports] == [[0], [], [2], [4]]  # step 4 is the last: it waits
    assert late.session.start_evals == []  # step 0's rows came with step 1's report
    for step, state in evals.evaluated.items():
        assert all(torch.equal(state[k], v) for k, v in weights[step].items()), step
        if step < spec.steps:  # evaluated after the learner had moved on
            assert not all(torch.equal(state[k], v) for k, v in weights[step + 1].items()), step
    got = {step: rows for r in reports for step, rows in r.evals.items()}
    mlflow.set_tracking_uri(late.spec.tracking_uri)
    history = mlflow.MlflowClient().get_metric_history(late.session.run_id, "eval_tau_greedy")
    assert sorted((m.step, m.value) for m in history) == [(s, rows[0].tau) for s, rows in sorted(got.items())]
