"""Whole runs of the Ray actor system against the single-process reference, on one local Ray for the whole module.
Ray's single actors and queues are in tests/test_ray_actors.py, the rebuilt rollout sources in
tests/test_ray_sources.py: each module starts its own local Ray, so `make test`'s two workers take them side by
side."""

from __future__ import annotations

import json
import time

import mlflow
import pytest
import ray
import torch

from actors.driver import RayRun, run_ray
from actors.queues import BatchQueue
from opd.cli import main
from opd.errors import OpdError
from opd.models.flops import FlopCounter
from opd.spec import load_spec
from opd.train.ledger import fault_line, reconciles
from opd.train.local import LocalTrainer
from opd.train.messages import AnchorBatch, ScoredItem
from opd.train.ticket import Ticket
from tests.helpers.ray_runs import account, local_losses, ray_cluster, ray_spec, wait_for  # noqa: F401 (a fixture)


def test_ray_path_equals_local_then_resumes(ray_cluster, micro_spec_file, tmp_path):
    """One rollout actor, max_policy_lag 0: the Ray run takes the local run's steps exactly; a stale batch is
    counted, never trained, and re-produced fresh; the rollout drafts with the learner's weights bit for bit; a
    killed driver resumes."""
    local = local_losses(micro_spec_file, tmp_path, steps=5)
    run = RayRun(ray_spec(micro_spec_file, tmp_path, "resources.queue_size=4", steps=5), track=False)
    try:
        assert run.start() == 0
        wait_for(lambda: account(run)["claimed"] == 2)  # batches 0 and 1; batch 2 waits for version 1
        ticket = ray.get(run.ledger.claim.remote(ray.get(run.ledger.register.remote("test")), 99))
        assert ticket == Ticket(2, 0)
        stale = ScoredItem(AnchorBatch(index=2, draft_version=-5, records=[], flops=FlopCounter()), [])
        run.scored.put(stale, ticket)  # batch 2 drafted with ancient weights: sent back, produced again
        reports = [r for step in (1, 2, 3) for r in run.train(step)]
        assert [r["metrics"]["loss"] for r in reports] == pytest.approx(local[:3], rel=1e-5, abs=1e-7)
        counters = ray.get(run.learner.counters.remote())
        assert counters["stale_batches"] == 1 and counters["trained_batches"] == 6
        ledger = account(run)
        assert (ledger["stale"], ledger["reproduced"], ledger["trained"]) == (1, 1, 6) and reconciles(ledger)
        version, learner_state = ray.get(run.learner.draft_state.remote())
        rollout_version, rollout_state = wait_for(
            lambda: (s := ray.get(run.rollouts[0].draft_state.remote()))[0] == version and s)
        assert rollout_version == version == 3
        for k, v in learner_state.items():
            assert torch.equal(v, rollout_state[k]), k
    finally:
        run.shutdown()  # the driver "dies" after step 3; its checkpoints stay
    spec = ray_spec(micro_spec_file, tmp_path, steps=5)
    # as `opd train` runs it, resumed at step 3; untracked: the learner's MLflow store costs its start seconds, and
    # the account's MLflow metrics are record_ledger's, tested tracked on the local engine (test_main_job.py) and
    # on Ray with a killed actor (make test-all: test_a_run_that_lost_batches_shows_the_account)
    resumed = run_ray(spec, track=False)
    assert resumed.steps == 5 and 5 in resumed.evals  # the evaluator actor's rows for the last step, awaited
    assert resumed.losses == pytest.approx(local[3:], rel=1e-5, abs=1e-7)  # steps 4 and 5, taken here
    # undisturbed: the ledger's account of batches 6..9 is zeros but what was trained, and no line
    ledger = resumed.ledger
    assert ledger["trained"] == 4 and ledger["lost"] == ledger["orphaned"] == ledger["restarts"] == ledger["stale"] == 0
    assert reconciles(ledger) and fault_line(ledger) is None


