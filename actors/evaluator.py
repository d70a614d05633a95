"""EvaluatorActor: owns an `Evaluator` (target + drafter copy, opd/train/evaluator.py) and decodes the held-out
prompts with the snapshots the learner hands it, so no learner step waits for an evaluation.

The learner reaches it through `ActorEvaluations` (non-blocking submits, results collected between steps).
`opd run`'s before/after evaluation and its suite table run in the same actor class (`evaluate_in_actor`,
`suite_in_actor`, actors/driver.py), on the cluster's GPUs rather than in the driver process, which on a cluster
is usually a CPU pod. Its resources are
`resources.evaluator` (with `resources.evaluate_on: rollout`, a rollout replica's: in training rollout-0 then
evaluates, actors/rollout.py); when that reserves anything it gets a placement group of its own, so a cluster that cannot
hold it is one error line instead of an evaluation that never starts; one that reserves nothing (the tiny CPU
runs) lives on the driver's node, so no worker node's loss takes it along. With `gpus_per_replica` N > 1 the group
holds N ranks packed on one node: this actor is rank 0, the others `ShardFollower`s that run its calls over their
shards of the target (actors/replica.py).
"""

from __future__ import annotations

import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from actors.isolated import allow_vllm_workers
from actors.remote import as_actor_class
from actors.replica import ShardFollower, SpmdEvaluator, bundle_address, evaluator, join
from opd.errors import OpdError
from opd.eval.row import EvalRow
from opd.eval.suite import SuiteResult
from opd.spec import ExperimentSpec, RoleSpec
from opd.train.evaluator import Checkpoint, EvalResult
from opd.train.messages import WeightSnapshot

NAME = "evaluator"


@ray.remote
class EvaluatorActor:
    def __init__(self, spec: dict, shard: tuple[str, int] | None = None, followers: list | None = None) -> None:
        """`shard`: (group address, ranks) when this is rank 0 of a sharded evaluator whose other ranks are
        `followers`."""
        parsed = ExperimentSpec.model_validate(spec)
        allow_vllm_workers()  # a vLLM suite sampler starts its worker from this actor
        self.evaluator = SpmdEvaluator(evaluator(parsed, join(parsed, shard)), followers or [])

    def ready(self) -> None:
        """Answers once the constructor has finished, and then while it evaluates: the driver's liveness call."""

    def evaluate(self, snapshot: WeightSnapshot) -> EvalResult:
        return self.evaluator(snapshot)

    def checkpoints(self, drafters: list[Checkpoint]) -> list[list[EvalRow]]:
        return self.evaluator.checkpoints(drafters)

    def draw_samples(self, path: str) -> None:
        self.evaluator.draw_samples(path)

    def suite(self, drafters: dict[str, str], out: str) -> SuiteResult:
        return self.evaluator.suite(drafters, out)


class ActorEvaluations:
    """`Evaluations` over the evaluator actor named `name`: a submit sends the snapshot and returns; results are
    taken in submission order as they finish (the actor evaluates one at a time). An evaluator that dies is
    started again by the driver under the same name: the snapshots it had not evaluated are then sent to the new
    one, so no evaluation is lost and no learner step waits for the restart."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending: list[tuple[WeightSnapshot, ray.ObjectRef | None]] = []  # oldest first; None: to resend

    def submit(self, snapshot: WeightSnapshot) -> None:
        self.pending.append((snapshot, None))
        self._send()

    def finished(self, wait: bool = False) -> list[EvalResult]:
        done = []
        while self.pending:
            if not self._send():
                if not wait:
                    break
                time.sleep(1.0)  # the driver is starting the evaluator again
                continue
            ref = self.pending[0][1]
            if not (wait or ray.wait([ref], timeout=0)[0]):
                break
            try:
                done.append(ray.get(ref))
            except ray.exceptions.RayActorError:  # it died: resend to its replacement
                self.pending = [(snapshot, None) for snapshot, _ in self.pending]
                continue
            self.pending.pop(0)
        return done

    def _send(self) -> bool:
        """Send what is not sent, to the evaluator alive under `name`; False while there is none."""
        if all(ref is not None for _, ref in self.pending):
            return True
        try:
            actor = ray.get_actor(self.name)
        except ValueError:
            return False
        self.pending = [(s, actor.evaluate.remote(s) if ref is None else ref) for s, ref in self.pending]
        return True


def start_ranks(spec: dict, role: RoleSpec, name: str, group) -> list:
    """The evaluator actor (rank 0) and, when it is sharded, its other ranks, on `group`'s bundles (None: anywhere;
    it reserves nothing)."""
    n = role.gpus_per_replica
    shard = (bundle_address(group), n) if n > 1 else None
    followers = [as_actor_class(ShardFollower).options(**_options(role, group, f"{name}-rank{j}", j)).remote(
        spec, "evaluator", shard[0], j, n) for j in range(1, n)] if shard else []
    leader = as_actor_class(EvaluatorActor).options(**_options(role, group, name)).remote(spec, shard, followers)
    return [leader, *followers]


def _options(role: RoleSpec, group, name: str, bundle: int = 0) -> dict:
    """One rank's actor options; a second thread answers the driver's liveness call while it evaluates. One that
    reserves nothing (no group) lives on the driver's node, as the control actors do, so no worker node's loss
    takes it (Ray's soft affinity places a zero-CPU actor elsewhere when that node has no CPUs, as a head has)."""
    strategy = (NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False) if group is None
                else PlacementGroupSchedulingStrategy(group, bundle))
    return {"name": name, "num_cpus": role.num_cpus, "num_gpus": role.num_gpus, "max_concurrency": 2,
            "scheduling_strategy": strategy}


class EvaluatorPlacement:
    """The evaluator's placement for `opd run`'s before/after table and suite (outside training, where the driver
    places it as a replica): a group of `gpus_per_replica` bundles packed on one node when its role
    (`ResourcesSpec.evaluator_role`) reserves anything (a sharded one always does: the spec says so), and the ranks
    past 0 that `start` puts there."""

    def __init__(self, spec: ExperimentSpec, timeout_s: float = 60.0) -> None:
        role = spec.resources.evaluator_role
        bundle = {k: v for k, v in (("CPU", role.num_cpus), ("GPU", role.num_gpus)) if v}
        self.role = role
        self.followers: list = []
        self.group = placement_group([bundle] * role.gpus_per_replica, strategy="STRICT_PACK",
                                     name="opd-evaluator") if bundle else None
        if self.group is not None and not ray.wait([self.group.ready()], timeout=timeout_s)[0]:
            self.remove()
            field = "rollout" if spec.resources.evaluate_on == "rollout" else "evaluator"
            raise OpdError(f"resources.{field}: the cluster cannot place the evaluator ({role.gpus_per_replica} x "
                           f"{bundle}) within {timeout_s:.0f}s (available: {ray.available_resources()}); lower its "
                           "GPUs/CPUs")

    def start(self, spec: dict, name: str = NAME):
        """The evaluator actor (rank 0); its other ranks are kept to be removed with the group."""
        leader, *self.followers = start_ranks(spec, self.role, name, self.group)
        return leader

    def remove(self) -> None:
        for follower in self.followers:
            ray.kill(follower)
        self.followers = []
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
