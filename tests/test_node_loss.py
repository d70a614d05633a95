"""A run that outlives its nodes and grows with the cluster (issue 70), on a Ray cluster of several nodes on this
machine (`ray.cluster_utils.Cluster`): a CPU-less head where this driver and the control actors live, and worker
nodes of 2 CPUs. A node is removed without a graceful stop (`remove_node(node, allow_graceful=False)`), as a node
that dies; nodes are added mid-run, as an autoscaler or a user adds them.

Every role takes a whole worker node (2 CPUs), so which node holds what is known: the tests kill the node of one
role and look where it comes back. The bound is the one tests/test_ray_heal.py holds a healed run to: at
`max_policy_lag` 0 batch i holds the same prompts and seeds whoever produces it, so the drafter must equal the
uninterrupted single-process run's within `BOUND`, every batch index is trained once and the ledger reconciles.
opd/train/fleet.py's decisions are tested without Ray in tests/test_fleet.py; these are whole runs on a loaded
2-core machine, so they are `slow` (make test-all).
"""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import ray
from mlflow import MlflowClient
from ray.cluster_utils import Cluster

from actors.driver import RayRun
from opd.train.ledger import reconciles
from tests.helpers.ray_runs import BOUND, STEPS, account, local_drafter, ray_spec, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
WHOLE_NODES = ["resources.cluster.num_cpus=null", "resources.learner.num_cpus=2", "resources.scorer.num_cpus=2",
               "resources.rollout.num_cpus=2", "resources.evaluator.num_cpus=0",
               "resources.restarts.placement_wait_s=120"]
# a node that stops answering is declared dead in seconds, not Ray's default half minute
FAST_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4, "health_check_timeout_ms": 500}


@pytest.fixture
def cluster():
    """A CPU-less head (this driver) with no worker yet; each test adds the nodes it needs."""
    if ray.is_initialized():
        ray.shutdown()
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                         "_system_config": FAST_DEATH})
    ray.init(address=made.address, configure_logging=False, log_to_driver=False)
    try:
        yield made
    finally:
        ray.shutdown()
        made.shutdown()


@pytest.fixture
def mlflow_server(tmp_path):
    """A real MLflow server on loopback: a run of several nodes refuses a sqlite store, so a tracked one logs here."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                               "--default-artifact-root", str(tmp_path / "artifacts"), "--workers", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(uri), timeout=120)
        yield uri
    finally:
        server.terminate()
        server.wait(timeout=30)


def _answers(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def add_nodes(cluster: Cluster, n: int) -> list:
    nodes = [cluster.add_node(num_cpus=2) for _ in range(n)]
    cluster.wait_for_nodes()
    return nodes


def node_of(run: RayRun, name: str) -> str:
    replica = run.learners if name == "learner" else next(r for r in run.replicas if r.name == name)
    return next(iter(replica.nodes()))


def kill_node(cluster: Cluster, node_id: str) -> None:
    node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    cluster.remove_node(node, allow_graceful=False)


def assert_intact(run: RayRun, reports: list[dict], local: dict, steps: int = STEPS) -> None:
    """Every step reported once, every batch trained exactly once, the account reconciles, and the drafter is the
    uninterrupted run's."""
    assert [r["step"] for r in reports] == list(range(1, steps + 1))
    ledger = account(run)
    assert ray.get(run.ledger.trained_indices.remote()) == list(range(2 * steps))
    assert ledger["trained"] == 2 * steps and ledger["duplicates"] == 0 and reconciles(ledger), ledger
    _, state = ray.get(run.learner.draft_state.remote())
    for k, v in local.items():
        assert (v - state[k]).abs().max().item() <= BOUND, k


def lose_and_finish(cluster: Cluster, spec, role: str) -> tuple[RayRun, list[dict], str]:
    """Train a step, kill the node of `role` (a replica name or the learner), train to the end; the run, its
    reports and the node that was lost."""
    run = RayRun(spec, track=False)
    run.start()
    reports = run.train(1)
    lost = node_of(run, role)
    kill_node(cluster, lost)
    reports += run.train(STEPS)
    return run, reports, lost


@pytest.mark.parametrize("role", ["rollout-0", "scorer-0", "learner"])
def test_the_node_of_a_role_is_lost_with_room_elsewhere_and_the_run_finishes_intact(cluster, micro_spec_file,
                                                                                    tmp_path, role):
    """Learner, scorer and rollout each on a node of their own and one spare: the lost role is placed again on
    the spare and the run ends as if nothing happened (the learner from its last checkpoint)."""
    local = local_drafter(micro_spec_file, tmp_path)
    add_nodes(cluster, 4)
    run, reports, lost = lose_and_finish(cluster, ray_spec(micro_spec_file, tmp_path, *WHOLE_NODES, steps=STEPS),
                                         role)
    try:
        assert_intact(run, reports, local)
        assert node_of(run, role) != lost
        restarts = [r for r in run.budget.restarts if r.fault.replica == role]
        assert restarts and all(r.node_lost for r in restarts), run.budget.log()
        assert run.fleet.counts() == {"learner": 1, "scorer": 1, "rollout": 1, "evaluator": 1}
    finally:
        run.shutdown()


