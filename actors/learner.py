"""LearnerActor: owns the `TrainingSession` (drafter, optimizer, checkpoints, MLflow) and publishes weights.

It holds the drafter on the target's embedding and LM head only, never the target. Held-out evaluation runs in
the `EvaluatorActor` (actors/evaluator.py): the session hands it snapshots without waiting and logs the results
to MLflow, at the steps they evaluated, when they come back. Weights reach the weight store from the session's
publisher thread (opd/train/publisher.py), off the training loop. With `resources.learner.replicas` N > 1 it is
learner rank 0 of N: it alone collects batches, tracks, hands out evaluations, checkpoints and publishes, and
sends each `LearnerRankActor` its shard of every step (opd/train/distributed.py).
"""

from __future__ import annotations

import time

import ray

from actors.evaluator import ActorEvaluations
from actors.ledger import receive
from actors.metrics import Metrics
from actors.queues import BatchQueue
from opd.distill.losses import StepNorm
from opd.distill.scored_batch import ScoredBatch
from opd.models.build import resolve_device
from opd.spec import ExperimentSpec
from opd.train.distributed import Group, collective_timeout, init_group
from opd.train.ledger import StepBuffer
from opd.train.messages import ScoredItem, WeightSnapshot
from opd.train.session import LearnerRank, TrainingSession
from opd.train.ticket import Ticket


class RankPeers:
    """`Peers` over the rank actors: shards travel as call arguments (through the object store of the node they
    share with rank 0); `join` surfaces a rank's failure in rank 0's step."""

    def __init__(self, ranks: list) -> None:
        self.ranks = ranks
        self.pending: list[ray.ObjectRef] = []  # this step's shards, one call per rank

    def launch(self, shards: list[list[ScoredBatch]], norm: StepNorm) -> None:
        self.pending = [rank.train_step.remote(s, norm) for rank, s in zip(self.ranks, shards)]

    def join(self) -> None:
        ray.get(self.pending)


def join_group(spec: ExperimentSpec, address: str, rank: int) -> Group:
    """This rank's place in the learner process group at `address`."""
    return init_group(address, rank, spec.resources.learner.least, resolve_device(spec.models.device),
                      collective_timeout(spec))


