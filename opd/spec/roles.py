"""What a run asks of its cluster: the cluster it declares (`resources.cluster`), and each actor role's replicas
and the Ray resources every rank of one requests (`resources.rollout`, `scorer`, `learner`, `evaluator`). How
the ranks are bundled and whether they fit is `opd.spec.placement`."""

from __future__ import annotations

from typing import Annotated

from pydantic import Discriminator, Field, Tag, model_validator

from opd.formats.section import Section


class ClusterSpec(Section):
    """What the declared cluster offers; roles are checked against it so none waits forever for placement."""

    num_gpus: int = Field(0, ge=0)
    num_cpus: int | None = Field(None, ge=1, description="None = do not check CPUs")
    gpus_per_node: int | None = Field(None, ge=1, description=(
        "None = do not check that a sharded replica fits one node"))


class ReplicaRange(Section):
    """How many replicas of a role may run at once (rollout, scorer): the run starts with what fits, at least `min`,
    and starts more as room appears (a node joins, the autoscaler answers), up to `max`; a lost node's replicas go
    and come back when there is room again. opd/train/fleet.py decides, actors/driver.py carries it out."""

    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> ReplicaRange:
        if self.max < self.min:
            raise ValueError(f"max: {self.max} is below min {self.min} (expected max >= min)")
        return self


def _replicas_kind(value: object) -> str:
    return "range" if isinstance(value, dict | ReplicaRange) else "number"


# one branch is tried, so a bad value gets that branch's error alone (a number's, or the range's)
Replicas = Annotated[Annotated[Annotated[int, Field(ge=1)], Tag("number")] | Annotated[ReplicaRange, Tag("range")],
                     Discriminator(_replicas_kind)]


class RoleSpec(Section):
    """Replicas of one actor role and the Ray resources each replica requests."""

    replicas: Replicas = Field(1, description=(
        "A number, or for rollout and scorer a range {min, max} that grows and shrinks with the cluster"))
    num_gpus: float = Field(0, ge=0)
    num_cpus: float = Field(1, ge=0)
    gpus_per_replica: int = Field(1, ge=1, description=(
        "Ranks one replica spans (rollout, scorer, evaluator): the target is sharded over them by tensor (and, for "
        "MoE, expert) parallelism, one placement group packed on one node; each rank takes num_gpus and num_cpus "
        "(num_gpus 1 on GPUs; 0 on CPU, where the ranks are gloo processes). opd/models/sharding.py."))

    @property
    def least(self) -> int:
        """Replicas the run needs to start: the number, or the range's `min` (what must fit)."""
        return self.replicas.min if isinstance(self.replicas, ReplicaRange) else self.replicas

    @property
    def most(self) -> int:
        """Replicas the run starts when there is room: the number, or the range's `max`."""
        return self.replicas.max if isinstance(self.replicas, ReplicaRange) else self.replicas

    @property
    def ranks(self) -> int:
        """Processes the role needs to start: least replicas x gpus_per_replica."""
        return self.least * self.gpus_per_replica

    @property
    def bundle(self) -> dict[str, float]:
        """One rank's Ray placement bundle."""
        return {"CPU": self.num_cpus} | ({"GPU": self.num_gpus} if self.num_gpus else {})


class RestartsSpec(Section):
    """How a run heals itself (actors/driver.py, opd/train/restarts.py): a replica or the learner whose rank died
    or hung is torn down and started again in the same run, at most this often; past the bound the run stops with
    one line and a rerun resumes from the last checkpoint."""

    per_role: int = Field(3, ge=0, description=(
        "Restarts one role (rollout, scorer, evaluator, learner) may take in one run, all its replicas together; "
        "0 = a fault in that role stops the run"))
    per_run: int = Field(10, ge=0, description="Restarts of all roles together in one run")
    collective_timeout_s: float = Field(7200.0, gt=0, description=(
        "How long a rank waits in one collective (torch.distributed's timeout, which gloo and nccl honour) before "
        "it fails, naming the operation: a peer that stopped is then a fault, not a hang. Long on GPU clusters (a "
        "rank waits in a collective while rank 0 evaluates or checkpoints); seconds in tests"))
    placement_wait_s: float = Field(600.0, gt=0, description=(
        "How long a role with no replica running waits for room to place one (the learner after its node was lost, "
        "or the last rollout or scorer replica) before the run stops; a rerun resumes from the last checkpoint. "
        "Rollout and scorer replicas lost while others run wait for room as long as the run lasts"))
    stall_timeout_s: float = Field(600.0, gt=0, description=(
        "How long a rank may leave the driver's liveness check unanswered (every rank answers in a thread of its "
        "own while it computes) before it is treated as hung and its replica or the learner restarted"))
