"""The driver for `engine: ray`: place the roles, wire the queues, run to the step budget, shut down cleanly.

rollout-i ──anchors queue──► scorer-j ──scored queue──► learner
    ▲            ▲                           ▲             │
    │            └────── LedgerActor ────────┘             │
    └────────────── WeightStore (versioned snapshot) ◄─────┘

Rollout actors and scorers loop on their own, producing the batch indices the ledger hands out; the driver only
advances the learner step by step (for the progress bar) and supervises every replica (actors/supervisor.py).
Every replica has its own placement group; what the driver decides about them (how many, where, when a lost one
comes back) is opd/train/fleet.py's. When a rank of a rollout, scorer or evaluator replica dies, stops answering,
or rank 0's loop raises a fault, every rank of that replica is killed and started again in the same run, in a new
group when its node is gone; the ledger re-queues the batches it held, and the others go on meanwhile. When a
learner rank fails, every learner rank is started again and the learner restores its last checkpoint; the ledger
is rewound there. A fault that is bad input (an `OpdError`, a constructor that raised) stops the run with its
line, and so does one past `resources.restarts`; restarting the driver then resumes from the learner's last
checkpoint (the data cursor is the batch index, so the same batches are re-produced). With
`resources.learner.replicas` N > 1 the learner is N data-parallel ranks (`learner`, `learner-1`, ...) in one
torch.distributed group, packed on the learner's node. The control actors (weight store, ledger, queues) live on
the driver's node: losing it ends the run, and a rerun resumes.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from actors.errors import cause_line, failure, is_bad_input
from actors.evaluator import NAME as EVALUATOR
from actors.evaluator import EvaluatorPlacement, start_ranks
from actors.learner import LearnerActor, LearnerRankActor
from actors.ledger import LedgerActor
from actors.metrics import Metrics
from actors.queues import BatchQueue
from actors.remote import as_actor_class
from actors.replica import ShardFollower, bundle_address
from actors.rollout import RolloutActor
from actors.scorer import ReplayScorerActor
from actors.session import init_ray
from actors.supervisor import Replica
from actors.weight_store import WeightStore
from opd.errors import OpdError
from opd.eval.row import EvalRow
from opd.eval.suite import SuiteResult
from opd.run_dir import for_actors, lock_holder, unseen_input
from opd.spec import ExperimentSpec, RoleSpec
from opd.spec.resolve import input_paths
from opd.tracking import end_run, run_status
from opd.train.evaluator import Checkpoint
from opd.train.fleet import Fleet, log_replicas, placed_role, placement, vllm_samples
from opd.train.messages import StepReport, TrainResult
from opd.train.restarts import RESUME, Fault, Restart, RestartBudget, log_restart
from opd.train.result import record_ledger, run_to


def _on(group, bundle: int, role: RoleSpec, name: str, gpus_to_child: bool = False) -> dict:
    """`gpus_to_child`: the actor leaves its bundle's GPUs to the worker it starts (a vLLM worker in vLLM's own
    environment, actors/isolated.py), which its placement group then captures into the same group."""
    return {"name": name, "num_cpus": role.num_cpus, "num_gpus": 0 if gpus_to_child else role.num_gpus,
            # no Ray restarts: the driver restarts every rank of a replica together (actors/supervisor.py)
            "max_restarts": 0,
            # so the driver's liveness call, a test or the dashboard reach an actor while its loop runs, and
            # rollout-0 take evaluations
            "max_concurrency": 3,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=gpus_to_child)}


def _ranks(actor_class: type, role_name: str, role: RoleSpec, base: int, name: str, spec: dict, args: tuple,
           gpus_to_child: bool, group) -> list:
    """One replica's ranks, started on bundles base .. base + N − 1 of `group` in a fresh torch.distributed group:
    rank 0 an `actor_class` taking (spec, name, *args), the others ShardFollowers (actors/replica.py).
    `gpus_to_child`: see `_on`."""
    n = role.gpus_per_replica
    shard = (bundle_address(group, base), n) if n > 1 else None
    followers = [as_actor_class(ShardFollower).options(**_on(group, base + j, role, f"{name}-rank{j}")).remote(
        spec, role_name, shard[0], j, n) for j in range(1, n)] if shard else []
    leader = as_actor_class(actor_class).options(**_on(group, base, role, name, gpus_to_child))
    return [leader.remote(spec, name, *args, shard, followers), *followers]


def _learner_ranks(spec: dict, role: RoleSpec, track: bool, evaluator: str | None, args: tuple, group) -> list:
    """The learner's ranks, rank 0 first, on the first bundles of `group` in a fresh process group; `args`: the
    weight store, ledger and scored queue."""
    n = role.least
    address = bundle_address(group) if n > 1 else None
    ranks = [as_actor_class(LearnerRankActor).options(**_on(group, i, role, f"learner-{i}")).remote(spec, i, address)
             for i in range(1, n)]
    learner = as_actor_class(LearnerActor).options(**_on(group, 0, role, "learner"))
    return [learner.remote(spec, *args, track, address, ranks, evaluator), *ranks]


NODE_PROBE_S = 60.0  # how long a failed replica's node has to answer before it is taken for gone


def on_driver_node() -> NodeAffinitySchedulingStrategy:
    """Where the control actors (weight store, ledger, queues) live: this driver's node, strictly. They have no
    restart, so on a worker node that dies they would take the run with them; the driver's node (the head, under
    `ray job submit`) lives as long as the run does. They take no CPU, so a head started with num-cpus 0 holds
    them."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


