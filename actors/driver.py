"""The driver for `engine: ray`: place the roles, wire the queues, run to the step budget, shut down cleanly.

rollout-i ──anchors queue──► scorer-j ──scored queue──► learner
    ▲            ▲                           ▲             │
    │            └────── LedgerActor ────────┘             │
    └────────────── WeightStore (versioned snapshot) ◄─────┘

Rollout actors and scorers loop on their own, producing the batch indices the ledger hands out; the driver only
advances the learner step by step (for the progress bar) and supervises every replica (actors/supervisor.py). When
a rank of a rollout, scorer or evaluator replica dies, stops answering, or rank 0's loop raises a fault, every rank
of that replica is killed and started again in the same run; the ledger re-queues the batches it held. When a
learner rank fails, every learner rank is started again and the learner restores its last checkpoint; the ledger
is rewound there. A fault that is bad input (an `OpdError`, a constructor that raised) stops the run with its
line, and so does one past `resources.restarts`; restarting the driver then resumes from the learner's last
checkpoint (the data cursor is the batch index, so the same batches are re-produced). With
`resources.learner.replicas` N > 1 the learner is N data-parallel ranks (`learner`, `learner-1`, ...) in one
torch.distributed group, packed on the learner's node.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
from functools import partial

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from actors.evaluator import NAME as EVALUATOR
from actors.evaluator import EvaluatorPlacement
from actors.learner import LearnerActor, LearnerRankActor
from actors.ledger import LedgerActor
from actors.queues import BatchQueue
from actors.remote import as_actor_class
from actors.replica import ShardFollower, bundle_address
from actors.rollout import RolloutActor
from actors.scorer import ReplayScorerActor
from actors.supervisor import Replica, cause_line
from actors.weight_store import WeightStore
from opd.errors import OpdError
from opd.eval.row import EvalRow
from opd.eval.suite import SuiteResult
from opd.run_dir import for_actors, lock_holder, unseen_input
from opd.spec import ExperimentSpec, RoleSpec
from opd.spec.resolve import input_paths
from opd.tracking import end_run, run_status
from opd.train.evaluator import Checkpoint
from opd.train.messages import StepReport, TrainResult
from opd.train.restarts import RESUME, Fault, Restart, RestartBudget, log_restart
from opd.train.result import record_ledger, run_to


def init_ray(spec: ExperimentSpec) -> None:
    """Join a running cluster, else start a private local Ray sized by `resources.cluster`.

    The running cluster is the one RAY_ADDRESS names (`ray job submit` sets it) or, without it, the one
    `ray start --head` runs on this machine: a bare `ray.init` joins that one anyway and then refuses the spec's
    CPU/GPU counts with a ValueError, so it is joined on purpose, with its own resources (the placement check
    still refuses a layout it cannot hold). RAY_ADDRESS=local always starts a private Ray.
    """
    if ray.is_initialized():
        return
    # Ray's token-auth notice at every local start is noise in the run's output (auth stays as Ray sets it); the
    # before-eval's actor starts Ray first, so the notice is silenced here, not in RayRun.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        try:  # where `ray start` records its head (TMPDIR/ray/ray_current_cluster); `ray stop` removes it
            address = ray._private.utils.read_ray_address()
        except Exception:  # a Ray without this private helper: start a private Ray beside it
            address = None
        if address:
            print(f"note: joining the Ray cluster that `ray start` runs at {address} (its resources apply, not "
                  "resources.cluster); RAY_ADDRESS=local starts a private one instead", file=sys.stderr)
    if address and address != "local":
        ray.init(address=address)
        return
    cluster = spec.resources.cluster
    ray.init(address="local", num_cpus=cluster.num_cpus, num_gpus=cluster.num_gpus, include_dashboard=True,
             configure_logging=False, log_to_driver=True)


def place(spec: ExperimentSpec, timeout_s: float = 60.0):
    """Two placement groups: the learner ranks with their scorers' ranks packed on one node (heavy tensors never
    cross the network; `ResourcesSpec.learner_bundles`), and the rollout replicas spread wherever they fit (sharded ones: on
    one node). Refused here if the cluster cannot hold them."""
    r, rollout = spec.resources, placed_rollout(spec)
    learner_pg = placement_group(r.learner_bundles(), strategy="STRICT_PACK", name="opd-learner")
    # a sharded replica's ranks share a node; one group for all of them packs every rollout rank on one node
    strategy = "STRICT_PACK" if rollout.gpus_per_replica > 1 else "PACK"
    rollout_pg = placement_group([rollout.bundle] * rollout.ranks, strategy=strategy, name="opd-rollout")
    ready, _ = ray.wait([learner_pg.ready(), rollout_pg.ready()], num_returns=2, timeout=timeout_s)
    if len(ready) < 2:
        for pg in (learner_pg, rollout_pg):
            remove_placement_group(pg)
        raise OpdError(f"resources: the cluster cannot place the roles within {timeout_s:.0f}s "
                       f"(available: {ray.available_resources()}); reduce replicas or GPUs/CPUs per role")
    return learner_pg, rollout_pg


def _on(pg, bundle: int, role: RoleSpec, name: str, gpus_to_child: bool = False) -> dict:
    """`gpus_to_child`: the actor leaves its bundle's GPUs to the worker it starts (a vLLM worker in vLLM's own
    environment, actors/isolated.py), which its placement group then captures into the same group."""
    return {"name": name, "num_cpus": role.num_cpus, "num_gpus": 0 if gpus_to_child else role.num_gpus,
            # no Ray restarts: the driver restarts every rank of a replica together (actors/supervisor.py)
            "max_restarts": 0,
            # so the driver's liveness call, a test or the dashboard reach an actor while its loop runs, and
            # rollout-0 take evaluations
            "max_concurrency": 3,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=gpus_to_child)}


def replicas(actor_class: type, kind: str, role: RoleSpec, pg, first: int, spec: dict, *args,
             gpus_to_child: bool = False) -> list[Replica]:
    """Every replica of `kind`: replica i on bundles first + i·N .. first + i·N + N − 1 of `pg`, N =
    gpus_per_replica; rank 0 an `actor_class` taking (spec, name, *args), the others ShardFollowers
    (actors/replica.py) in its torch.distributed group. `gpus_to_child`: see `_on`."""
    n, out = role.gpus_per_replica, []
    for i in range(role.replicas):
        name, base = f"{kind}-{i}", first + i * n
        out.append(Replica(kind, [name, *[f"{name}-rank{j}" for j in range(1, n)]], partial(
            _ranks, actor_class, kind, role, pg, base, name, spec, args, gpus_to_child), has_loop=True))
        out[-1].start()
    return out


def _ranks(actor_class: type, kind: str, role: RoleSpec, pg, base: int, name: str, spec: dict, args: tuple,
           gpus_to_child: bool) -> list:
    """One replica's ranks, started on bundles base .. base + N − 1 of `pg` in a fresh group (see `replicas`)."""
    n = role.gpus_per_replica
    shard = (bundle_address(pg, base), n) if n > 1 else None
    followers = [as_actor_class(ShardFollower).options(**_on(pg, base + j, role, f"{name}-rank{j}")).remote(
        spec, kind, shard[0], j, n) for j in range(1, n)] if shard else []
    leader = as_actor_class(actor_class).options(**_on(pg, base, role, name, gpus_to_child))
    return [leader.remote(spec, name, *args, shard, followers), *followers]


