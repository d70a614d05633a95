"""The driver's decisions about replicas (opd/train/fleet.py), without Ray: the slots a spec's ranges make, where
each replica is placed, the order they ask for room, when a lost one needs a new group, what the run says while it
runs with fewer, and when it stops waiting for room."""

from __future__ import annotations

import pytest

from opd.errors import OpdError
from opd.spec import load_spec
from opd.tracking import Tracker
from opd.train.fleet import Fleet, log_replicas, placement

RANGE = ["resources.rollout.replicas={min: 1, max: 3}", "resources.scorer.replicas={min: 1, max: 2}"]


@pytest.fixture
def spec(micro_spec_file):
    return load_spec(micro_spec_file, ["engine=ray", "resources.cluster.num_cpus=8", *RANGE])


def test_a_range_makes_max_slots_and_min_of_them_must_run_to_start(spec):
    fleet = Fleet.of(spec)
    assert [m.name for m in fleet.members] == ["learner", "scorer-0", "scorer-1", "rollout-0", "rollout-1",
                                               "rollout-2", "evaluator"]
    assert fleet.short_at_start() == "learner 0 of 1, scorer 0 of 1, rollout 0 of 1, evaluator 0 of 1"
    for name in ("learner", "scorer-0", "rollout-0", "evaluator"):
        assert fleet.placed(name, frozenset({"a"}), 0.0) is None  # the run starts with these: nothing to say
    assert fleet.short_at_start() is None
    assert fleet.counts() == {"learner": 1, "scorer": 1, "rollout": 1, "evaluator": 1}


def test_every_roles_min_asks_for_room_before_any_extra(spec):
    fleet = Fleet.of(spec)
    order = sorted((m.name for m in fleet.members), key=fleet.priority)
    assert order == ["learner", "scorer-0", "rollout-0", "evaluator", "scorer-1", "rollout-1", "rollout-2"]


def test_each_replica_has_a_group_of_its_own_sized_by_its_role(micro_spec_file):
    spec = load_spec(micro_spec_file, ["engine=ray", "resources.cluster.num_cpus=8",
                                       "resources.scorer.gpus_per_replica=2", "resources.learner.replicas=2",
                                       "optim.batch_size=2", "optim.micro_batch_size=1"])
    scorer = placement(spec, "scorer", 0)
    assert scorer.bundle_dicts == [spec.resources.scorer.bundle] * 2 and scorer.near_learner
    assert scorer.strategy == "STRICT_PACK" and not scorer.shared
    assert placement(spec, "learner").bundle_dicts == [spec.resources.learner.bundle] * 2
    assert not placement(spec, "rollout", 0).near_learner
    assert placement(spec, "evaluator").shared  # the micro evaluator reserves nothing: no group


def test_a_colocated_scorer_takes_its_bundles_in_the_learners_group(micro_spec_file):
    spec = load_spec(micro_spec_file, ["engine=ray", "resources.colocate_learner=true", "resources.scorer.replicas=2",
                                       "resources.cluster.num_cpus=8"])
    assert placement(spec, "learner").bundle_dicts == spec.resources.learner_bundles()
    assert [(p.shared, p.first) for p in (placement(spec, "scorer", i) for i in (0, 1))] == [(True, 0), (True, 1)]


def test_a_rank_that_died_on_a_live_node_restarts_in_place_and_a_lost_node_waits_for_room(spec):
    fleet = Fleet.of(spec)
    fleet.placed("rollout-0", frozenset({"a"}), 0.0)
    fleet.placed("rollout-1", frozenset({"b"}), 0.0)
    fleet.started_at = 1.0
    assert fleet.lost("rollout-0", alive={"a", "b"}, now=5.0) is False  # a process died: same group
    assert fleet.take_notes() == [] and fleet.running("rollout") == 2
    assert fleet.lost("rollout-1", alive={"a"}, now=6.0) is True  # its node is gone: a new group
    assert fleet.take_notes() == ["rollout-1 was lost with its node; it starts again where there is room, "
                                  "meanwhile 1 of 3 rollout replicas run"]
    assert fleet.placed("rollout-1", frozenset({"c"}), 9.0) == "rollout-1 is running (2 of 3 rollout replicas run)"
    assert fleet.placed("rollout-2", frozenset({"c"}), 9.5) == "rollout-2 is running (3 of 3 rollout replicas run)"
    assert fleet.line() == "rollout 3/3 scorer 0/2"  # the progress line's column