@ray.remote(num_cpus=0)
def _here() -> None:
    """Runs on the node it is sent to: that node still answers."""


def alive_nodes(asked: frozenset[str], timeout_s: float = NODE_PROBE_S) -> set[str]:
    """The nodes alive, with each of `asked` (a failed replica's) asked directly: a rank's death is often seen
    before Ray's health check marks its node dead, and a replica restarted on a dead node's bundles would only die
    again. A node that does not run a task within `timeout_s` is taken for gone."""
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    probes = {node: _here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
              for node in asked & alive}
    ready, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=timeout_s)
    answered = set()
    for node, probe in probes.items():
        with contextlib.suppress(ray.exceptions.RayError):
            if probe in ready:
                ray.get(probe)
                answered.add(node)
    return (alive - set(probes)) | answered


@ray.remote(num_cpus=0)
def _lock_holder(run_dir: str) -> str | None:
    return lock_holder(run_dir)


def resolve_for(spec: ExperimentSpec, learner_pg, track: bool) -> ExperimentSpec:
    """The spec every actor gets (opd/run_dir.py `for_actors`), checked against where the roles were placed: the
    alive nodes (an autoscaler may just have added some) and the learner's node. On several nodes, the learner's
    node must see the run directory this driver locked (shared storage), else its checkpoints would be lost."""
    alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    learner_node = ray.util.placement_group_table(learner_pg)["bundles_to_node_id"][0]
    elsewhere = learner_node != ray.get_runtime_context().get_node_id()
    working_dir = bool(ray.get_runtime_context().runtime_env.get("working_dir"))
    spec = for_actors(spec, nodes=len(alive), learner_elsewhere=elsewhere, tracked=track, working_dir=working_dir)
    if len(alive) > 1 and not working_dir:
        _check_inputs_seen(spec, alive)
    if elsewhere and (mine := lock_holder(spec.run_dir)) is not None:
        strategy = PlacementGroupSchedulingStrategy(learner_pg, placement_group_bundle_index=0)
        theirs = ray.get(_lock_holder.options(scheduling_strategy=strategy).remote(str(spec.run_dir)))
        if theirs != mine:
            raise OpdError(f"tracking.run_dir: the learner's node does not see {spec.run_dir} as this driver does "
                           f"(its lock file says {theirs!r}, here {mine!r}); expected a path on storage every node "
                           f"mounts")
    return spec


