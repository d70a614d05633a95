"""RolloutActor: owns a `RolloutWorker` (target + drafter copy, or only a target sampler or a sample file) and
feeds the anchor queue with the batches the ledger hands out. With `resources.evaluate_on: rollout`, rollout-0
also serves the learner's held-out evaluations on its target, between batches (actors/replica.py
`RolloutReplica`)."""

from __future__ import annotations

import time

import ray

from actors.isolated import allow_vllm_workers
from actors.metrics import Metrics
from actors.queues import BatchQueue, Stopped
from actors.replica import SpmdRollout, join, rollout_worker
from actors.weight_store import fetch_snapshot
from opd.eval.acceptance import AcceptanceStats
from opd.spec import ExperimentSpec
from opd.train.evaluator import EvalResult
from opd.train.messages import WeightSnapshot
from opd.train.ticket import Ticket

WAIT_S = 5.0  # longest one blocking wait on the ledger or weight store; then the loop checks again


@ray.remote
class RolloutActor:
    def __init__(self, spec: dict, name: str, store, ledger, out: BatchQueue, shard: tuple[str, int] | None = None,
                 followers: list | None = None) -> None:
        """`shard`: (group address, ranks) when this is rank 0 of a sharded replica whose other ranks are
        `followers` (actors/replica.py)."""
        self.spec, self.name, self.store, self.ledger, self.out = (ExperimentSpec.model_validate(spec), name, store,
                                                                   ledger, out)
        allow_vllm_workers()  # a vLLM rollout sampler starts its worker from this actor
        self.worker = SpmdRollout(rollout_worker(self.spec, join(self.spec, shard)), followers or [])
        self.metrics = Metrics()
        self.checksum = ""  # of the weights drafted with

    def ready(self) -> None:
        """Answers once the constructor has finished: the driver waits on it before relaunching a restarted loop."""

    def run(self) -> int:
        """Produce the batches the ledger hands out until the run stops; returns how many. Each launch is a new
        incarnation for the ledger, which re-queues whatever a killed earlier one held."""
        worker, produced = ray.get(self.ledger.register.remote(self.name)), 0
        try:
            while True:
                ticket = self._claim(worker)
                t0 = time.perf_counter()
                batch = self.worker.run(ticket.index)
                self._record(batch, time.perf_counter() - t0)
                wait = self.out.put(batch, ticket, self._stopped)
                ray.get(self.ledger.put.remote(ticket, worker, self.out.name))
                self.metrics.record("opd_queue_put_wait_s", wait, queue=self.out.name)
                produced += 1
        except Stopped:
            return produced

    def evaluate(self, snapshot: WeightSnapshot) -> EvalResult:
        """Held-out evaluation of `snapshot` on this replica's target (`resources.evaluate_on: rollout`), between two
        of its rollout batches: the learner reaches it as it would the evaluator actor (`ActorEvaluations`)."""
        return self.worker.evaluate(snapshot)

    def draft_state(self) -> tuple[int, dict]:
        """The weights this actor drafts with (tests compare them with the learner's bit for bit)."""
        assert self.worker.decoder is not None  # asked of drafting replicas only
        return self.worker.draft_version, self.worker.decoder.drafter.state_dict()

    def _stopped(self) -> bool:
        return ray.get(self.store.stopped.remote())

    def _claim(self, worker: str) -> Ticket:
        """The next batch to produce, with the newest weights swapped in. The ledger hands out nothing the newest
        version may not draft (max_policy_lag), so this waits while rollout is as far ahead as it may be: blocked
        on both actors at once until a newer version is published, the ledger has a batch this version may draft
        (one given up, to re-produce), or the run stops. Weights that died with their learner's node are waited
        past: the restarted learner publishes its checkpoint's."""
        while True:
            version, wrapped, checksum, epoch = ray.get(self.store.latest.remote())
            if not self._adopt(version, wrapped, checksum):
                ray.get(self.store.wait_newer.remote(version, WAIT_S, epoch))
                continue
            ticket = ray.get(self.ledger.claim.remote(worker, version, epoch))
            if ticket is not None:
                return ticket
            if self._stopped():
                raise Stopped
            ray.wait([self.store.wait_newer.remote(version, WAIT_S, epoch),
                      self.ledger.wait_claimable.remote(worker, version, WAIT_S)], num_returns=1)

    def _adopt(self, version: int, wrapped: list | None, checksum: str) -> bool:
        """Draft with published `version` from now on; False when its snapshot is lost (its owner, the learner,
        died with its node)."""
        if not self.worker.decoder or (version, checksum) == (self.worker.draft_version, self.checksum):
            return True
        assert wrapped is not None  # a version was published
        if (snapshot := fetch_snapshot(wrapped)) is None:
            return False
        self.worker.load_drafter(snapshot.verified(version).state, version)  # only complete, checked weights
        self.checksum = checksum  # by checksum too: a restored learner republishes a version with other weights
        return True

    def _record(self, batch, seconds: float) -> None:
        self.metrics.record("opd_rollout_tokens_per_s", batch.tokens / seconds, actor=self.name)
        if self.worker.decoder:  # a rebuilt batch's τ is known once the scorer has rebuilt it
            stats = AcceptanceStats.from_records(batch.records, self.spec.models.drafter.block_size)
            self.metrics.record("opd_rollout_tau", stats.tau_token_weighted, actor=self.name)
        self.metrics.record("opd_rollout_batches", 1, actor=self.name)
        self.metrics.record("opd_queue_depth", self.out.depth(), queue=self.out.name)