def test_each_roles_replicas_are_logged_per_step_to_mlflow(micro_spec_file, tmp_path):
    from mlflow import MlflowClient

    spec = load_spec(micro_spec_file, [f"tracking.run_dir={tmp_path / 'run'}"])
    run_id = Tracker(spec).run_id
    log_replicas(spec, run_id, {"rollout": 1, "scorer": 1}, 1)
    log_replicas(spec, run_id, {"rollout": 3, "scorer": 1}, 2)
    history = MlflowClient(tracking_uri=spec.tracking_uri).get_metric_history(run_id, "replicas_rollout")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 3.0)]


def test_a_role_with_none_running_stops_the_run_after_the_bound_and_says_a_rerun_resumes(micro_spec_file):
    spec = load_spec(micro_spec_file, ["engine=ray", "resources.restarts.placement_wait_s=30"])
    fleet = Fleet.of(spec)
    for member in fleet.members:
        fleet.placed(member.name, frozenset({"a"}), 0.0)
    fleet.lost("learner", alive={"b"}, now=100.0)
    assert fleet.overdue(129.0) is None
    assert fleet.overdue(131.0) == ("learner: no replica had room for 30s (resources.restarts.placement_wait_s); "
                                    "expected a node with room for its placement group; run the same command "
                                    "again to resume from the last checkpoint")


def test_the_wait_counts_from_the_last_replica_lost_not_from_extras_that_never_ran(micro_spec_file):
    """rollout {min: 1, max: 3} ran with one replica for a long time; its loss starts the wait, although the two
    extras have waited for room since the start."""
    spec = load_spec(micro_spec_file, ["engine=ray", "resources.cluster.num_cpus=8", *RANGE,
                                       "resources.restarts.placement_wait_s=30"])
    fleet = Fleet.of(spec)
    for name in ("learner", "scorer-0", "rollout-0", "evaluator"):
        fleet.placed(name, frozenset({"a"}), 0.0)
    fleet.lost("rollout-0", alive=set(), now=1000.0)
    assert fleet.overdue(1020.0) is None
    assert fleet.overdue(1031.0).startswith("rollout: no replica had room for 30s")


def test_ranges_are_for_rollout_and_scorer_only_and_read_as_one_line(micro_spec_file):
    with pytest.raises(OpdError, match=r"resources.learner.replicas: a range \{min: 1, max: 2\} \(expected a number: "
                                       r"the learner's ranks restore a checkpoint written by as many\)"):
        load_spec(micro_spec_file, ["resources.learner.replicas={min: 1, max: 2}"])
    with pytest.raises(OpdError, match=r"resources.rollout.replicas: got \{'min': 3, 'max': 1\} \(value error, max: "
                                       r"1 is below min 3"):
        load_spec(micro_spec_file, ["resources.rollout.replicas={min: 3, max: 1}"])
    with pytest.raises(OpdError, match=r"resources.scorer.replicas.foo: unknown key \(expected one of: min, max\)"):
        load_spec(micro_spec_file, ["resources.scorer.replicas={min: 1, max: 2, foo: 3}"])
    with pytest.raises(OpdError, match=r"resources.scorer.replicas: a range .*colocate_learner"):
        load_spec(micro_spec_file, ["resources.colocate_learner=true", "resources.scorer.replicas={min: 1, max: 2}"])
