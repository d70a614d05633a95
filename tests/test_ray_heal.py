"""A run that heals itself (issue 63): a rank of a rollout, scorer or evaluator replica, or of the learner, killed
with SIGKILL or stopped with SIGSTOP mid-run, is restarted in the same run, and the run still reaches its step
budget with every batch trained once and the uninterrupted run's drafter.

The bound: at `max_policy_lag` 0 the Ray path takes exactly the local path's steps (tests/test_ray.py), whatever
replica produced a batch and however often it was produced, because batch i holds the same prompts and seeds
whoever produces it and every step trains on the weights of the step before. A healed run's drafter must therefore
equal the uninterrupted local run's within float noise: `BOUND` (1e-5, absolute, per weight). At `max_policy_lag` 1
two uninterrupted runs differ by about 1e-3 (the batches of a step are drafted with whichever of two versions was
newest), which would hide a step trained on the wrong batch; the tests use lag 0 so such a bug fails them.

Each test is a whole Ray run with sharded replicas (gloo ranks) on a shared 2-core CPU, so they are `slow` (make
test-all); tests/test_restarts.py and tests/test_ledger.py cover the budget, the rewind and the policy-lag rule in
make test.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest
import ray
import torch

from actors.driver import RayRun
from opd.train.ledger import reconciles
from tests.helpers.ray_runs import (  # noqa: F401 (ray_four_cpus is a fixture)
    BOUND,
    STEPS,
    account,
    local_drafter,
    ray_four_cpus,
    ray_spec,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SHARDED = ["resources.cluster.num_cpus=4", "resources.rollout.gpus_per_replica=2",
           "resources.scorer.gpus_per_replica=2", "resources.restarts.collective_timeout_s=15",
           "resources.restarts.stall_timeout_s=60"]


def pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def rank(run: RayRun, name: str, index: int):
    replica = run.learners if name == "learner" else next(r for r in run.replicas if r.name == name)
    return replica.ranks[index]


def assert_healed(run: RayRun, reports: list[dict], local: dict[str, torch.Tensor], restarts: int,
                  steps: int = STEPS) -> None:
    """Every step reported once, every batch index trained exactly once, the ledger reconciles, and the drafter is
    the uninterrupted run's within `BOUND`."""
    assert [r["step"] for r in reports] == list(range(1, steps + 1))
    ledger = account(run)
    assert ray.get(run.ledger.trained_indices.remote()) == list(range(2 * steps))
    assert ledger["trained"] == 2 * steps and ledger["duplicates"] == 0 and reconciles(ledger), ledger
    assert len(run.budget.restarts) == restarts, run.budget.log()
    _, state = ray.get(run.learner.draft_state.remote())
    for k, v in local.items():
        assert torch.allclose(v, state[k], rtol=0, atol=BOUND), k


def faulted_run(spec, fault, *, at: int = 1) -> tuple[RayRun, list[dict]]:
    """Train to step `at`, apply `fault(run)`, train to the end; the run and its reports."""
    run = RayRun(spec, track=False)
    run.start()
    reports = run.train(at)
    fault(run)
    return run, reports + run.train(STEPS)


def test_a_killed_follower_rank_of_the_scorer_restarts_the_replica(ray_four_cpus, micro_spec_file, tmp_path):
    local = local_drafter(micro_spec_file, tmp_path)
    old = []

    def kill_follower(run: RayRun) -> None:
        old.append(rank(run, "scorer-0", 1))
        os.kill(pid(old[0]), signal.SIGKILL)

    run, reports = faulted_run(ray_spec(micro_spec_file, tmp_path, *SHARDED, steps=STEPS), kill_follower)
    try:
        assert_healed(run, reports, local, restarts=1)
        fault = run.budget.restarts[0].fault
        assert (fault.role, fault.replica, fault.rank) == ("scorer", "scorer-0", 1)
        new = rank(run, "scorer-0", 1)  # the replacement, under the same name
        assert new != old[0] and ray.get_actor("scorer-0-rank1") == new
    finally:
        run.shutdown()


def test_a_killed_leader_rank_of_the_rollout_restarts_the_replica(ray_four_cpus, micro_spec_file, tmp_path):
    local = local_drafter(micro_spec_file, tmp_path)
    run, reports = faulted_run(ray_spec(micro_spec_file, tmp_path, *SHARDED, steps=STEPS),
                               lambda run: os.kill(pid(rank(run, "rollout-0", 0)), signal.SIGKILL))
    try:
        assert_healed(run, reports, local, restarts=1)
        fault = run.budget.restarts[0].fault
        assert (fault.role, fault.replica, fault.rank) == ("rollout", "rollout-0", 0)
        assert account(run)["restarts"] == 1  # the ledger saw a second incarnation of rollout-0
    finally:
        run.shutdown()


