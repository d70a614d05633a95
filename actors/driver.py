"""The driver for `engine: ray`: place the roles, wire the queues, run to the step budget, shut down cleanly.

rollout-i ──anchors queue──► scorer-j ──scored queue──► learner
    ▲            ▲                           ▲             │
    │            └────── LedgerActor ────────┘             │
    └────────────── WeightStore (versioned snapshot) ◄─────┘

Rollout actors and scorers loop on their own, producing the batch indices the ledger hands out; the driver only
advances the learner step by step (for the progress bar) and watches the loops. A rollout or scorer actor that
dies is restarted by Ray (`max_restarts`) and its loop relaunched here; the ledger re-queues the batches it held,
so training continues in the same run. Only a learner failure, or an actor out of restarts, stops the run;
restarting the driver then resumes from the learner's last checkpoint (the data cursor is the batch index, so
the same batches are re-produced). With `resources.learner.replicas` N > 1 the learner is N data-parallel ranks
(`learner`, `learner-1`, ...) in one torch.distributed group, packed on the learner's node.
"""

from __future__ import annotations

import os
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.learner import LearnerActor, LearnerRankActor
from actors.ledger import LedgerActor
from actors.queues import BatchQueue
from actors.rollout import RolloutActor
from actors.scorer import ReplayScorerActor
from actors.weight_store import WeightStore
from opd.errors import OpdError
from opd.progress import progress_bar
from opd.spec import ExperimentSpec, RoleSpec
from opd.train.distributed import free_address
from opd.train.local import TrainResult, progress_columns

MAX_RESTARTS = 3  # per rollout or scorer actor; one more death stops the run
RESTART_TIMEOUT_S = 600.0  # a restarted actor rebuilds its models (a large target takes minutes to load)


def init_ray(spec: ExperimentSpec) -> None:
    """Join a running cluster, else start a private local Ray sized by `resources.cluster`.

    The running cluster is the one RAY_ADDRESS names (`ray job submit` sets it) or, without it, the one
    `ray start --head` runs on this machine: a bare `ray.init` joins that one anyway and then refuses the spec's
    CPU/GPU counts with a ValueError, so it is joined on purpose, with its own resources (the placement check
    still refuses a layout it cannot hold). RAY_ADDRESS=local always starts a private Ray.
    """
    import sys

    if ray.is_initialized():
        return
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


def _bundle(role: RoleSpec) -> dict[str, float]:
    bundle = {"CPU": role.num_cpus}
    if role.num_gpus:
        bundle["GPU"] = role.num_gpus
    return bundle


def place(spec: ExperimentSpec, timeout_s: float = 60.0):
    """Two placement groups: the learner ranks (bundles 0..N-1) with their scorers packed on one node (heavy
    tensors never cross the network), and the rollout replicas spread wherever they fit. Refused here if the
    cluster cannot hold them."""
    r = spec.resources
    bundles = [_bundle(r.learner)] * r.learner.replicas + [_bundle(r.scorer)] * r.scorer.replicas
    learner_pg = placement_group(bundles, strategy="STRICT_PACK", name="opd-learner")
    rollout_pg = placement_group([_bundle(r.rollout)] * r.rollout.replicas, strategy="PACK", name="opd-rollout")
    ready, _ = ray.wait([learner_pg.ready(), rollout_pg.ready()], num_returns=2, timeout=timeout_s)
    if len(ready) < 2:
        for pg in (learner_pg, rollout_pg):
            remove_placement_group(pg)
        raise OpdError(f"resources: the cluster cannot place the roles within {timeout_s:.0f}s "
                       f"(available: {ray.available_resources()}); reduce replicas or GPUs/CPUs per role")
    return learner_pg, rollout_pg


@ray.remote(num_cpus=0)
def _node_address() -> str:
    return free_address(ray.util.get_node_ip_address())


def learner_address(learner_pg) -> str:
    """A free host:port on the learner's node for rank 0 to listen on, known before any rank is built, so all of
    them join the group in their constructors."""
    strategy = PlacementGroupSchedulingStrategy(learner_pg, placement_group_bundle_index=0)
    return ray.get(_node_address.options(scheduling_strategy=strategy).remote())


def _on(pg, bundle: int, role: RoleSpec, name: str) -> dict:
    return {"name": name, "num_cpus": role.num_cpus, "num_gpus": role.num_gpus, "max_restarts": MAX_RESTARTS,
            "max_concurrency": 2,  # so a test or the dashboard can query an actor while its loop runs
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)}