@ray.remote(num_cpus=0)
def _unseen(paths: list[str]) -> list[str]:
    return [path for path in paths if not os.path.exists(path)]


def _check_inputs_seen(spec: ExperimentSpec, nodes: list[str]) -> None:
    """Every input the driver sees is there on every node, where the actors will read it (`unseen_input`)."""
    fields = {path: field for field, path, _ in input_paths(spec) if os.path.exists(path)}
    refs = {node: _unseen.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
        list(fields)) for node in nodes}
    for node, ref in refs.items():
        if missing := ray.get(ref):
            raise OpdError(unseen_input(fields[missing[0]], missing[0], node))


class _Named:
    """A named actor in constructor arguments: pickled as its name, unpickled as the live handle, so a replica the
    driver starts again with the same arguments gets whichever actor holds the name then. A handle in constructor
    arguments is a reference Ray keeps in the object store, which it may report as a red `core_worker.cc` error
    line ("constructor arguments in the object store"); a name is a few inline bytes."""

    def __init__(self, name: str) -> None:
        self.name, self.namespace = name, ray.get_runtime_context().namespace

    def __reduce__(self):
        return ray.get_actor, (self.name, self.namespace)


def _inline(queue: BatchQueue) -> BatchQueue:
    """A copy of `queue` that travels by its actor's name (see `_Named`)."""
    inner = copy.copy(queue.queue)
    inner.actor = _Named(f"queue-{queue.name}")
    out = copy.copy(queue)
    out.queue = inner
    return out


def dashboard_url() -> str | None:
    """The Ray dashboard of the cluster this driver joined (None without one), printed while the run is live."""
    url = getattr(getattr(ray._private.worker, "_global_node", None), "webui_url", None)
    return (url if "://" in url else f"http://{url}") if url else None


