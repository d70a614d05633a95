"""The driver's decisions about replicas, without Ray: which replicas each role has, where one is placed, and when
a lost one is started again.

A role's replicas are named slots, `rollout-0` .. `rollout-{max-1}` (`resources.<role>.replicas`, a number or a
range). Every slot asks for its own placement group from the start; one is *waiting* until Ray places its group (a
node with room joins, the autoscaler answers the pending group) and *running* from then until it is lost. So the
run starts with what fits, at least `min`, grows to `max` as room appears, and goes on with fewer when a node goes.

A lost replica comes back by one of two ways. A rank that died or hung on a node that is still there restarts in
the same group, on the same bundles. A replica with a rank on a node that is gone asks for a new group, which Ray
places wherever there is room, now or later; meanwhile the run goes on with the others. A role with no replica
running (the learner above all) waits at most `resources.restarts.placement_wait_s`; then the run stops with one
line, and a rerun resumes from the last checkpoint.

actors/driver.py carries these decisions out; this module is what a plain test reaches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from opd.spec import ExperimentSpec, RoleSpec
from opd.train.restarts import RESUME

State = Literal["waiting", "running"]
ROLES = ("learner", "scorer", "rollout", "evaluator")  # the order their groups are asked for: the learner's first


@dataclass(frozen=True)
class Placement:
    """Where one replica's ranks go: its placement group's bundles and strategy, and the node it prefers (a
    scorer's: the learner's, so the heavy scored batches rarely cross the network; Ray places it elsewhere when
    that node is full). `shared`: the replica has no group of its own, it takes bundles `first` .. of the learner's
    (a colocated scorer), or none at all (an evaluator that reserves nothing)."""

    bundles: tuple[tuple[tuple[str, float], ...], ...]
    strategy: str = "STRICT_PACK"
    near_learner: bool = False
    shared: bool = False
    first: int = 0

    @property
    def bundle_dicts(self) -> list[dict[str, float]]:
        return [dict(bundle) for bundle in self.bundles]


def placement(spec: ExperimentSpec, role: str, index: int = 0) -> Placement:
    """The placement of replica `index` of `role`. The learner's group packs its ranks (their gradients meet in
    every step) and, with `colocate_learner`, the scorer ranks that share their GPUs; every other replica has a
    group of its own, its ranks packed on one node (one torch.distributed group)."""
    r = spec.resources
    if role == "learner":
        return Placement(_frozen(r.learner_bundles() if r.colocate_learner else [r.learner.bundle] * r.learner.least))
    if role == "scorer" and r.colocate_learner:
        return Placement((), shared=True, first=r.first_scorer_bundle + index * r.scorer.gpus_per_replica)
    role_spec = placed_role(spec, role)
    bundle = {k: v for k, v in role_spec.bundle.items() if v}
    if not bundle:  # reserves nothing (the tiny evaluator): Ray places it anywhere, with no group
        return Placement((), shared=True)
    return Placement(_frozen([bundle] * role_spec.gpus_per_replica), near_learner=role == "scorer")


def _frozen(bundles: list[dict[str, float]]) -> tuple[tuple[tuple[str, float], ...], ...]:
    return tuple(tuple(sorted(bundle.items())) for bundle in bundles)


def placed_role(spec: ExperimentSpec, role: str) -> RoleSpec:
    """The role as Ray places it: the evaluator's as `ResourcesSpec.evaluator_role` says. A rollout replica whose
    sampler is vLLM is one bundle of all its GPUs, which its vLLM worker takes (it starts its own tensor-parallel
    ranks), so there is no rank of ours to follow it."""
    r = spec.resources
    if role == "evaluator":
        return r.evaluator_role
    if role != "rollout":
        return getattr(r, role)
    rollout = r.rollout
    if vllm_samples(spec) and rollout.gpus_per_replica > 1:
        n = rollout.gpus_per_replica
        return rollout.model_copy(update={"num_gpus": rollout.num_gpus * n, "num_cpus": rollout.num_cpus * n,
                                          "gpus_per_replica": 1})
    return rollout


def vllm_samples(spec: ExperimentSpec) -> bool:
    """Whether rollout replicas sample in a vLLM worker of their own, which takes their bundle's GPUs."""
    return spec.rollout.source == "target" and spec.rollout.sampler == "vllm"


@dataclass
class Member:
    """One replica slot: its role, its name (rank 0's actor name), whether it runs, since when, and the nodes its
    ranks were placed on."""

    role: str
    name: str
    state: State = "waiting"
    since: float = 0.0
    nodes: frozenset[str] = frozenset()
    lost_once: bool = False  # it ran and was lost: its return is worth a line