class RayRun:
    """All actors of one run; `train()` advances to the step budget, `shutdown()` always runs."""

    def __init__(self, spec: ExperimentSpec, *, track: bool = True) -> None:
        self.spec = spec
        init_ray(spec)
        r, as_dict = spec.resources, spec.model_dump(mode="json")
        self.learner_pg, self.rollout_pg = place(spec)
        self.store = WeightStore.options(name="weights").remote()
        self.ledger = LedgerActor.options(name="ledger").remote(as_dict)
        self.anchors = BatchQueue("anchors", r.queue_size)
        self.scored = BatchQueue("scored", r.queue_size)
        n = r.learner.replicas
        address = learner_address(self.learner_pg) if n > 1 else None
        self.learner_ranks = [LearnerRankActor.options(**_on(self.learner_pg, i, r.learner, f"learner-{i}")).remote(
            as_dict, i, address) for i in range(1, n)]
        self.learner = LearnerActor.options(**_on(self.learner_pg, 0, r.learner, "learner")).remote(
            as_dict, self.store, self.ledger, self.scored, track, address, self.learner_ranks)
        self.scorers = [ReplayScorerActor.options(**_on(self.learner_pg, n + i, r.scorer, f"scorer-{i}")).remote(
            as_dict, f"scorer-{i}", self.store, self.ledger, self.anchors, self.scored)
            for i in range(r.scorer.replicas)]
        self.rollouts = [RolloutActor.options(**_on(self.rollout_pg, i, r.rollout, f"rollout-{i}")).remote(
            as_dict, f"rollout-{i}", self.store, self.ledger, self.anchors) for i in range(r.rollout.replicas)]
        self.loops: dict = {}  # loop ref -> (actor name, actor)

    def start(self) -> int:
        """Resume the learner (which opens the ledger at its step), then launch every rollout and scorer loop."""
        step = ray.get(self.learner.start.remote())
        named = [(f"scorer-{i}", s) for i, s in enumerate(self.scorers)]
        named += [(f"rollout-{i}", a) for i, a in enumerate(self.rollouts)]
        self.loops = {actor.run.remote(): (name, actor) for name, actor in named}
        return step

    def train(self, until: int) -> list[dict]:
        """Advance the learner to step `until`, watching the other roles while it works."""
        pending = self.learner.train.remote(until)
        while not ray.wait([pending], timeout=1.0)[0]:
            self._check_loops()
        try:
            return ray.get(pending)
        except ray.exceptions.RayError as exc:
            raise OpdError(f"the learner failed ({_first_line(exc)}); run the same command again "
                           f"to resume from the last checkpoint") from None

    def _check_loops(self) -> None:
        """Relaunch the loop of an actor that died and was restarted; stop the run on any other ended loop."""
        done, _ = ray.wait(list(self.loops), timeout=0)
        for ref in done:
            name, actor = self.loops.pop(ref)
            self.loops[relaunch(ref, name, actor)] = (name, actor)

    def shutdown(self) -> None:
        """Stop the loops, close the MLflow run, release every actor and placement group (also after a failure)."""
        try:
            ray.get(self.store.request_stop.remote())
            ray.wait(list(self.loops), num_returns=len(self.loops), timeout=120)
            ray.get(self.learner.close.remote())
        except ray.exceptions.RayError:
            pass  # a dead actor has nothing left to close; the error that killed it is already raised
        finally:
            for actor in [self.learner, *self.learner_ranks, *self.scorers, *self.rollouts, self.store, self.ledger]:
                ray.kill(actor)
            for q in (self.anchors, self.scored):
                q.shutdown()
            for pg in (self.learner_pg, self.rollout_pg):
                remove_placement_group(pg)


def relaunch(ref, name: str, actor):
    """A new loop on an actor whose loop `ref` ended, if the actor died and Ray restarted it (the ledger re-queues
    what the dead one held). A loop that returned or raised, or an actor out of restarts, stops the run with one
    line instead of hanging; the run stays resumable from the learner's last checkpoint."""
    try:
        ray.get(ref)
        reason = "its loop returned early"
    except ray.exceptions.RayTaskError as exc:  # the loop raised (even because another actor died): relaunching
        reason = _first_line(exc)  # would fail again
    except ray.exceptions.RayActorError:
        try:
            _await_restart(actor)
            return actor.run.remote()
        except ray.exceptions.RayError as exc:
            reason = f"it died and was not restarted: {_first_line(exc)}"
    except ray.exceptions.RayError as exc:
        reason = _first_line(exc)
    raise OpdError(f"{name} failed ({reason}); run the same command again to resume from the last checkpoint")


def _await_restart(actor) -> None:
    """Return once a restarting actor has rebuilt itself; calls fail fast while it restarts, so poll. Raises
    ActorDiedError when it will not come back (out of restarts, or killed for good), GetTimeoutError if too slow."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        try:
            return ray.get(actor.ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _first_line(exc: BaseException) -> str:
    """One line for an error; a task that raised is reported by what it raised (its first line is only Ray's
    banner naming the task and process)."""
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        return f"{type(exc.cause).__name__}: {_first_line(exc.cause)}"
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def run_ray(spec: ExperimentSpec, *, track: bool = True) -> TrainResult:
    run = RayRun(spec, track=track)
    try:
        step = run.start()
        result = TrainResult(steps=step, run_id=ray.get(run.learner.run_id.remote()))
        with progress_bar(*progress_columns()) as bar:
            task = bar.add_task("draft-opd (ray)", total=spec.steps, completed=step, loss=float("nan"),
                                tau=float("nan"))
            while step < spec.steps:
                for report in run.train(step + 1):
                    m, step = report["metrics"], report["step"]
                    result.losses.append(m["loss"])
                    result.checkpoint = report["checkpoint"] or result.checkpoint
                    if report["evals"]:
                        result.evals[step] = report["evals"]
                    bar.update(task, completed=step, loss=m["loss"], tau=m["rollout_tau"])
        result.steps = step
        return result
    finally:
        run.shutdown()