def _learner_ranks(spec: dict, role: RoleSpec, pg, track: bool, evaluator: str | None, *args) -> list:
    """The learner's ranks, rank 0 first, on the first bundles of the learner's group in a fresh process group;
    `args`: the weight store, ledger and scored queue."""
    n = role.replicas
    address = bundle_address(pg) if n > 1 else None
    ranks = [as_actor_class(LearnerRankActor).options(**_on(pg, i, role, f"learner-{i}")).remote(spec, i, address)
             for i in range(1, n)]
    learner = as_actor_class(LearnerActor).options(**_on(pg, 0, role, "learner"))
    return [learner.remote(spec, *args, track, address, ranks, evaluator), *ranks]


def on_driver_node() -> NodeAffinitySchedulingStrategy:
    """Where the control actors (weight store, ledger, queues) live: this driver's node, strictly. They have no
    restart, so on a worker node that dies they would take the run with them; the driver's node (the head, under
    `ray job submit`) lives as long as the run does. They take no CPU, so a head started with num-cpus 0 holds
    them."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def placed_rollout(spec: ExperimentSpec) -> RoleSpec:
    """The rollout role as Ray places it. A replica whose sampler is vLLM is one bundle of all its
    `gpus_per_replica` GPUs, which its vLLM worker holds (`vllm_samples`): vLLM starts its own tensor-parallel
    ranks inside it (opd/serving/engine.py), so there is no rank of ours to follow it. Any other replica is that
    many ranks."""
    r = spec.resources.rollout
    if not vllm_samples(spec) or r.gpus_per_replica == 1:
        return r
    n = r.gpus_per_replica
    return r.model_copy(update={"num_gpus": r.num_gpus * n, "num_cpus": r.num_cpus * n, "gpus_per_replica": 1})


def vllm_samples(spec: ExperimentSpec) -> bool:
    """Whether rollout replicas sample in a vLLM worker of their own, which takes their bundle's GPUs."""
    return spec.rollout.source == "target" and spec.rollout.sampler == "vllm"


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

    def __init__(self, spec: ExperimentSpec, *, track: bool = True) -> None:
        self.spec = spec
        init_ray(spec)
        self.learner_pg, self.rollout_pg = place(spec)
        try:
            self.spec = spec = resolve_for(spec, self.learner_pg, track)
        except BaseException:
            for pg in (self.learner_pg, self.rollout_pg):
                remove_placement_group(pg)
            raise
        r, as_dict = spec.resources, spec.model_dump(mode="json")
        pin = on_driver_node()
        self.store = as_actor_class(WeightStore).options(name="weights", scheduling_strategy=pin).remote()
        self.ledger = as_actor_class(LedgerActor).options(name="ledger", scheduling_strategy=pin).remote(as_dict)
        self.anchors = BatchQueue("anchors", r.queue_size, pin)
        self.scored = BatchQueue("scored", r.queue_size, pin)
        store, ledger, anchors, scored = _Named("weights"), _Named("ledger"), _inline(self.anchors), _inline(self.scored)
        # held-out eval, off the learner's critical path: its own actor, or rollout-0 between batches
        self.evaluator_placement = None if r.evaluate_on == "rollout" else EvaluatorPlacement(spec)
        evaluator = None if self.evaluator_placement is None else self.evaluator_placement.replica(as_dict)
        self.learners = Replica("learner", ["learner", *[f"learner-{i}" for i in range(1, r.learner.replicas)]],
                                partial(_learner_ranks, as_dict, r.learner, self.learner_pg, track,
                                        EVALUATOR if evaluator is not None else "rollout-0", store, ledger, scored))
        self.replicas = replicas(RolloutActor, "rollout", placed_rollout(spec), self.rollout_pg, 0, as_dict, store,
                                 ledger, anchors, gpus_to_child=vllm_samples(spec))
        self.replicas += [evaluator] if evaluator is not None else []
        self.learners.start()
        self.replicas += replicas(ReplayScorerActor, "scorer", r.scorer, self.learner_pg, r.first_scorer_bundle,
                                  as_dict, store, ledger, anchors, scored)
        self.budget = RestartBudget(r.restarts)
        self.track = track
        self.step = 0  # the learner's step, as last reported
        self.run_id: str | None = None  # the MLflow run, once the learner has opened it

    @property
    def learner(self):
        return self.learners.leader

    @property
    def rollouts(self) -> list:
        """Rank 0 of each rollout replica (the live ones: a restart replaces them)."""
        return [r.leader for r in self.replicas if r.role == "rollout"]

    @property
    def scorers(self) -> list:
        return [r.leader for r in self.replicas if r.role == "scorer"]

    @property
    def evaluator(self):
        return next((r.leader for r in self.replicas if r.role == "evaluator"), None)

    @property
    def followers(self) -> list:
        """The other ranks of sharded replicas."""
        return [rank for r in self.replicas for rank in r.ranks[1:]]

    def start(self) -> int:
        """Resume the learner (which opens the ledger at its step), then launch every rollout and scorer loop."""
        try:
            self.step = ray.get(self.learner.start.remote())
            self.run_id = ray.get(self.learner.run_id.remote())
        except ray.exceptions.RayError as exc:
            raise failure("the learner", exc) from None
        for replica in self.replicas:
            if replica.has_loop:
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
                    return [r for r in reports if r["step"] > begun]
            except ray.exceptions.RayError as exc:
                fault = self._fault(self.learners, exc, "the learner")
            self._restart_learner(fault)
            _settle(pending)

    def _supervise(self) -> Fault | None:
        """Restart any rollout, scorer or evaluator replica with a fault and mark restarts healed; return a learner
        rank's fault, which `train` handles (it owns the learner's pending step)."""
        stall = self.spec.resources.restarts.stall_timeout_s
        for replica in self.replicas:
            fault = replica.check(stall)
            if fault is None and replica.loop is not None and ray.wait([replica.loop], timeout=0)[0]:
                fault = self._loop_ended(replica)
            if fault is not None:
                self._restart(replica, fault)
        if self.budget.healing():
            self._mark_healed()
        return self.learners.check(stall)

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
        if isinstance(_root(exc), OpdError) or _init_failed(exc):
            raise failure(name, exc) from None
        return replica.culprit(cause_line(exc))

    def _restart(self, replica: Replica, fault: Fault) -> None:
        """Kill every rank of `replica`, start them again under the same names on the same bundles, relaunch its
        loop; the ledger re-queues what the old incarnation held when the new loop registers."""
        restart = self._admit(fault)
        print(f"note: {fault.line}; restarting it ({len(self.budget.restarts)} restart(s) so far)", file=sys.stderr,
              flush=True)
        replica.kill()
        if replica.loop is not None:
            _settle(replica.loop)
        if replica.role == "scorer":
            self._reclaim(self.anchors)
        self._start_again(replica)
        if replica.has_loop:
            replica.loop = replica.leader.run.remote()
        else:  # the evaluator passes no batches on: healed once it is up again
            self.budget.progressed({replica.name: (restart.incarnation + 1, 1)})
        self._log_restart(restart)

    def _restart_learner(self, fault: Fault) -> None:
        """Kill every learner rank, start them again and restore the last checkpoint (weights, optimizer, step,
        weight version, data position); the ledger is rewound to it (`Ledger.rewind`)."""
        restart = self._admit(fault)
        print(f"note: {fault.line}; restarting the learner from its last checkpoint", file=sys.stderr, flush=True)
        rewound = ray.get(self.ledger.account.remote())["rewound"]
        self.learners.kill()
        self._reclaim(self.scored)
        self._start_again(self.learners)
        try:
            self.step = ray.get(self.learner.start.remote())
        except ray.exceptions.RayError as exc:
            raise failure("the learner", exc) from None
        restart.steps_lost = (ray.get(self.ledger.account.remote())["rewound"] - rewound) // self.spec.batches_per_step
        self._log_restart(restart)

    def _reclaim(self, inbox: BatchQueue) -> None:
        """After a consumer of `inbox` died: what it had taken out of the queue and not yet reported is lost."""
        ray.get(self.ledger.missing.remote(inbox.name, inbox.tickets()))

    def _start_again(self, replica: Replica) -> None:
        replica.start()
        try:
            replica.ready()
        except ray.exceptions.RayError as exc:
            raise failure(replica.name, exc, "" if _init_failed(exc) else "its restart failed: ") from None

    def _mark_healed(self) -> None:
        """A restarted replica has healed once its new incarnation passed a batch on, the learner once it trained."""
        for restart in self.budget.progressed(ray.get(self.ledger.progress.remote())):
            self._log_restart(restart)

    def _admit(self, fault: Fault) -> Restart:
        """Count the restart (or stop the run past the bound), noting the ledger incarnation the fault ended."""
        restart = self.budget.admit(fault)
        restart.incarnation = ray.get(self.ledger.progress.remote()).get(fault.replica, (0, 0))[0]
        return restart

    def _log_restart(self, restart: Restart) -> None:
        if self.track and self.run_id is not None:
            log_restart(self.spec, self.run_id, self.budget.restarts.index(restart) + 1, restart, self.step)

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
                q.shutdown()
            for pg in (self.learner_pg, self.rollout_pg):
                remove_placement_group(pg)
            if self.evaluator_placement is not None:
                self.evaluator_placement.remove()


