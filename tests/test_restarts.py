"""The restart budget (`resources.restarts`) and the policy-lag rule after a learner restores, without Ray."""

from __future__ import annotations

import pytest

from opd.errors import OpdError
from opd.spec import RestartsSpec, load_spec
from opd.train.policy_lag import survives_restore
from opd.train.restarts import Fault, RestartBudget

SCORER = Fault("scorer", "scorer-0", 1, "RuntimeError: Connection closed by peer")


def test_restarts_are_counted_per_role_and_per_run_and_the_one_past_the_bound_stops_the_run():
    budget = RestartBudget(RestartsSpec(per_role=2, per_run=3))
    budget.admit(SCORER, seen_at=10.0)
    budget.admit(Fault("scorer", "scorer-1", 0, "ActorDiedError: gone"))
    with pytest.raises(OpdError, match=r"^scorer-0 rank 1 failed \(RuntimeError: Connection closed by peer\); the "
                                       r"scorer already restarted 2 time\(s\) \(resources.restarts.per_role: 2\); "
                                       r"run the same command again to resume from the last checkpoint$"):
        budget.admit(SCORER)
    budget.admit(Fault("learner", "learner", 1, "RuntimeError: Timed out"))
    with pytest.raises(OpdError, match=r"^rollout-0 rank 0 failed .*resources.restarts.per_run: 3\)"):
        budget.admit(Fault("rollout", "rollout-0", 0, "ActorDiedError: gone"))
    assert len(budget.restarts) == 3


def test_time_to_heal_runs_from_the_fault_to_the_first_progress_and_is_logged():
    budget = RestartBudget(RestartsSpec())
    restart = budget.admit(SCORER, seen_at=10.0)
    restart.incarnation = 1  # scorer-0#1 failed
    assert budget.progressed({"scorer-0": (1, 5)}, at=11.0) == []  # still the dead incarnation's count
    assert budget.progressed({"scorer-0": (2, 0)}, at=11.5) == []  # restarted, nothing passed on yet
    assert budget.progressed({"scorer-0": (2, 1)}, at=12.5) == [restart]
    assert budget.healing() == [] and budget.log() == [
        {"role": "scorer", "replica": "scorer-0", "rank": 1, "cause": SCORER.cause, "node_lost": False,
         "steps_lost": 0, "heal_s": 2.5}]


def test_a_replica_lost_with_its_node_is_logged_but_never_stops_the_run():
    """The bound stops a fault that repeats; a node that goes is none of the replica's, however often it happens."""
    budget = RestartBudget(RestartsSpec(per_role=1, per_run=1))
    for _ in range(3):
        budget.admit(SCORER, node_lost=True)
    budget.admit(SCORER)  # the one counted restart
    with pytest.raises(OpdError, match=r"scorer already restarted 1 time\(s\)"):
        budget.admit(SCORER)
    assert [r["node_lost"] for r in budget.log()] == [True, True, True, False]


def test_a_role_without_restarts_stops_at_its_first_fault():
    with pytest.raises(OpdError, match="per_role: 0"):
        RestartBudget(RestartsSpec(per_role=0)).admit(SCORER)


@pytest.mark.parametrize("field, value", [("per_role", -1), ("collective_timeout_s", 0), ("stall_timeout_s", -2)])
def test_restart_fields_are_validated_by_name(micro_spec_file, field, value):
    with pytest.raises(OpdError, match=f"resources.restarts.{field}"):
        load_spec(micro_spec_file, [f"resources.restarts.{field}={value}"])


def test_after_a_restore_only_batches_drafted_with_weights_the_restored_learner_had_are_reused():
    assert survives_restore(drafted_with=3, restored=3) and survives_restore(drafted_with=0, restored=3)
    assert not survives_restore(drafted_with=4, restored=3)  # the dead learner's v4, which will be published anew