def test_without_room_the_run_goes_on_with_fewer_rollout_replicas_until_a_node_joins(cluster, micro_spec_file,
                                                                                     tmp_path, capfd):
    local = local_drafter(micro_spec_file, tmp_path, steps=6)
    add_nodes(cluster, 4)  # learner, scorer, rollout-0, rollout-1: no room to spare
    spec = ray_spec(micro_spec_file, tmp_path, *WHOLE_NODES, "resources.rollout.replicas=2", steps=6)
    run = RayRun(spec, track=False)
    try:
        run.start()
        reports = run.train(1)
        kill_node(cluster, node_of(run, "rollout-1"))
        reports += run.train(3)  # trained on by rollout-0 alone
        assert run.fleet.counts()["rollout"] == 1 and run.fleet.member("rollout-1").state == "waiting"
        assert "rollout-1 was lost with its node; it starts again where there is room, meanwhile 1 of 2 rollout " \
               "replicas run" in capfd.readouterr().err
        add_nodes(cluster, 1)
        reports += run.train(6)
        wait_for(lambda: run._supervise() is None and run.fleet.counts()["rollout"] == 2, timeout=120)
        assert "rollout-1 is running (2 of 2 rollout replicas run)" in capfd.readouterr().err
        assert_intact(run, reports, local, steps=6)
    finally:
        run.shutdown()


def test_rollout_grows_from_min_to_max_as_nodes_join(cluster, micro_spec_file, tmp_path, mlflow_server):
    """rollout {min: 1, max: 3} on a cluster with room for one replica starts with one; two nodes join mid-run and
    the run starts a replica on each. Tracked on an MLflow server: the replica count is logged at every step, 1
    before the nodes join and 3 once the new replicas run."""
    steps = 8
    local = local_drafter(micro_spec_file, tmp_path, steps=steps)
    add_nodes(cluster, 3)  # learner, scorer, one rollout replica
    spec = ray_spec(micro_spec_file, tmp_path, *WHOLE_NODES, "resources.rollout.replicas={min: 1, max: 3}",
                    f"tracking.uri={mlflow_server}", steps=steps)
    run = RayRun(spec, track=True)
    try:
        run.start()
        assert run.fleet.counts()["rollout"] == 1
        reports = run.train(1) + run.train(2)  # a step at a time, as `opd run` advances: counts logged at each
        add_nodes(cluster, 2)
        started = time.monotonic()
        for step in range(3, 7):
            reports += run.train(step)
        wait_for(lambda: run._supervise() is None and run.fleet.counts()["rollout"] == 3, timeout=120)
        assert time.monotonic() - started < 300
        assert len({node_of(run, f"rollout-{i}") for i in range(3)}) == 3
        reports += run.train(7) + run.train(8)
        assert_intact(run, reports, local, steps=steps)
        history = MlflowClient(tracking_uri=mlflow_server).get_metric_history(run.run_id, "replicas_rollout")
        counts = [m.value for m in sorted(history, key=lambda m: m.step)]
        assert counts[:2] == [1.0, 1.0] and counts[-2:] == [3.0, 3.0] and counts == sorted(counts), counts
    finally:
        run.shutdown()


def test_soak_random_node_losses_and_joins(cluster, micro_spec_file, tmp_path):
    """Every two steps a random worker node goes (whichever roles it holds, the learner's included) and a fresh
    one joins: the run reaches its budget intact, with every loss logged as a node loss."""
    steps = 8
    local = local_drafter(micro_spec_file, tmp_path, steps=steps)
    add_nodes(cluster, 5)  # learner, scorer, two rollout replicas, one spare
    rng = random.Random(70)
    spec = ray_spec(micro_spec_file, tmp_path, *WHOLE_NODES, "resources.rollout.replicas={min: 1, max: 2}",
                    steps=steps)
    run = RayRun(spec, track=False)
    try:
        run.start()
        reports: list[dict] = []
        for at in range(2, steps + 1, 2):
            reports += run.train(at - 1)
            if at < steps:
                victim = rng.choice([n for n in cluster.worker_nodes if n.node_id in alive()])
                cluster.remove_node(victim, allow_graceful=False)
                add_nodes(cluster, 1)
            reports += run.train(at)
        assert_intact(run, reports, local, steps=steps)
        assert run.budget.restarts and all(r.node_lost for r in run.budget.restarts), run.budget.log()
    finally:
        run.shutdown()


def alive() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}
