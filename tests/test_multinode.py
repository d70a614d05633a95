"""Issue 25, defect 7: a run on a Ray cluster of two nodes (`ray.cluster_utils.Cluster`, both on this machine).

The head has no CPUs, as in cluster/raycluster.yaml, so every role lands on the worker node while the driver
(this process) is attached to the head. One run directory, resolved in the driver, is what every actor uses; a
relative one, or a sqlite MLflow store the learner would write from another node, is one line; the control
actors live on the driver's node; a waiting rollout blocks instead of polling.
"""

from __future__ import annotations

import os
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from actors.driver import RayRun
from actors.ledger import LedgerActor
from actors.weight_store import WeightStore
from opd.errors import OpdError
from opd.run_dir import RunDirLock
from opd.spec import load_spec
from opd.train.ticket import Ticket


@pytest.fixture(scope="module")
def two_nodes():
    """A CPU-less head (this driver's node) and a worker with 2 CPUs; yields (head id, worker id)."""
    if ray.is_initialized():  # a Ray another test module left running
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    worker = cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, configure_logging=False, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield cluster.head_node.node_id, worker.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()


def ray_spec(micro_spec_file, *sets: str):
    return load_spec(micro_spec_file, ["engine=ray", "resources.max_policy_lag=0", "eval.every=0", *sets])


