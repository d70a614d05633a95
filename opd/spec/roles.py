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