def test_a_stopped_rank_is_caught_by_the_collective_timeout(ray_four_cpus, micro_spec_file, tmp_path):
    """SIGSTOP a follower rank of the scorer: its leader's next collective times out (gloo's error names the
    operation), the stopped rank is found by the driver's probe, and the replica restarts."""
    local = local_drafter(micro_spec_file, tmp_path)
    stopped = []

    def stop_follower(run: RayRun) -> None:
        stopped.append(pid(rank(run, "scorer-0", 1)))
        os.kill(stopped[0], signal.SIGSTOP)

    try:
        run, reports = faulted_run(ray_spec(micro_spec_file, tmp_path, *SHARDED, steps=STEPS), stop_follower)
        try:
            assert_healed(run, reports, local, restarts=1)
            fault = run.budget.restarts[0].fault
            assert (fault.replica, fault.rank) == ("scorer-0", 1), fault
            assert re.search(r"[Tt]imed out.*\(in the collective of model\.\S+, its weight sharded on dim \d\)",
                             fault.cause), fault.cause
        finally:
            run.shutdown()
    finally:
        for p in stopped:  # if the restart did not kill it, do not leave a stopped process behind
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass


def test_two_faults_in_one_run(ray_four_cpus, micro_spec_file, tmp_path):
    """The scorer's follower rank, then the rollout's leader rank."""
    local = local_drafter(micro_spec_file, tmp_path)
    run = RayRun(ray_spec(micro_spec_file, tmp_path, *SHARDED, steps=STEPS), track=False)
    try:
        run.start()
        reports = run.train(1)
        os.kill(pid(rank(run, "scorer-0", 1)), signal.SIGKILL)
        reports += run.train(2)
        os.kill(pid(rank(run, "rollout-0", 0)), signal.SIGKILL)
        reports += run.train(STEPS)
        assert_healed(run, reports, local, restarts=2)
        assert [(r.fault.replica, r.fault.rank) for r in run.budget.restarts] == [("scorer-0", 1), ("rollout-0", 0)]
    finally:
        run.shutdown()


@pytest.mark.parametrize("learners", [1, 2])
def test_a_killed_learner_rank_restores_its_checkpoint_in_the_same_run(ray_four_cpus, micro_spec_file, tmp_path,
                                                                       learners):
    """Checkpoints every 2 steps; the learner's last rank is killed after step 3, so the restarted learner
    restores step 2, retrains step 3 (its batches rewound, not trained twice) and goes on."""
    local = local_drafter(micro_spec_file, tmp_path)
    spec = ray_spec(micro_spec_file, tmp_path, "resources.cluster.num_cpus=4", "tracking.checkpoint_every=2",
                    f"resources.learner.replicas={learners}", "resources.learner.num_cpus=0.25",
                    "resources.restarts.collective_timeout_s=15", steps=STEPS)
    run, reports = faulted_run(spec, lambda run: os.kill(pid(rank(run, "learner", learners - 1)), signal.SIGKILL),
                               at=3)
    try:
        assert_healed(run, reports, local, restarts=1)
        restart = run.budget.restarts[0]
        assert (restart.fault.role, restart.fault.rank, restart.steps_lost) == ("learner", learners - 1, 1)
        assert account(run)["rewound"] == 2
    finally:
        run.shutdown()


def test_the_evaluator_killed_during_an_evaluation_restarts_and_no_evaluation_is_lost(ray_four_cpus,
                                                                                         micro_spec_file, tmp_path):
    local = local_drafter(micro_spec_file, tmp_path)
    spec = ray_spec(micro_spec_file, tmp_path, "resources.cluster.num_cpus=4", "eval.every=1",
                    "eval.offline=false", steps=STEPS)

    def kill_while_evaluating(run: RayRun) -> None:
        evaluator = run.evaluator
        # the learner submitted step 1's snapshot; the evaluator decodes it in its main thread
        wait_for(lambda: ray.get(evaluator.__ray_call__.remote(lambda self: self.evaluator.lock.locked())),
                 timeout=120)
        os.kill(pid(evaluator), signal.SIGKILL)

    run, reports = faulted_run(spec, kill_while_evaluating)
    try:
        assert_healed(run, reports, local, restarts=1)
        assert run.budget.restarts[0].fault.replica == "evaluator"
        evaluated = {step for r in reports for step in r["evals"]}
        assert set(range(1, STEPS + 1)) <= evaluated
    finally:
        run.shutdown()


def test_soak_random_faults_every_few_steps(ray_four_cpus, micro_spec_file, tmp_path):
    """A tiny run of 8 steps with a random rank of a random role killed every 2 steps (a rollout or scorer rank,
    or the learner); it reaches its budget with the uninterrupted drafter."""
    steps, rng = 8, random.Random(63)
    local = local_drafter(micro_spec_file, tmp_path, steps)
    spec = ray_spec(micro_spec_file, tmp_path, *SHARDED, "tracking.checkpoint_every=2",
                    "resources.restarts.per_role=4", steps=steps)
    run = RayRun(spec, track=False)
    try:
        run.start()
        reports = []
        for until in range(2, steps + 1, 2):
            reports += run.train(until)
            if until < steps:
                name, index = rng.choice([("scorer-0", 0), ("scorer-0", 1), ("rollout-0", 0), ("rollout-0", 1),
                                          ("learner", 0)])
                os.kill(pid(rank(run, name, index)), signal.SIGKILL)
                time.sleep(rng.uniform(0, 3))
        assert_healed(run, reports, local, restarts=3, steps=steps)
    finally:
        run.shutdown()