@dataclass
class Fleet:
    """Every replica slot of a run, with the bound on how long a role with none running may wait for room."""

    members: list[Member]
    least: dict[str, int]
    wait_s: float
    started_at: float = 0.0
    notes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, spec: ExperimentSpec, now: float = 0.0, *, evaluator: bool = True) -> Fleet:
        """The slots of `spec`'s roles (`evaluator`: whether the evaluator is an actor of its own)."""
        r = spec.resources
        counts = {"learner": (1, 1), "scorer": (r.scorer.least, r.scorer.most),
                  "rollout": (r.rollout.least, r.rollout.most)}
        if evaluator:
            counts["evaluator"] = (1, 1)
        members = [Member(role, role if role in ("learner", "evaluator") else f"{role}-{i}", since=now)
                   for role, (_, most) in counts.items() for i in range(most)]
        return cls(members, {role: least for role, (least, _) in counts.items()}, r.restarts.placement_wait_s,
                   started_at=now)

    def priority(self, name: str) -> tuple[bool, int]:
        """The order replicas ask for room: every role's first `min`, by `ROLES`, then the extras, which are only
        worth the room that is left."""
        member = self.member(name)
        return self.of_role(member.role).index(member) >= self.least[member.role], ROLES.index(member.role)

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def of_role(self, role: str) -> list[Member]:
        return [m for m in self.members if m.role == role]

    def running(self, role: str) -> int:
        return sum(m.state == "running" for m in self.of_role(role))

    def counts(self) -> dict[str, int]:
        """Replicas running per role (logged per step, shown on the dashboard)."""
        return {role: self.running(role) for role in self.least}

    def line(self) -> str:
        """The replicas running, for the progress line: `rollout 2/3 scorer 1/1` (roles that can vary)."""
        return " ".join(f"{role} {self.running(role)}/{len(self.of_role(role))}" for role in ("rollout", "scorer"))

    def short_at_start(self) -> str | None:
        """The roles that cannot start with their `min`, as the refusal's text, or None."""
        short = [f"{role} {self.running(role)} of {least}" for role, least in self.least.items()
                 if self.running(role) < least]
        return ", ".join(short) or None

    def placed(self, name: str, nodes: frozenset[str], now: float) -> str | None:
        """Its group is placed and its ranks start: a line when it is back after a loss, or a replica beyond the
        ones the run started with."""
        member = self.member(name)
        member.state, member.since, member.nodes = "running", now, nodes
        if member.lost_once or now > self.started_at:
            return f"{name} is running ({self._of(member.role)})"
        return None

    def lost(self, name: str, alive: set[str], now: float) -> bool:
        """`name` failed; whether it needs a new group (a node it ran on is gone) rather than a restart in place.
        A replica that goes back to waiting says so in one line (`notes`)."""
        member = self.member(name)
        moved = bool(member.nodes - alive)
        member.lost_once = True
        if moved:
            member.state, member.since, member.nodes = "waiting", now, frozenset()
            self.notes.append(f"{name} was lost with its node; it starts again where there is room, meanwhile "
                              f"{self._of(member.role)}")
        return moved

    def overdue(self, now: float) -> str | None:
        """The line that stops the run when a role has had no replica running for longer than the bound: the
        learner, or the last rollout or scorer replica (the run cannot go on without them)."""
        for role in self.least:
            waiting = [m for m in self.of_role(role) if m.state == "waiting"]
            # the role has had none running since its last replica went waiting: an extra that never ran has
            # waited since the start, which says nothing about how long the role has been without one
            if self.running(role) == 0 and waiting and now - max(m.since for m in waiting) > self.wait_s:
                return (f"{role}: no replica had room for {self.wait_s:g}s (resources.restarts.placement_wait_s); "
                        f"expected a node with room for its placement group{RESUME}")
        return None

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes

    def _of(self, role: str) -> str:
        return f"{self.running(role)} of {len(self.of_role(role))} {role} replicas run"


def log_replicas(spec: ExperimentSpec, run_id: str, counts: dict[str, int], step: int) -> None:
    """Each role's running replicas at the learner's `step`, as MLflow metrics `replicas_<role>`."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(f"replicas_{role}", n, now, step) for role, n in counts.items()]
    MlflowClient(tracking_uri=spec.tracking_uri).log_batch(run_id, metrics=metrics)
