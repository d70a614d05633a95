"""The Ray actor system against the single-process reference, on one local Ray for the whole module."""

from __future__ import annotations

import time

import pytest
import ray
import torch
import yaml

from actors.driver import RayRun, place
from actors.queues import BatchQueue
from opd.errors import OpdError
from opd.spec import ExperimentSpec, load_spec
from opd.train.local import LocalTrainer
from opd.train.rollout import AnchorBatch
from opd.train.flops import FlopCounter
from opd.train.session import ScoredItem


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def ray_spec(micro_spec_file, tmp_path, **overrides) -> ExperimentSpec:
    sets = ["engine=ray", "resources.max_policy_lag=0", "resources.queue_size=1", "eval.every=0",
            f"tracking.run_dir={tmp_path / 'ray' / '{name}'}", "tracking.checkpoint_every=1"]
    return load_spec(micro_spec_file, sets + [f"{k}={v}" for k, v in overrides.items()])


def wait_for(fn, timeout: float = 60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_ray_path_equals_local_then_resumes(ray_cluster, micro_spec_file, tmp_path):
    """One rollout actor, max_policy_lag 0: the Ray run takes the local run's steps exactly; a stale batch is
    skipped and counted; the rollout drafts with the learner's weights bit for bit; a killed driver resumes."""
    local = LocalTrainer(load_spec(micro_spec_file, ["steps=5", "eval.every=0",
                                                     f"tracking.run_dir={tmp_path / 'local'}"]), track=False).run()
    run = RayRun(ray_spec(micro_spec_file, tmp_path, steps=5), track=False)
    try:
        stale = ScoredItem(AnchorBatch(index=-1, draft_version=-5, records=[], flops=FlopCounter()), [])
        run.scored.put(stale, -1)  # an ancient batch waiting before anything else
        assert run.start() == 0
        reports = [r for step in (1, 2, 3) for r in run.train(step)]
        assert [r["metrics"]["loss"] for r in reports] == pytest.approx(local.losses[:3], rel=1e-5, abs=1e-7)
        counters = ray.get(run.learner.counters.remote())
        assert counters["stale_batches"] == 1 and counters["trained_batches"] == 6
        version, learner_state = ray.get(run.learner.draft_state.remote())
        rollout_version, rollout_state = wait_for(
            lambda: (s := ray.get(run.rollouts[0].draft_state.remote()))[0] == version and s)
        assert rollout_version == version == 3
        for k, v in learner_state.items():
            assert torch.equal(v, rollout_state[k]), k
    finally:
        run.shutdown()  # the driver "dies" after step 3; its checkpoints stay
    resumed = RayRun(ray_spec(micro_spec_file, tmp_path, steps=5), track=False)
    try:
        assert resumed.start() == 3
        reports = [r for step in (4, 5) for r in resumed.train(step)]
        assert [r["step"] for r in reports] == [4, 5]
        assert [r["metrics"]["loss"] for r in reports] == pytest.approx(local.losses[3:], rel=1e-5, abs=1e-7)
    finally:
        resumed.shutdown()


@ray.remote
def _produce(queue: BatchQueue, n: int) -> float:
    return sum(queue.put({"payload": torch.full((1000,), float(i))}, i) for i in range(n))


def test_full_queue_blocks_the_producer_and_loses_nothing(ray_cluster):
    queue = BatchQueue("test-backpressure", maxsize=2)
    try:
        producer = _produce.remote(queue, 6)
        wait_for(lambda: queue.depth() == 2)
        time.sleep(1.0)
        assert queue.depth() == 2 and not ray.wait([producer], timeout=0)[0]  # blocked, not dropping
        got = [queue.get()["payload"][0].item() for _ in range(6)]
        assert got == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert ray.get(producer) > 0.5  # it really waited
    finally:
        queue.shutdown()


def test_placement_follows_the_spec_and_refuses_the_impossible(ray_cluster, micro_spec_file, tmp_path):
    layout = {"resources": {"cluster": {"num_gpus": 4, "num_cpus": 2},
                            "rollout": {"replicas": 2, "num_gpus": 1, "num_cpus": 0.25},
                            "scorer": {"replicas": 1, "num_gpus": 1, "num_cpus": 0.25},
                            "learner": {"replicas": 1, "num_gpus": 1, "num_cpus": 0.25}}}
    base = yaml.safe_load(micro_spec_file.read_text())
    spec = ExperimentSpec.model_validate({**base, **layout})
    learner_pg, rollout_pg = place(spec)
    try:
        learner_bundles = ray.util.placement_group_table(learner_pg)["bundles"]
        rollout_bundles = ray.util.placement_group_table(rollout_pg)["bundles"]
        assert [b["GPU"] for b in learner_bundles.values()] == [1.0, 1.0]  # learner + its scorer, packed
        assert [b["GPU"] for b in rollout_bundles.values()] == [1.0, 1.0]
    finally:
        ray.util.remove_placement_group(learner_pg)
        ray.util.remove_placement_group(rollout_pg)
    layout["resources"]["cluster"]["num_gpus"] = 8  # the spec believes in 8 GPUs; Ray has 4
    layout["resources"]["rollout"]["replicas"] = 5
    with pytest.raises(OpdError, match="cannot place"):
        place(ExperimentSpec.model_validate({**base, **layout}), timeout_s=2)


def test_a_dead_rollout_actor_stops_the_run_cleanly_and_the_rerun_resumes(ray_cluster, micro_spec_file, tmp_path):
    run = RayRun(ray_spec(micro_spec_file, tmp_path, steps=3), track=False)
    try:
        run.start()
        run.train(1)
        ray.kill(run.rollouts[0], no_restart=True)
        with pytest.raises(OpdError, match="rollout or scorer actor failed.*resume from the last checkpoint"):
            run.train(3)
    finally:
        run.shutdown()
    again = RayRun(ray_spec(micro_spec_file, tmp_path, steps=3), track=False)
    try:
        assert again.start() == 1  # nothing trained is lost: the checkpoint of step 1
        assert [r["step"] for r in again.train(3)] == [2, 3]
    finally:
        again.shutdown()


def test_a_killed_learner_resumes_to_the_uninterrupted_drafter(ray_cluster, micro_spec_file, tmp_path):
    local = LocalTrainer(load_spec(micro_spec_file, ["steps=3", "eval.every=0", f"tracking.run_dir={tmp_path / 'l'}"]),
                         track=False)
    local.run()
    run = RayRun(ray_spec(micro_spec_file, tmp_path, steps=3), track=False)
    try:
        run.start()
        run.train(1)
        ray.kill(run.learner, no_restart=True)
        with pytest.raises(OpdError, match="learner failed.*resume"):
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


@ray.remote
class _Producer:
    def put(self, queue: BatchQueue, index: int) -> None:
        queue.put({"payload": torch.ones(10)}, index)


def test_a_batch_whose_producer_died_is_reported_lost_with_its_index(ray_cluster):
    from actors.queues import Lost

    queue = BatchQueue("test-lost", maxsize=4)
    producer = _Producer.remote()
    try:
        ray.get(producer.put.remote(queue, 7))
        ray.kill(producer, no_restart=True)
        time.sleep(1.0)  # let the owner's death reach the object directory
        with pytest.raises(Lost) as lost:
            queue.get()
        assert lost.value.index == 7  # never silently dropped: the consumer learns which batch to re-produce
    finally:
        queue.shutdown()
