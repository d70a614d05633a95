"""Ray's single actors and the object store on one local Ray for the whole module: the bounded queue's backpressure
and its report of a batch whose producer died, placement groups from the spec, the supervisor's view of a
replica's ranks, and zero-copy transfers. Apart from tests/test_ray.py (whole runs) so that `make test`'s two workers
(pytest-xdist, a module per worker) take them side by side, each with its own local Ray."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch
import yaml

from actors.driver import RayRun
from actors.queues import BatchQueue, Lost
from actors.supervisor import Replica
from opd.distill.scored_batch import ScoredBatch
from opd.errors import OpdError
from opd.spec import ExperimentSpec
from opd.train.fleet import Fleet, placement
from opd.train.messages import WeightSnapshot
from opd.train.ticket import Ticket
from tests.helpers.ray_runs import ray_cluster, wait_for  # noqa: F401 (ray_cluster is a fixture)
from tests.helpers.toy_rank import ToyRank


@ray.remote
class _Producer:
    def put(self, queue: BatchQueue, item, ticket: Ticket) -> None:
        queue.put(item, ticket)

    def own(self) -> list:
        """A reference this actor owns, wrapped so that Ray hands over the reference, not the value."""
        return [ray.put(torch.zeros(10))]


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
    """Every replica asks for a group of its own, as opd/train/fleet.py sizes it (no actor is started here); a
    layout Ray cannot hold is one line naming what was placed, and gives back the groups it took."""
    layout = {"resources": {"cluster": {"num_gpus": 4, "num_cpus": 2}, "evaluate_on": "rollout",
                            "rollout": {"replicas": 2, "num_gpus": 1, "num_cpus": 0.25},
                            "scorer": {"replicas": 1, "num_gpus": 1, "num_cpus": 0.25},
                            "learner": {"replicas": 1, "num_gpus": 1, "num_cpus": 0.25},
                            "evaluator": {"num_gpus": 0, "num_cpus": 0}},
              "tracking": {"run_dir": str(tmp_path / "run")}}
    base = yaml.safe_load(micro_spec_file.read_text())
    spec = ExperimentSpec.model_validate({**base, **layout})
    fleet = Fleet.of(spec, evaluator=False)
    replicas = [Replica(m.role, [m.name], lambda group: [], placement(spec, m.role, fleet.of_role(m.role).index(m)))
                for m in fleet.members]
    try:
        for replica in replicas:
            replica.request()
        assert all(replica.placed(timeout_s=30) for replica in replicas)
        groups = {r.name: ray.util.placement_group_table(r.group)["bundles"] for r in replicas}
        assert {name: [b["GPU"] for b in bundles.values()] for name, bundles in groups.items()} == {
            "learner": [1.0], "rollout-0": [1.0], "rollout-1": [1.0], "scorer-0": [1.0]}
    finally:
        for replica in replicas:
            replica.release()
    layout["resources"]["cluster"]["num_gpus"] = 8  # the spec believes in 8 GPUs; Ray has 4
    layout["resources"]["rollout"]["replicas"] = 5
    with pytest.raises(OpdError, match=r"cannot place the roles within 2s \(placed: (scorer 0 of 1, )?rollout [23] of 5;"):
        RayRun(ExperimentSpec.model_validate({**base, **layout}), track=False, place_timeout_s=2)
    wait_for(lambda: ray.available_resources().get("GPU") == 4.0, timeout=30)


def _replica() -> Replica:
    names = ["toy-0", "toy-0-rank1"]
    replica = Replica("scorer", names, lambda group: [ToyRank.options(name=n).remote() for n in names], ping_s=0.2,
                      probe_s=1.0)
    replica.start()
    replica.ready()
    return replica


def test_a_dead_or_silent_rank_is_a_fault_naming_it_and_the_replica_restarts_under_the_same_names(ray_cluster):
    """The supervisor's liveness calls find a killed rank (dead) and a stopped one (no answer past the stall
    timeout); the replica's ranks are then killed, stopped one included, and started again under their names."""
    replica = _replica()
    stopped = None
    try:
        wait_for(lambda: replica.check(60.0) is None and all(p.answered for p in replica.pings))
        old = replica.ranks[1]
        ray.kill(old)
        fault = wait_for(lambda: replica.check(60.0))
        assert (fault.role, fault.replica, fault.rank) == ("scorer", "toy-0", 1) and "ActorDiedError" in fault.cause
        replica.kill()
        replica.start()
        replica.ready()
        assert ray.get_actor("toy-0-rank1") == replica.ranks[1] != old
        wait_for(lambda: replica.check(60.0) is None and all(p.answered for p in replica.pings))
        stopped = ray.get(replica.ranks[1].pid.remote())
        os.kill(stopped, signal.SIGSTOP)
        fault = wait_for(lambda: replica.check(2.0), timeout=60)
        assert fault.rank == 1 and fault.cause.startswith("no answer for") and "stall_timeout_s: 2" in fault.cause
        assert replica.culprit("RuntimeError: Timed out waiting 15000ms for recv").rank == 1
        replica.kill()  # a stopped process too
        assert wait_for(lambda: not _alive(stopped), timeout=30)
    finally:
        if stopped is not None and _alive(stopped):
            os.kill(stopped, signal.SIGKILL)
        for rank in replica.ranks:
            ray.kill(rank)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a killed child not yet reaped by Ray is a zombie
        return stat.read().split()[2] != "Z"


def test_bad_input_stops_the_run_and_any_other_loop_error_is_a_fault_to_restart(ray_cluster):
    replica = _replica()
    try:
        bad = ray.exceptions.RayTaskError("run", "Traceback ...", OpdError("data.prompts: no such file"))
        with pytest.raises(OpdError, match=r"^data.prompts: no such file$"):
            RayRun._fault(replica, bad, "rollout-0")
        bug = ray.exceptions.RayTaskError("run", "Traceback ...", RuntimeError("Connection closed by peer"))
        assert RayRun._fault(replica, bug, "toy-0").line == "toy-0 rank 0 failed (RuntimeError: Connection closed by peer)"
    finally:
        for rank in replica.ranks:
            ray.kill(rank)


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
