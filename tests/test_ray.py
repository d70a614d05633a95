"""The Ray actor system against the single-process reference, on one local Ray for the whole module."""

from __future__ import annotations

import json
import time

import mlflow
import pytest
import ray
import torch
import yaml

from actors.driver import RayRun, place, relaunch, run_ray
from actors.queues import BatchQueue, Lost
from opd.cli import main
from opd.distill.replay import ScoredBatch
from opd.errors import OpdError
from opd.models.flops import FlopCounter
from opd.spec import ExperimentSpec, load_spec
from opd.train.ledger import fault_line, reconciles
from opd.train.local import LocalTrainer
from opd.train.messages import AnchorBatch, ScoredItem, Ticket, WeightSnapshot


@pytest.fixture(scope="module")
def ray_cluster():
    if ray.is_initialized():  # a Ray an earlier module's `opd run` left up in this process (make test-all)
        ray.shutdown()
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def ray_spec(micro_spec_file, tmp_path, *sets: str, **overrides) -> ExperimentSpec:
    base = ["engine=ray", "resources.max_policy_lag=0", "resources.queue_size=1", "eval.every=0",
            f"tracking.run_dir={tmp_path / 'ray' / '{name}'}", "tracking.checkpoint_every=1"]
    return load_spec(micro_spec_file, base + list(sets) + [f"{k}={v}" for k, v in overrides.items()])


def local_losses(micro_spec_file, tmp_path, steps: int) -> list[float]:
    spec = load_spec(micro_spec_file, [f"steps={steps}", "eval.every=0", f"tracking.run_dir={tmp_path / 'local'}"])
    return LocalTrainer(spec, track=False).run().losses


def account(run: RayRun) -> dict[str, int]:
    return ray.get(run.ledger.account.remote())


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


@ray.remote
def _produce(queue: BatchQueue, n: int) -> float:
    return sum(queue.put({"payload": torch.full((1000,), float(i))}, Ticket(i, 0)) for i in range(n))


def test_full_queue_blocks_the_producer_and_loses_nothing(ray_cluster):
    queue = BatchQueue("test-backpressure", maxsize=2)
    try:
        producer = _produce.remote(queue, 6)
        wait_for(lambda: queue.depth() == 2)
        time.sleep(1.0)
        assert queue.depth() == 2 and not ray.wait([producer], timeout=0)[0]  # blocked, not dropping
        got = [queue.get()[1]["payload"][0].item() for _ in range(6)]
        assert got == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert ray.get(producer) > 0.5  # it really waited
    finally:
        queue.shutdown()


def test_placement_follows_the_spec_and_refuses_the_impossible(ray_cluster, micro_spec_file, tmp_path):
    layout = {"resources": {"cluster": {"num_gpus": 5, "num_cpus": 2},  # the evaluator has a placement of its own
                            "rollout": {"replicas": 2, "num_gpus": 1, "num_cpus": 0.25},
                            "scorer": {"replicas": 1, "num_gpus": 1, "num_cpus": 0.25},
                            "learner": {"replicas": 1, "num_gpus": 1, "num_cpus": 0.25},
                            "evaluator": {"num_gpus": 1, "num_cpus": 0}}}
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
        ray.kill(run.rollouts[0], no_restart=False)  # batches 2 (enqueued) and 3 die with it
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
        ray.kill(run.rollouts[0], no_restart=False)
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
    assert f"lost {ledger['lost']}, orphaned {ledger['orphaned']}, stale {ledger['stale']};" in lines[0]
    client = mlflow.MlflowClient(spec.tracking_uri)
    run_id = client.search_runs([client.get_experiment_by_name(spec.tracking.experiment).experiment_id])[0].info.run_id
    metrics = client.get_run(run_id).data.metrics
    assert {k: metrics[f"ledger_{k}"] for k in ledger} == ledger


@fails_if_a_batch_goes_missing
@recovery_run
def test_a_killed_scorer_restarts_and_the_run_continues_until_it_dies_for_good(ray_cluster, micro_spec_file,
                                                                               tmp_path):
    run = RayRun(ray_spec(micro_spec_file, tmp_path, "resources.max_policy_lag=1", steps=3), track=False)
    try:
        full_pipeline(run)
        ray.kill(run.scorers[0], no_restart=False)  # batches 0 (enqueued) and 1 die with it
        time.sleep(1.0)  # the kill lands before the learner reads batch 0
        assert_survived(run, run.train(3), steps=3, given_up=2)
        ray.kill(run.scorers[0], no_restart=True)  # as if out of restarts: step 5's batches can never be scored
        with pytest.raises(OpdError, match=r"^scorer-0 failed \(it died and was not restarted: [^\n]*\); run the "
                                           r"same command again to resume from the last checkpoint$"):
            run.train(5)
    finally:
        run.shutdown()