@ray.remote
class LearnerActor:
    def __init__(self, spec: dict, store, ledger, inbox: BatchQueue, track: bool = True, address: str | None = None,
                 ranks: list | None = None, evaluator: str | None = None) -> None:
        """`address` and `ranks` (the `LearnerRankActor`s 1..N-1) only with several learner ranks; `evaluator`: the
        name of the actor that evaluates (None: no held-out evaluation)."""
        self.spec = ExperimentSpec.model_validate(spec)
        self.store, self.ledger, self.inbox, self.ranks = store, ledger, inbox, ranks or []
        group = None if address is None else join_group(self.spec, address, 0)  # None: a single learner
        self.session = TrainingSession(self.spec, track=track, group=group,
                                      peers=RankPeers(self.ranks) if self.ranks else None,
                                      evals=ActorEvaluations(evaluator) if evaluator is not None else None,
                                      publish=self._publish)
        self.buffer = StepBuffer(self.spec.batches_per_step)
        self.worker = ""  # the learner's id in the ledger, once started
        self.metrics = Metrics()

    def ready(self) -> None:
        """Answers once the constructor has finished, and then while it trains: the driver's liveness call."""

    def start(self) -> int:
        """Start the session (resume from the last checkpoint, or hand the warm drafter to the evaluator as step 0),
        publish the current weights and open the ledger at the first batch this step needs; returns the step."""
        self.session.start()
        checkpoint = None if self.session.resumed_from is None else str(self.session.resumed_from)
        ray.get([rank.start.remote(checkpoint) for rank in self.ranks])
        published = self.session.published
        # a learner restarted in the run restores an older version than the store holds: a new epoch
        epoch = ray.get(self.store.restore.remote(published.version, [ray.put(published)], published.checksum))
        ray.get(self.ledger.begin.remote(self.session.step * self.spec.batches_per_step, published.version, epoch))
        self.worker = ray.get(self.ledger.register.remote("learner"))
        return self.session.step

    def train(self, until: int) -> list[dict]:
        """Take optimizer steps until `until`; one report (metrics, evals, checkpoint) per step."""
        reports = []
        while self.session.step < until:
            tickets, items = zip(*self._collect())
            report = self.session.train_step(list(items))
            ray.get(self.ledger.trained.remote(list(tickets)))
            self._record(report.metrics)
            reports.append({"step": report.step, "metrics": report.metrics, "checkpoint": report.checkpoint,
                            "evals": report.evals})
        return reports

    def _collect(self) -> list[tuple[Ticket, ScoredItem]]:
        """This step's rollout batches, strictly by index. A stale one is counted, never trained on, and sent back
        to be re-produced with newer weights. While one is missing the learner keeps draining the queue into its
        buffer, so later batches never block the producers of the missing one."""
        while True:
            entries, stale = self.buffer.take(self.session.step, self.session.is_stale)
            for ticket, item in stale:
                self.session.discard(item)
                self.metrics.record("opd_stale_batches", 1)
                ray.get(self.ledger.stale.remote(ticket))
            if entries is not None:
                break
            t0 = time.perf_counter()
            if (taken := receive(self.inbox, self.ledger, self.worker, self._publication_failed)) is not None:
                self.buffer.add(*taken)
            self.session.counters.idle_s += time.perf_counter() - t0
        for _, item in entries:
            self.metrics.record("opd_policy_lag", self.session.step - item.batch.draft_version)
        return entries

    def _publication_failed(self) -> bool:
        """Asked every second while the learner waits for batches: a failed publication raises here, since the
        batches it waits for may need the weights that never reached the weight store."""
        self.session.publisher.check()
        return False

    def _publish(self, snapshot: WeightSnapshot) -> None:
        """Put `snapshot` in the object store and make it the weight store's newest. Called by the session's
        publisher thread, one version at a time in order, so the learner's loop never waits for it."""
        t0 = time.perf_counter()
        ref = ray.put(snapshot)
        ray.get(self.store.publish.remote(snapshot.version, [ref], snapshot.checksum))
        self.metrics.record("opd_broadcast_s", time.perf_counter() - t0)

    def _record(self, m: dict) -> None:
        c = self.session.counters
        self.metrics.record("opd_learner_step_s", m["step_time_s"])
        self.metrics.record("opd_learner_idle_fraction", c.idle_s / max(1e-9, c.idle_s + c.busy_s))
        for part, key in (("total", "loss"), ("acc", "loss_acc"), ("rej", "loss_rej")):
            self.metrics.record("opd_loss", m[key], part=part)

    def draft_state(self) -> tuple[int, dict]:
        return self.session.published.version, self.session.drafter.state_dict()

    def run_id(self) -> str | None:
        return self.session.run_id

    def counters(self) -> dict:
        return vars(self.session.counters)

    def close(self, status: str = "FINISHED") -> None:
        self.session.close(status)


@ray.remote
class LearnerRankActor:
    """Learner rank r > 0: joins the group, then steps on the shards rank 0 sends (`LearnerRank`)."""

    def __init__(self, spec: dict, rank: int, address: str) -> None:
        parsed = ExperimentSpec.model_validate(spec)
        self.rank = LearnerRank(parsed, join_group(parsed, address, rank))

    def ready(self) -> None:
        """Answers once the constructor has finished, and then while it steps: the driver's liveness call."""

    def start(self, checkpoint: str | None) -> None:
        self.rank.start(checkpoint)

    def train_step(self, micro_batches: list[ScoredBatch], norm: StepNorm) -> None:
        self.rank.train_step(micro_batches, norm)
