"""What a run asks of its cluster: the cluster it declares (`resources.cluster`), and each actor role's replicas
and the Ray resources every rank of one requests (`resources.rollout`, `scorer`, `learner`, `evaluator`). How
the ranks are bundled and whether they fit is `opd.spec.placement`."""

from __future__ import annotations

from pydantic import Field

from opd.formats.section import Section


class ClusterSpec(Section):
    """What the declared cluster offers; roles are checked against it so none waits forever for placement."""

    num_gpus: int = Field(0, ge=0)
    num_cpus: int | None = Field(None, ge=1, description="None = do not check CPUs")
    gpus_per_node: int | None = Field(None, ge=1, description=(
        "None = do not check that a sharded replica fits one node"))


class RoleSpec(Section):
    """Replicas of one actor role and the Ray resources each replica requests."""

    replicas: int = Field(1, ge=1)
    num_gpus: float = Field(0, ge=0)
    num_cpus: float = Field(1, ge=0)
    gpus_per_replica: int = Field(1, ge=1, description=(
        "Ranks one replica spans (rollout, scorer, evaluator): the target is sharded over them by tensor (and, for "
        "MoE, expert) parallelism, one placement group packed on one node; each rank takes num_gpus and num_cpus "
        "(num_gpus 1 on GPUs; 0 on CPU, where the ranks are gloo processes). opd/models/sharding.py."))

    @property
    def ranks(self) -> int:
        """Processes the role runs: replicas x gpus_per_replica."""
        return self.replicas * self.gpus_per_replica

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
    stall_timeout_s: float = Field(600.0, gt=0, description=(
        "How long a rank may leave the driver's liveness check unanswered (every rank answers in a thread of its "
        "own while it computes) before it is treated as hung and its replica or the learner restarted"))