@ray.remote
class _Producer:
    def put(self, queue: BatchQueue, item, ticket: Ticket) -> None:
        queue.put(item, ticket)

    def own(self) -> list:
        """A reference this actor owns, wrapped so that Ray hands over the reference, not the value."""
        return [ray.put(torch.zeros(10))]

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


@ray.remote(max_restarts=1)
class _Looper:
    def ready(self) -> None:
        pass

    def run(self, needs=None) -> None:
        if needs is not None:
            ray.get(needs.ready.remote())
        time.sleep(60)


def test_only_a_restarted_actor_gets_its_loop_relaunched(ray_cluster):
    """A loop that raised (here: because an actor it calls is dead) would fail again: stop, do not relaunch."""
    looper, dead = _Looper.remote(), _Looper.remote()
    ray.kill(dead, no_restart=True)
    with pytest.raises(OpdError, match=r"^looper failed \(.*ActorDiedError.*; run the same command again"):
        relaunch(looper.run.remote(dead), "looper", looper)
    loop = looper.run.remote()
    ray.kill(looper, no_restart=False)
    loop = relaunch(loop, "looper", looper)  # restarted: a fresh loop
    assert not ray.wait([loop], timeout=1.0)[0]
    ray.kill(looper, no_restart=True)
    with pytest.raises(OpdError, match=r"^looper failed \(it died and was not restarted: "):
        relaunch(loop, "looper", looper)


@recovery_run
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


def test_a_batch_whose_producer_died_is_reported_lost_with_its_ticket(ray_cluster):
    queue = BatchQueue("test-lost", maxsize=4)
    producer = _Producer.remote()
    try:
        ray.get(producer.put.remote(queue, {"payload": torch.ones(10)}, Ticket(7, 2)))
        probe = ray.get(producer.own.remote())  # another object the producer owns, fetched without dequeuing
        ray.kill(producer, no_restart=True)
        # Under load the kill, and then the owner's death reaching this process, can each take seconds: wait until
        # the probe is lost as the batch will be, rather than for a fixed time.
        wait_for(lambda: _owner_gone(probe[0]))
        with pytest.raises(Lost) as lost:
            queue.get()
        assert lost.value.ticket == Ticket(7, 2)  # never silently dropped: the consumer learns what to re-produce
    finally:
        queue.shutdown()


def _owner_gone(ref) -> bool:
    try:
        ray.get(ref, timeout=1.0)
    except (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError):
        return True
    except ray.exceptions.GetTimeoutError:
        pass
    return False


@ray.remote
class _Reader:
    def read(self, wrapped: list) -> dict:
        """In another worker: what arrived, and whether two gets map the same object-store memory (zero-copy)
        rather than each unpickling a fresh copy."""
        def tensors(value) -> list:
            return list(value.state.values()) if hasattr(value, "state") else list(vars(value).values())
        first, second = ray.get(wrapped[0]), ray.get(wrapped[0])
        return {"value": first, "zero_copy": all(a.data_ptr() == b.data_ptr()
                                                 for a, b in zip(tensors(first), tensors(second)))}


def test_scored_batches_and_weights_cross_the_object_store_zero_copy(ray_cluster):
    gen = torch.Generator().manual_seed(0)  # over Ray's 100 KB inline limit, so the objects live in the store
    batch = ScoredBatch(features=torch.randn(2, 300, 256, generator=gen).bfloat16(),
                        context_valid=torch.ones(2, 300, dtype=torch.bool), context_ids=torch.zeros(2, 300, dtype=torch.long),
                        block_ids=torch.arange(18).view(2, 3, 3),
                        anchor_positions=torch.arange(6).view(2, 3), block_valid=torch.ones(2, 3, dtype=torch.bool),
                        accepted=torch.arange(6), position_mask=torch.ones(6, 3, dtype=torch.bool),
                        teacher=torch.randn(6, 3, 4, generator=gen).bfloat16())
    snapshot = WeightSnapshot.of({"w": torch.randn(500, 400, generator=gen).bfloat16(), "b": torch.zeros(4)}, 3)
    reader = _Reader.remote()
    for sent in (batch, snapshot):
        got = ray.get(reader.read.remote([ray.put(sent)]))
        assert got["zero_copy"]  # mapped from the object store, not unpickled into fresh torch storage
        pairs = (zip(vars(sent).values(), vars(got["value"]).values()) if sent is batch else
                 ((sent.state[k], got["value"].state[k]) for k in sent.state))
        for a, b in pairs:
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert got["value"].verified(3).checksum == snapshot.checksum