def node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def wait_for_cpus(expected: float, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while ray.available_resources().get("CPU", 0) != expected:
        assert time.time() < deadline, f"CPUs not released: {ray.available_resources()}"
        time.sleep(0.2)


def test_an_input_a_node_does_not_see_is_one_line_naming_it(two_nodes, micro_spec_file, tmp_path, monkeypatch):
    """The simulated nodes share this machine's files, so the worker is made to miss one: its task answers that
    the path is not there."""
    from actors import driver

    head, worker = two_nodes
    spec = ray_spec(micro_spec_file)
    prompts = spec.data.train_prompts

    @ray.remote(num_cpus=0)
    def unseen_on_the_worker(paths: list[str]) -> list[str]:
        return [p for p in paths if p == prompts] if ray.get_runtime_context().get_node_id() == worker else []

    monkeypatch.setattr(driver, "_unseen", unseen_on_the_worker)
    with pytest.raises(OpdError) as refused:
        RayRun(spec, track=False)
    assert str(refused.value) == (f"data.train_prompts: {prompts} is not there on node {worker[:12]} (a relative path "
                                  "is resolved where `opd` runs; expected a path on storage every node mounts, or "
                                  "`ray job submit --working-dir .` to ship it)")
    wait_for_cpus(2.0)


def test_a_relative_run_dir_is_refused_on_two_nodes_in_one_line(two_nodes, micro_spec_file):
    with pytest.raises(OpdError) as refused:
        RayRun(ray_spec(micro_spec_file, "tracking.run_dir=runs/{name}"), track=False)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("tracking.run_dir: 'runs/{name}' is relative, but the Ray "
                                                      "cluster has 2 nodes")
    assert message.endswith("expected an absolute path on storage every node mounts (e.g. /mnt/runs/{name})")
    wait_for_cpus(2.0)  # the placement groups went with the refusal


def test_a_sqlite_store_the_learner_would_write_from_another_node_is_refused(two_nodes, micro_spec_file,
                                                                            monkeypatch):
    monkeypatch.delenv("OPD_TRACKING_URI", raising=False)
    with pytest.raises(OpdError, match=r"^tracking\.uri: the sqlite store \S+/mlflow\.db would be written from two "
                                       r"hosts \(this driver and the learner's node\); expected an MLflow server"):
        RayRun(ray_spec(micro_spec_file), track=True)
    wait_for_cpus(2.0)


def run_dir_seen(actor) -> tuple[str, str]:
    return ray.get(actor.__ray_call__.remote(lambda self: (str(self.spec.run_dir), self.spec.tracking_uri)))


def test_the_learner_uses_the_drivers_run_dir_and_the_control_actors_sit_on_its_node(two_nodes, micro_spec_file,
                                                                                    tmp_path):
    """Every actor is built from the one resolved spec; the learner is the one that writes into the run dir (the
    slow test below asks every role). The rollout and scorer actors are stopped at once to keep this fast."""
    head, worker = two_nodes
    target = load_spec(micro_spec_file, []).models.target_path
    spec = ray_spec(micro_spec_file, f"models.target_path={os.path.relpath(target)}")  # as typed from here
    with RunDirLock(spec.run_dir):  # as `opd train` holds it: the learner's node must see this very lock file
        run = RayRun(spec, track=False)
        try:
            for actor in [*run.scorers, *run.rollouts]:
                ray.kill(actor)
            # a relative input is resolved in the driver, which checked that every node sees it there
            assert ray.get(run.learner.__ray_call__.remote(lambda self: self.spec.models.target_path)) == target
            expected = (str(tmp_path / "runs" / "micro"), f"sqlite:///{tmp_path / 'runs' / 'micro' / 'mlflow.db'}")
            assert (str(run.spec.run_dir), run.spec.tracking_uri) == expected
            assert run_dir_seen(run.learner) == expected and node_of(run.learner) == worker
            control = {"weights": run.store, "ledger": run.ledger, "anchors": run.anchors.queue.actor,
                       "scored": run.scored.queue.actor}
            assert {name: node_of(actor) for name, actor in control.items()} == dict.fromkeys(control, head)
        finally:
            run.shutdown()
    wait_for_cpus(2.0)


def test_waiting_for_weights_or_work_blocks_until_the_change(two_nodes, micro_spec_file):
    """What a waiting rollout blocks on (actors/rollout.py `_claim`): woken by a publish, by a batch given back to
    the ledger, or by the stop; otherwise it times out. Each wake must come well before the timeout."""
    store, ledger = WeightStore.remote(), LedgerActor.remote(ray_spec(micro_spec_file).model_dump(mode="json"))
    ray.get([store.__ray_ready__.remote(), ledger.__ray_ready__.remote()])  # started: only the wait is timed

    def woken_after(ref, act) -> float:
        time.sleep(0.3)
        assert not ray.wait([ref], timeout=0)[0]  # still blocked
        t0 = time.perf_counter()
        act()
        assert ray.get(ref, timeout=30)
        return time.perf_counter() - t0

    assert woken_after(store.wait_newer.remote(-1, 20.0), lambda: store.publish.remote(0, [None], "")) < 5.0
    t0 = time.perf_counter()
    assert not ray.get(store.wait_newer.remote(0, 0.5)) and time.perf_counter() - t0 >= 0.5
    ray.get(ledger.begin.remote(0))
    worker = ray.get(ledger.register.remote("rollout-0"))
    # the ledger is an asyncio actor (a claim must not wait behind a blocked wait_claimable), which does not keep
    # the order of two calls in flight
    assert sorted(ray.get([ledger.claim.remote(worker, 0), ledger.claim.remote(worker, 0)])) == [Ticket(0, 0),
                                                                                             Ticket(1, 0)]
    # batch 2 needs version 1: blocked until batch 0 comes back stale and may be re-drafted at version 0
    assert woken_after(ledger.wait_claimable.remote(worker, 0, 20.0), lambda: ledger.stale.remote(Ticket(0, 0))) < 5.0
    assert woken_after(store.wait_newer.remote(0, 20.0), lambda: store.request_stop.remote()) < 5.0
    for actor in (store, ledger):
        ray.kill(actor)


@pytest.mark.slow
def test_a_two_node_run_checkpoints_into_the_drivers_run_dir_prunes_and_resumes(two_nodes, micro_spec_file,
                                                                               tmp_path):
    spec = ray_spec(micro_spec_file, "steps=3", "tracking.checkpoint_every=1", "tracking.keep_last=1")
    run_dir = tmp_path / "runs" / "micro"
    with RunDirLock(spec.run_dir):
        run = RayRun(spec, track=False)
        try:
            assert run.start() == 0
            for actor in [run.learner, *run.scorers, *run.rollouts]:  # the head has no CPUs
                assert run_dir_seen(actor) == (str(run_dir), f"sqlite:///{run_dir / 'mlflow.db'}")
                assert node_of(actor) == two_nodes[1]
            assert [r["step"] for r in run.train(2)] == [1, 2]
        finally:
            run.shutdown()
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-0000002"]
        resumed = RayRun(spec, track=False)
        try:
            assert resumed.start() == 2
            assert [r["checkpoint"] for r in resumed.train(3)] == [str(run_dir / "checkpoints" / "step-0000003")]
        finally:
            resumed.shutdown()
    # keep_last 1, but the checkpoint this run resumed from (step 2) is kept until the next resume
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-0000002", "step-0000003"]
