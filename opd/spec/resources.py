"""The resources section: where each actor role runs, what the cluster offers, and the asynchronous pipeline's
bounds. The placement arithmetic it is checked with is `opd.spec.placement`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from opd.formats.section import Section, spec_issues
from opd.spec.placement import (
    amount,
    as_placed,
    colocated_ranks_that_cannot_pair,
    gpu_fractions_ray_cannot_place,
    learner_group_bundles,
    ranks_that_cannot_pack,
    roles_that_do_not_fit,
)
from opd.spec.roles import ClusterSpec, ReplicaRange, RestartsSpec, RoleSpec

_ROLES = ("rollout", "scorer", "learner", "evaluator")


class ResourcesSpec(Section):
    """Actor placement and the asynchronous pipeline's bounds.

    `evaluator` is the one actor (a target and a drafter copy, like a rollout replica) that decodes the held-out
    prompts on published weights, off the learner's critical path. It is a role of its own because it must not
    take a rollout replica's or the scorer's GPU from under them, and its resources are fit-checked like the
    others'. By default it reserves nothing and time-shares the machine (the tiny CPU runs); on a GPU cluster whose
    rollout decodes on GPUs it must have one (the Qwen3 configs give it a whole GPU)."""

    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    rollout: RoleSpec = Field(default_factory=RoleSpec)
    scorer: RoleSpec = Field(default_factory=RoleSpec)
    learner: RoleSpec = Field(default_factory=RoleSpec)
    evaluator: RoleSpec = Field(default_factory=lambda: RoleSpec(num_cpus=0))
    restarts: RestartsSpec = Field(default_factory=RestartsSpec)
    vllm_python: str = Field("/opt/vllm/bin/python", description=(
        "The vLLM environment's interpreter. vLLM pins a torch and transformers of its own, so everything that "
        "uses it (rollout.sampler vllm, opd gen-samples --engine vllm, opd serve-bench) runs in a Ray actor started "
        "with this interpreter, and only token ids, settings and counts cross. The default is where "
        "cluster/Dockerfile builds it from cluster/vllm.lock; elsewhere, `make vllm-env VLLM_ENV=DIR` and DIR/bin/python."))
    queue_size: int = Field(4, ge=1, description="bounded queues: producers block, nothing is dropped")
    max_policy_lag: int = Field(1, ge=0, description=(
        "In optimizer updates: update s trains only on rollout batches drafted with weights of version >= s - lag, "
        "every one of its batches_per_step batches alike (older ones are counted and discarded). 0 is the authors' "
        "synchronous trainer: all batches of an update come from the weights of the update before."))
    broadcast_every: int = Field(1, ge=1, description="learner steps between weight publications")
    evaluate_on: Literal["evaluator", "rollout"] = Field("evaluator", description=(
        "evaluator: the evaluator role's own actor and target decode the held-out prompts. rollout: rollout replica "
        "0 decodes them between its rollout batches, on its own target with a drafter copy of its own, and "
        "`opd run`'s before/after evaluation takes the rollout's resources: for a target whose copy takes a whole "
        "node, a third copy only to evaluate would take a third node. resources.evaluator then reserves nothing."))
    colocate_learner: bool = Field(False, description=(
        "Learner rank i shares scorer rank i's GPU: each scorer rank's placement bundle is one whole GPU, of which "
        "the scorer rank takes scorer.num_gpus and learner rank i (if there are that many) learner.num_gpus, which "
        "must sum to 1. So a scorer that needs all of the learner's node still has the learner beside it. Whether "
        "both fit one GPU's memory is for bench/sharded_layout.py to project: with optim.backend deepspeed and ZeRO "
        "the learner's optimizer state splits over its ranks."))

    @property
    def evaluator_role(self) -> RoleSpec:
        """What an evaluator actor takes: `evaluator`, or with `evaluate_on: rollout` (where training has no evaluator
        actor; rollout-0 evaluates) one rollout replica's resources, idle before and after the run."""
        return self.rollout.model_copy(update={"replicas": 1}) if self.evaluate_on == "rollout" else self.evaluator

    def learner_bundles(self) -> list[dict[str, float]]:
        """The learner placement group's bundles: the learner ranks', then the scorer ranks' (`first_scorer_bundle`);
        with `colocate_learner` a learner rank and a scorer rank share each (`opd.spec.placement.learner_group_bundles`)."""
        return learner_group_bundles(self.learner, self.scorer, self.colocate_learner)

    @property
    def first_scorer_bundle(self) -> int:
        """The learner placement group's bundle of scorer rank 0."""
        return 0 if self.colocate_learner else self.learner.least

    @model_validator(mode="after")
    def _check(self) -> ResourcesSpec:
        roles = {name: getattr(self, name) for name in _ROLES}
        placed = as_placed(roles, self.colocate_learner)
        issues = gpu_fractions_ray_cannot_place(roles) + self._range_issues()
        if self.colocate_learner:
            issues += colocated_ranks_that_cannot_pair(self.learner, self.scorer)
        issues += ranks_that_cannot_pack(placed, self.cluster.gpus_per_node)
        issues += roles_that_do_not_fit(placed, "num_gpus", self.cluster.num_gpus)
        issues += self._evaluator_role_issues()
        if self.max_policy_lag < self.broadcast_every - 1:
            issues.append(f"max_policy_lag: {self.max_policy_lag} with broadcast_every {self.broadcast_every} would "
                          f"discard every batch between broadcasts (expected at least {self.broadcast_every - 1})")
        if self.cluster.num_cpus is not None:
            issues += roles_that_do_not_fit(roles, "num_cpus", self.cluster.num_cpus)
        spec_issues(issues)
        return self

    def _range_issues(self) -> list[str]:
        """Only rollout and scorer replicas come and go with the cluster: the learner's ranks restore a checkpoint
        written by as many, one actor evaluates, and a colocated scorer rank holds a learner rank's GPU."""
        fixed = {"learner": "the learner's ranks restore a checkpoint written by as many",
                 "evaluator": "one actor evaluates"}
        if self.colocate_learner:
            fixed["scorer"] = "with colocate_learner each scorer rank shares a learner rank's GPU"
        issues = []
        for name, why in fixed.items():
            if isinstance(span := getattr(self, name).replicas, ReplicaRange):
                issues.append(f"{name}.replicas: a range {{min: {span.min}, max: {span.max}}} (expected a number: "
                              f"{why})")
        return issues

    def _evaluator_role_issues(self) -> list[str]:
        """One actor evaluates: rollout replica 0 with `evaluate_on: rollout`, when the evaluator role runs nothing
        and what it reserved would never be used; else the evaluator role's own, on a GPU where the rollout decodes
        on GPUs."""
        evaluator = self.evaluator
        issues = [f"evaluator.replicas: {evaluator.replicas} (expected 1; one actor evaluates)"] * (
            isinstance(evaluator.replicas, int) and evaluator.replicas != 1)
        reserves = evaluator.num_gpus or evaluator.num_cpus or evaluator.gpus_per_replica != 1
        if self.evaluate_on == "rollout" and reserves:
            issues.append(f"evaluator: {amount(evaluator.num_gpus)} GPUs, {amount(evaluator.num_cpus)} CPUs, "
                          f"gpus_per_replica {evaluator.gpus_per_replica} with evaluate_on rollout (expected num_gpus 0, "
                          "num_cpus 0, gpus_per_replica 1: rollout replica 0 evaluates)")
        elif self.evaluate_on == "evaluator" and self.rollout.num_gpus and not evaluator.num_gpus:
            issues.append("evaluator.num_gpus: 0 while rollout decodes on GPUs, so held-out eval would decode on a "
                          f"CPU (expected a GPU, e.g. {amount(self.rollout.num_gpus)} like a rollout replica)")
        return issues