def _settle(ref) -> None:
    """Take the error of a call on killed ranks, which Ray would otherwise print as unhandled when it drops it."""
    with contextlib.suppress(ray.exceptions.RayError):
        ray.get(ref, timeout=30)


def failure(name: str, exc: BaseException, context: str = "") -> OpdError:
    """The one line for role `name` failing with `exc`. When the root cause is an `OpdError` (bad input, a refused
    resume), that error's own line: a rerun would fail the same way, so it gets no advice to rerun. Only a fault a
    rerun can fix (an actor, object or node lost, not an exception raised by the code) ends with that advice."""
    root = _root(exc)
    if isinstance(root, OpdError):
        return OpdError(str(root))
    fixable = isinstance(root, ray.exceptions.RayError) and not _init_failed(root)
    return OpdError(f"{name} failed ({context}{type(root).__name__}: {_first_line(root)})" + (RESUME if fixable else ""))


def _init_failed(exc: BaseException) -> bool:
    return isinstance(exc, ray.exceptions.RayActorError) and exc.actor_init_failed


def _root(exc: BaseException) -> BaseException:
    """What actually went wrong: the exception a task raised, or the one an actor's constructor raised (Ray keeps
    only its traceback text, whose last line is `module.Type: message`)."""
    while isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        exc = exc.cause
    if _init_failed(exc):
        last = [line for line in str(exc).splitlines() if line.strip()][-1]
        kind, _, message = last.partition(": ")
        if kind == f"{OpdError.__module__}.{OpdError.__name__}":
            return OpdError(message)
    return exc


def _first_line(exc: BaseException) -> str:
    """One line for an error; for a constructor that raised, the last line of its traceback (the first is only
    Ray's banner naming the task and process)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    return lines[-1] if _init_failed(exc) else lines[0]


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
        run_to(spec, result, lambda until: [StepReport(**r) for r in run.train(until)], label="draft-opd (ray)")
        record_ledger(spec, result, ray.get(run.ledger.account.remote()), track=track)
        return result
    except BaseException as exc:
        error = exc
        raise
    finally:
        run.shutdown(run_status(error))