# a batch that is never re-produced leaves the learner waiting for it: fail instead of hanging
fails_if_a_batch_goes_missing = pytest.mark.timeout(240)
# A whole Ray training run with a kill and a recovery (make test-all): this file took over 15 minutes on a shared
# 2-core CPU; make test keeps the Ray-equals-local run with its resume and the single-actor checks.
recovery_run = pytest.mark.slow


def full_pipeline(run: RayRun) -> None:
    """Start and wait until every stage holds batches it has not passed on (max_policy_lag 1, queues of 1, no
    step trained yet): the scorer holds 0 (in the scored queue) and 1 (blocked on it), rollout-0 holds 2 (in the
    anchors queue) and 3 (blocked on it)."""
    assert run.start() == 0
    full = {0: "scorer-0#1", 1: "scorer-0#1", 2: "rollout-0#1", 3: "rollout-0#1"}
    wait_for(lambda: ray.get(run.ledger.holders.remote()) == full)


def assert_survived(run: RayRun, reports: list[dict], steps: int, given_up: int) -> None:
    """The run reached its budget in the same RayRun, every batch index was trained exactly once, and every
    batch the fault took was produced again."""
    assert [r["step"] for r in reports] == list(range(1, steps + 1))
    ledger = account(run)
    assert ray.get(run.ledger.trained_indices.remote()) == list(range(2 * steps)) and ledger["duplicates"] == 0
    assert ledger["lost"] + ledger["orphaned"] == given_up == ledger["reproduced"]
    assert ledger["restarts"] == 1 and ledger["stale"] == 0 and reconciles(ledger)
    assert ray.get(run.learner.counters.remote())["trained_batches"] == 2 * steps


@fails_if_a_batch_goes_missing
@recovery_run
def test_a_killed_rollout_actor_restarts_and_the_run_continues(ray_cluster, micro_spec_file, tmp_path):
    run = RayRun(ray_spec(micro_spec_file, tmp_path, "resources.max_policy_lag=1", steps=3), track=False)
    try:
        full_pipeline(run)
        ray.kill(run.rollouts[0])  # batches 2 (enqueued) and 3 die with it; the driver restarts it
        time.sleep(1.0)  # the kill lands before anyone reads batch 2
        assert_survived(run, run.train(3), steps=3, given_up=2)
    finally:
        run.shutdown()