class RayRun:
    """All actors of one run; `train()` advances to the step budget, `shutdown()` always runs."""

    def __init__(self, spec: ExperimentSpec, *, track: bool = True, place_timeout_s: float = 60.0) -> None:
        init_ray(spec)
        self.spec, self.track, r = spec, track, spec.resources
        self.fleet = Fleet.of(spec, time.monotonic(), evaluator=r.evaluate_on == "evaluator")
        self.learners = Replica("learner", ["learner", *[f"learner-{i}" for i in range(1, r.learner.least)]],
                                self._learner_ranks, placement(spec, "learner"))
        self.replicas = [self._replica(m.role, i) for role in ("rollout", "evaluator", "scorer")
                         for i, m in enumerate(self.fleet.of_role(role))]
        self.store: Any = None  # the control actors, started once the roles are placed
        self.ledger: Any = None
        self.anchors: BatchQueue | None = None
        self.scored: BatchQueue | None = None
        try:
            self._place(place_timeout_s)
            self.spec = spec = resolve_for(spec, self.learners.group, track)
        except BaseException:
            self._release()
            raise
        self.as_dict = spec.model_dump(mode="json")
        pin = on_driver_node()
        self.store = as_actor_class(WeightStore).options(name="weights", scheduling_strategy=pin).remote()
        self.ledger = as_actor_class(LedgerActor).options(name="ledger", scheduling_strategy=pin).remote(
            self.as_dict)
        self.anchors = BatchQueue("anchors", r.queue_size, pin)
        self.scored = BatchQueue("scored", r.queue_size, pin)
        self.learners.start()
        for replica in self.replicas:
            if self.fleet.member(replica.name).state == "running":
                replica.start()
        self.budget = RestartBudget(r.restarts)
        self.metrics = Metrics()
        self.step = 0  # the learner's step, as last reported
        self.run_id: str | None = None  # the MLflow run, once the learner has opened it
        self.fleet.started_at = time.monotonic()

    def _replica(self, role: str, index: int) -> Replica:
        """Replica `index` of `role` (rollout, scorer, evaluator), its ranks not yet started."""
        where, role_spec = placement(self.spec, role, index), placed_role(self.spec, role)
        name = self.fleet.of_role(role)[index].name
        names = [name, *[f"{name}-rank{j}" for j in range(1, role_spec.gpus_per_replica)]]
        if role == "evaluator":
            return Replica(role, names, lambda group: start_ranks(self.as_dict, role_spec, name, group), where)
        actor_class = RolloutActor if role == "rollout" else ReplayScorerActor
        inbox = [] if role == "rollout" else ["anchors"]
        out = "anchors" if role == "rollout" else "scored"

        def launch(group) -> list:
            args = (_Named("weights"), _Named("ledger"), *[_inline(self._queue(q)) for q in (*inbox, out)])
            return _ranks(actor_class, role, role_spec, where.first, name, self.as_dict, args,
                          role == "rollout" and vllm_samples(self.spec), group)

        return Replica(role, names, launch, where, has_loop=True, group_of=lambda: self.learners.group)

    def _learner_ranks(self, group) -> list:
        evaluator = EVALUATOR if "evaluator" in self.fleet.least else "rollout-0"
        args = (_Named("weights"), _Named("ledger"), _inline(self._queue("scored")))
        return _learner_ranks(self.as_dict, self.spec.resources.learner, self.track, evaluator, args, group)

    def _queue(self, name: str) -> BatchQueue:
        queue = self.anchors if name == "anchors" else self.scored
        assert queue is not None  # the queues exist before any rank starts
        return queue

    def _place(self, timeout_s: float) -> None:
        """Ask for every replica's group (the learner's first, so scorers can prefer its node; every role's `min`
        before any extra replica, which Ray then places only where room is left) and wait until the learner and at
        least `min` replicas of each role are placed; refused in one line if the cluster cannot
        hold them within `timeout_s`. The others wait for room and start when Ray places them (`_supervise`)."""
        deadline = time.monotonic() + timeout_s
        self.learners.request()
        if self.learners.placed(timeout_s):
            self.fleet.placed("learner", self.learners.nodes(), 0.0)
            for replica in sorted(self.replicas, key=lambda r: self.fleet.priority(r.name)):
                self._request(replica)
            while True:
                for replica in self.replicas:
                    if self.fleet.member(replica.name).state == "waiting" and replica.placed():
                        self.fleet.placed(replica.name, replica.nodes(), 0.0)
                if self.fleet.short_at_start() is None or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        if (short := self.fleet.short_at_start()) is not None:
            free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
            raise OpdError(f"resources: the cluster cannot place the roles within {timeout_s:.0f}s (placed: {short}; "
                           f"available: {free}); reduce replicas or GPUs/CPUs per role")

    def _request(self, replica: Replica) -> None:
        """Ask for `replica`'s group; a scorer's prefers the learner's node."""
        replica.request(next(iter(self.learners.nodes()), None) if replica.placement.near_learner else None)

    @property
    def learner(self):
        return self.learners.leader

    def running(self, role: str) -> list[Replica]:
        """The replicas of `role` whose ranks run (the others wait for room)."""
        return [r for r in self.replicas if r.role == role and self.fleet.member(r.name).state == "running"]

    @property
    def rollouts(self) -> list:
        """Rank 0 of each running rollout replica (the live ones: a restart replaces them)."""
        return [r.leader for r in self.running("rollout")]

    @property
    def scorers(self) -> list:
        return [r.leader for r in self.running("scorer")]

    @property
    def evaluator(self):
        return next((r.leader for r in self.running("evaluator")), None)

    @property
    def followers(self) -> list:
        """The other ranks of sharded replicas."""
        return [rank for r in self.replicas for rank in r.ranks[1:]]

    def start(self) -> int:
        """Resume the learner (which opens the ledger at its step), then launch every running rollout and scorer
        loop."""
        try:
            self.step = ray.get(self.learner.start.remote())
            self.run_id = ray.get(self.learner.run_id.remote())
        except ray.exceptions.RayError as exc:
            raise failure("the learner", exc) from None
        for replica in self.replicas:
            if replica.ranks and replica.has_loop:
                replica.loop = replica.leader.run.remote()
        return self.step

    def train(self, until: int) -> list[dict]:
        """Advance the learner to step `until`, supervising every role while it works; the reports of the steps
        after the one it started from (a learner restarted on the way redoes steps from its checkpoint)."""
        begun = self.step
        while True:
            pending = self.learner.train.remote(until)
            try:
                while not ray.wait([pending], timeout=1.0)[0]:
                    if (fault := self._supervise()) is not None:
                        break
                else:
                    reports = ray.get(pending)
                    self.step = until
                    self._log_replicas(until)
                    return [r for r in reports if r["step"] > begun]
            except ray.exceptions.RayError as exc:
                fault = self._fault(self.learners, exc, "the learner")
            self._restart_learner(fault)
            _settle(pending)

    def _supervise(self) -> Fault | None:
        """Start the replicas Ray has placed since, restart any with a fault, stop the run past the wait for room,
        and mark restarts healed; return a learner rank's fault, which `train` handles (it owns the learner's
        pending step)."""
        stall = self.spec.resources.restarts.stall_timeout_s
        for replica in self.replicas:
            if self.fleet.member(replica.name).state == "waiting":
                if replica.placed():
                    self._start_placed(replica)
                continue
            fault = replica.check(stall)
            if fault is None and replica.loop is not None and ray.wait([replica.loop], timeout=0)[0]:
                fault = self._loop_ended(replica)
            if fault is not None:
                self._restart(replica, fault)
        for note in self.fleet.take_notes():
            print(f"note: {note}", file=sys.stderr, flush=True)
        if (line := self.fleet.overdue(time.monotonic())) is not None:
            raise OpdError(line)
        if self.budget.healing():
            self._mark_healed()
        return self.learners.check(stall)

    def _start_placed(self, replica: Replica) -> None:
        """A waiting replica's group is placed: start its ranks and loop (a restart's new incarnation)."""
        note = self.fleet.placed(replica.name, replica.nodes(), time.monotonic())
        replica.start()
        self._relaunch(replica)
        if note is not None:
            print(f"note: {note}", file=sys.stderr, flush=True)

    def _relaunch(self, replica: Replica) -> None:
        if replica.has_loop:
            replica.loop = replica.leader.run.remote()
        elif (restart := self._last_restart(replica.name)) is not None:
            # the evaluator passes no batches on: healed once it is up again
            self.budget.progressed({replica.name: (restart.incarnation + 1, 1)})
            self._log_restart(restart)

    def _last_restart(self, name: str) -> Restart | None:
        return next((r for r in reversed(self.budget.healing()) if r.fault.replica == name), None)

    def _loop_ended(self, replica: Replica) -> Fault:
        """The fault behind a loop that ended (a loop ends only when the run stops or it fails)."""
        try:
            ray.get(replica.loop)
        except ray.exceptions.RayError as exc:
            return self._fault(replica, exc, replica.name)
        raise OpdError(f"{replica.name} failed (its loop returned early){RESUME}")

    @staticmethod
    def _fault(replica: Replica, exc: ray.exceptions.RayError, name: str) -> Fault:
        """The fault behind rank 0's error `exc`, found by asking each rank (`Replica.culprit`); bad input (an
        `OpdError`, a constructor that raised) is no fault a restart heals: it stops the run with its line."""
        if is_bad_input(exc):
            raise failure(name, exc) from None
        return replica.culprit(cause_line(exc))

    def _restart(self, replica: Replica, fault: Fault) -> None:
        """Kill every rank of `replica` and start them again under the same names: on the same bundles, or, when a
        node it ran on is gone, in a new group wherever Ray finds room, now or later (the run goes on meanwhile).
        What it held goes back to the ledger for re-production at once (`Ledger.retire`)."""
        moved = self.fleet.lost(replica.name, alive_nodes(self.fleet.member(replica.name).nodes), time.monotonic())
        restart = self._admit(fault, moved)
        print(f"note: {fault.line}; restarting it ({len(self.budget.restarts)} restart(s) so far)", file=sys.stderr,
              flush=True)
        replica.kill()
        if replica.loop is not None:
            _settle(replica.loop)
            replica.loop = None
        if replica.role == "scorer":
            self._reclaim(self._queue("anchors"))
        ray.get(self.ledger.retire.remote(replica.name))
        self._log_restart(restart)
        if moved:
            replica.release()
            self._request(replica)
            return
        replica.start()
        self._relaunch(replica)

    def _restart_learner(self, fault: Fault) -> None:
        """Kill every learner rank, start them again (in a new group when its node is gone, waiting up to
        `resources.restarts.placement_wait_s` for room) and restore the last checkpoint (weights, optimizer, step,
        weight version, data position); the ledger is rewound to it (`Ledger.rewind`)."""
        moved = self.fleet.lost("learner", alive_nodes(self.fleet.member("learner").nodes), time.monotonic())
        restart = self._admit(fault, moved)
        print(f"note: {fault.line}; restarting the learner from its last checkpoint", file=sys.stderr, flush=True)
        rewound = ray.get(self.ledger.account.remote())["rewound"]
        self.learners.kill()
        self._reclaim(self._queue("scored"))
        if moved:
            self._place_learner_again()
        self.learners.start()
        try:
            self.step = ray.get(self.learner.start.remote())
        except ray.exceptions.RayError as exc:
            raise failure("the learner", exc) from None
        restart.steps_lost = (ray.get(self.ledger.account.remote())["rewound"] - rewound) // self.spec.batches_per_step
        self._log_restart(restart)

    def _place_learner_again(self) -> None:
        """A new group for the learner, before any waiting replica's: theirs are asked for again once it is placed,
        so a replica that is only extra never takes the learner's room."""
        waiting = [r for r in self.replicas if self.fleet.member(r.name).state == "waiting"]
        for replica in waiting:
            replica.release()
        self.learners.release()
        self.learners.request()
        wait_s = self.spec.resources.restarts.placement_wait_s
        if not self.learners.placed(wait_s):
            raise OpdError(f"learner: no room to place it again for {wait_s:g}s after its node was lost "
                           f"(resources.restarts.placement_wait_s){RESUME}")
        self.fleet.placed("learner", self.learners.nodes(), time.monotonic())
        for replica in waiting:
            self._request(replica)

    def _reclaim(self, inbox: BatchQueue) -> None:
        """After a consumer of `inbox` died: what it had taken out of the queue and not yet reported is lost."""
        ray.get(self.ledger.missing.remote(inbox.name, inbox.tickets()))

    def _mark_healed(self) -> None:
        """A restarted replica has healed once its new incarnation passed a batch on, the learner once it trained."""
        for restart in self.budget.progressed(ray.get(self.ledger.progress.remote())):
            self._log_restart(restart)

    def _admit(self, fault: Fault, node_lost: bool) -> Restart:
        """Count the restart (or stop the run past the bound), noting the ledger incarnation the fault ended."""
        restart = self.budget.admit(fault, node_lost=node_lost)
        restart.incarnation = ray.get(self.ledger.progress.remote()).get(fault.replica, (0, 0))[0]
        return restart

    def _log_restart(self, restart: Restart) -> None:
        if self.track and self.run_id is not None:
            log_restart(self.spec, self.run_id, self.budget.restarts.index(restart) + 1, restart, self.step)

    def _log_replicas(self, step: int) -> None:
        """Each role's running replicas at `step`: in MLflow (`replicas_rollout`, ...) and on the dashboard."""
        counts = self.fleet.counts()
        for role, n in counts.items():
            self.metrics.record("opd_replicas", n, role=role)
        if self.track and self.run_id is not None:
            log_replicas(self.spec, self.run_id, counts, step)

    def shutdown(self, status: str = "FINISHED") -> None:
        """Stop the loops, end the MLflow run with `status`, release every actor and placement group (also after a
        failure). A learner that cannot close its run (dead) has it ended here, so it never stays RUNNING."""
        try:
            ray.get(self.store.request_stop.remote())
            loops = [r.loop for r in self.replicas if r.loop is not None]
            ray.wait(loops, num_returns=len(loops), timeout=120)
            ray.get(self.learner.close.remote(status))
        except ray.exceptions.RayError:  # the error that killed the learner is already raised: never mask it
            with contextlib.suppress(Exception):
                end_run(self.spec, self.run_id, status)
        finally:
            for actor in [*self.learners.ranks, *[rank for r in self.replicas for rank in r.ranks], self.store,
                          self.ledger]:
                ray.kill(actor)
            for q in (self.anchors, self.scored):
                if q is not None:
                    q.shutdown()
            self._release()

    def _release(self) -> None:
        for replica in [self.learners, *self.replicas]:
            replica.release()


