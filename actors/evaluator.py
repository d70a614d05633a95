"""EvaluatorActor: owns an `Evaluator` (target + drafter copy, opd/train/evaluator.py) and decodes the held-out
prompts with the snapshots the learner hands it, so no learner step waits for an evaluation.

The learner reaches it through `ActorEvaluations` (non-blocking submits, results collected between steps).
`opd run`'s before/after evaluation and its suite table run in the same actor class (`evaluate_in_actor`,
`suite_in_actor`, actors/driver.py), on the cluster's GPUs rather than in the driver process, which on a cluster
is usually a CPU pod. Its resources are
`resources.evaluator`; when that reserves anything it gets a placement group of its own, so a cluster that cannot
hold it is one error line instead of an evaluation that never starts.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from opd.errors import OpdError
from opd.eval.row import EvalRow
from opd.eval.suite import SuiteResult
from opd.spec import ExperimentSpec
from opd.train.evaluator import Checkpoint, EvalResult, Evaluator
from opd.train.messages import WeightSnapshot

NAME = "evaluator"


@ray.remote
class EvaluatorActor:
    def __init__(self, spec: dict) -> None:
        self.evaluator = Evaluator(ExperimentSpec.model_validate(spec))

    def evaluate(self, snapshot: WeightSnapshot) -> EvalResult:
        return self.evaluator(snapshot)

    def checkpoints(self, drafters: list[Checkpoint]) -> list[list[EvalRow]]:
        return self.evaluator.checkpoints(drafters)

    def draw_samples(self, path: str) -> None:
        self.evaluator.draw_samples(path)

    def suite(self, drafters: dict[str, str], out: str) -> SuiteResult:
        return self.evaluator.suite(drafters, out)


class ActorEvaluations:
    """`Evaluations` over the evaluator actor: a submit sends the snapshot and returns; results are taken in
    submission order as they finish (the actor evaluates one at a time)."""

    def __init__(self, actor) -> None:
        self.actor, self.pending = actor, []

    def submit(self, snapshot: WeightSnapshot) -> None:
        self.pending.append(self.actor.evaluate.remote(snapshot))

    def finished(self, wait: bool = False) -> list[EvalResult]:
        done = []
        while self.pending and (wait or ray.wait(self.pending[:1], timeout=0)[0]):
            done.append(ray.get(self.pending.pop(0)))
        return done


class EvaluatorPlacement:
    """The evaluator actor's placement: a one-bundle group when `resources.evaluator` reserves anything."""

    def __init__(self, spec: ExperimentSpec, timeout_s: float = 60.0) -> None:
        role = spec.resources.evaluator
        bundle = {k: v for k, v in (("CPU", role.num_cpus), ("GPU", role.num_gpus)) if v}
        self.role, self.group = role, placement_group([bundle], name="opd-evaluator") if bundle else None
        if self.group is not None and not ray.wait([self.group.ready()], timeout=timeout_s)[0]:
            self.remove()
            raise OpdError(f"resources.evaluator: the cluster cannot place the evaluator ({bundle}) within "
                           f"{timeout_s:.0f}s (available: {ray.available_resources()}); lower its GPUs/CPUs")

    def options(self, name: str = NAME) -> dict:
        strategy = None if self.group is None else PlacementGroupSchedulingStrategy(self.group, 0)
        return {"name": name, "num_cpus": self.role.num_cpus, "num_gpus": self.role.num_gpus,
                "scheduling_strategy": strategy}

    def remove(self) -> None:
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