@fails_if_a_batch_goes_missing
@recovery_run
def test_a_run_that_lost_batches_shows_the_account(ray_cluster, micro_spec_file, tmp_path, capsys, monkeypatch):
    """`opd run` with rollout-0 killed mid-run (the module's Ray, which `init_ray` joins): it recovers, prints one
    ledger line, and records the account in summary.json and MLflow."""
    start = RayRun.start

    def start_then_kill(run: RayRun) -> int:
        step = start(run)
        wait_for(lambda: ray.get(run.ledger.holders.remote()).get(3) == "rollout-0#1")  # 2 enqueued, 3 in hand
        ray.kill(run.rollouts[0])
        time.sleep(1.0)
        return step

    monkeypatch.setattr(RayRun, "start", start_then_kill)
    sets = ["engine=ray", "steps=3", "eval.every=0", "eval.offline=false", "resources.max_policy_lag=1",
            "resources.queue_size=1", f"tracking.run_dir={tmp_path / '{name}'}"]
    assert main(["run", str(micro_spec_file), *[a for s in sets for a in ("--set", s)]]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ledger: ")]
    spec = load_spec(micro_spec_file, sets)
    ledger = json.loads((spec.run_dir / "summary.json").read_text())["ledger"]
    assert ledger["restarts"] == 1 and ledger["lost"] + ledger["orphaned"] >= 1 and reconciles(ledger)
    assert lines == [fault_line(ledger)]
    assert f"lost {ledger['lost']}, orphaned {ledger['orphaned']}, stale {ledger['stale']}, rewound 0;" in lines[0]
    client = mlflow.MlflowClient(spec.tracking_uri)
    run_id = client.search_runs([client.get_experiment_by_name(spec.tracking.experiment).experiment_id])[0].info.run_id
    metrics = client.get_run(run_id).data.metrics
    assert {k: metrics[f"ledger_{k}"] for k in ledger} == ledger


@fails_if_a_batch_goes_missing
@recovery_run
def test_a_killed_scorer_restarts_and_the_run_continues_until_it_is_out_of_restarts(ray_cluster, micro_spec_file,
                                                                                     tmp_path):
    run = RayRun(ray_spec(micro_spec_file, tmp_path, "resources.max_policy_lag=1", "resources.restarts.per_role=1",
                          steps=3), track=False)
    try:
        full_pipeline(run)
        ray.kill(run.scorers[0])  # batches 0 (enqueued) and 1 die with it
        time.sleep(1.0)  # the kill lands before the learner reads batch 0
        assert_survived(run, run.train(3), steps=3, given_up=2)
        ray.kill(run.scorers[0])  # past resources.restarts.per_role: the run stops with one line
        with pytest.raises(OpdError, match=r"^scorer-0 rank 0 failed \([^\n]*\); the scorer already restarted 1 "
                                           r"time\(s\) \(resources.restarts.per_role: 1\); run the same command "
                                           r"again to resume from the last checkpoint$"):
            run.train(5)
    finally:
        run.shutdown()


@ray.remote
class _Producer:
    def claim_and_put(self, queue: BatchQueue, ledger) -> Ticket:
        """Act as one more rollout producer: claim the next batch and enqueue it."""
        ticket = ray.get(ledger.claim.remote(ray.get(ledger.register.remote("producer")), 99))
        queue.put(AnchorBatch(ticket.index, 0, [], FlopCounter()), ticket)
        return ticket


@fails_if_a_batch_goes_missing
@recovery_run
def test_batches_enqueued_by_a_producer_that_died_are_reproduced(ray_cluster, micro_spec_file, tmp_path):
    """The scorer finds the dead producer's batch Lost, reports it, and carries on; the batch is produced again
    and the run takes exactly the local run's steps."""
    local = local_losses(micro_spec_file, tmp_path, steps=2)
    run = RayRun(ray_spec(micro_spec_file, tmp_path, steps=2), track=False)
    producer = _Producer.remote()
    try:
        assert run.start() == 0
        wait_for(lambda: ray.get(run.ledger.holders.remote()) == {0: "scorer-0#1", 1: "scorer-0#1"})
        assert ray.get(producer.claim_and_put.remote(run.anchors, run.ledger)) == Ticket(2, 0)
        ray.kill(producer, no_restart=True)  # batch 2 waits in the anchors queue, its owner gone
        time.sleep(1.0)
        reports = run.train(2)
        assert [r["metrics"]["loss"] for r in reports] == pytest.approx(local, rel=1e-5, abs=1e-7)
        ledger = account(run)
        assert (ledger["lost"], ledger["reproduced"], ledger["trained"], ledger["dropped"]) == (1, 1, 4, 0)
        assert ray.get(run.ledger.trained_indices.remote()) == [0, 1, 2, 3] and reconciles(ledger)
    finally:
        run.shutdown()


@recovery_run
def test_a_killed_learner_resumes_to_the_uninterrupted_drafter(ray_cluster, micro_spec_file, tmp_path):
    local = LocalTrainer(load_spec(micro_spec_file, ["steps=3", "eval.every=0", f"tracking.run_dir={tmp_path / 'l'}"]),
                         track=False)
    local.run()
    run = RayRun(ray_spec(micro_spec_file, tmp_path, "resources.restarts.per_role=0", steps=3), track=False)
    try:
        run.start()
        run.train(1)
        ray.kill(run.learner, no_restart=True)  # with no restarts allowed (tests/test_ray_heal.py: with them)
        with pytest.raises(OpdError, match=r"^learner rank 0 failed .*per_role: 0\); run the same command again"):
            run.train(3)
    finally:
        run.shutdown()
    again = RayRun(ray_spec(micro_spec_file, tmp_path, steps=3), track=False)
    try:
        assert again.start() == 1
        again.train(3)
        _, state = ray.get(again.learner.draft_state.remote())
    finally:
        again.shutdown()
    for k, v in local.session.drafter.state_dict().items():
        assert torch.allclose(v, state[k], atol=1e-6), k