def _settle(ref) -> None:
    """Take the error of a call on killed ranks, which Ray would otherwise print as unhandled when it drops it."""
    with contextlib.suppress(ray.exceptions.RayError):
        ray.get(ref, timeout=30)


def evaluate_in_actor(spec: ExperimentSpec, drafters: list[Checkpoint]) -> list[list[EvalRow]]:
    """`opd run`'s before/after held-out table for drafter directories (None: the warm drafter), decoded by one
    evaluator actor on the cluster's GPUs (`resources.evaluator`), not in this driver process."""
    return _in_evaluator(spec, lambda actor: actor.checkpoints.remote(drafters))


def draw_samples_in_actor(spec: ExperimentSpec, path: str) -> None:
    """The held-out samples for offline evaluation, drawn by an evaluator actor (`Evaluator.draw_samples`)."""
    _in_evaluator(spec, lambda actor: actor.draw_samples.remote(path))


def suite_in_actor(spec: ExperimentSpec, drafters: dict[str, str], out: str) -> SuiteResult:
    """`opd run`'s benchmark suite table (`eval.suite`) of drafter directories, drawn and scored by an evaluator
    actor (`Evaluator.suite`), which writes the samples under `out` (the run directory, shared storage)."""
    return _in_evaluator(spec, lambda actor: actor.suite.remote(drafters, out))


def _in_evaluator(spec: ExperimentSpec, call):
    init_ray(spec)
    placement = EvaluatorPlacement(spec)
    actor = placement.start(spec.model_dump(mode="json"), f"{EVALUATOR}-checkpoint")
    try:
        return ray.get(call(actor))
    except ray.exceptions.RayError as exc:
        raise failure("the evaluator", exc) from None
    finally:
        ray.kill(actor)
        placement.remove()


def run_ray(spec: ExperimentSpec, *, track: bool = True) -> TrainResult:
    """Train to the step budget; the MLflow run ends FINISHED, or FAILED / KILLED with the error that stopped it."""
    run = RayRun(spec, track=track)
    if url := dashboard_url():
        print(f"Ray dashboard (while the run is live): {url}", flush=True)
    error: BaseException | None = None
    try:
        result = TrainResult(steps=run.start(), run_id=run.run_id)
        run_to(spec, result, lambda until: [StepReport(**r) for r in run.train(until)], label="draft-opd (ray)",
               replicas=run.fleet.line)
        record_ledger(spec, result, ray.get(run.ledger.account.remote()), track=track)
        return result
    except BaseException as exc:
        error = exc
        raise
    finally:
        run.shutdown(run_status(error))
