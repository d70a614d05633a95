"""ReplayScorerActor: owns a frozen target and a `Scorer`; anchor queue in, scored queue out.

With a rebuilt rollout source the scorer also owns a drafter: before each batch it adopts the newest published
version and rebuilds the batch's blocks with it. max_policy_lag applies there: batches wait in a `VersionGate`
(opd/train/ledger.py) until the version they need is published, while the loop keeps taking new ones in.
"""

from __future__ import annotations

from functools import partial

import ray

from actors.ledger import receive
from actors.metrics import Metrics
from actors.queues import BatchQueue, Stopped
from actors.replica import SpmdScorer, join, scorer
from actors.weight_store import fetch_snapshot
from opd.spec import ExperimentSpec
from opd.train.ledger import VersionGate
from opd.train.messages import AnchorBatch
from opd.train.policy_lag import required_version
from opd.train.ticket import Ticket

WAIT_S = 1.0  # with batches set aside, how long one wait for the inbox lasts before versions are checked again


@ray.remote
class ReplayScorerActor:
    def __init__(self, spec: dict, name: str, store, ledger, inbox: BatchQueue, out: BatchQueue,
                 shard: tuple[str, int] | None = None, followers: list | None = None) -> None:
        """`shard`: (group address, ranks) when this is rank 0 of a sharded replica whose other ranks are
        `followers` (actors/replica.py)."""
        self.spec, self.name = ExperimentSpec.model_validate(spec), name
        self.store, self.ledger, self.inbox, self.out = store, ledger, inbox, out
        self.scorer = SpmdScorer(scorer(self.spec, join(self.spec, shard)), followers or [])
        self.waiting = VersionGate(partial(required_version, spec=self.spec))
        self.metrics = Metrics()
        self.checksum = ""  # of the weights rebuilt with

    def ready(self) -> None:
        """Answers once the constructor has finished: the driver waits on it before relaunching a restarted loop."""

    def run(self) -> int:
        """Score batches until the run stops; returns how many. Each launch is a new incarnation for the ledger,
        which re-queues whatever a killed earlier one held; a batch lost with its producer is reported, not fatal."""
        worker, scored = ray.get(self.ledger.register.remote(self.name)), 0
        self.waiting.clear()  # the ledger re-queues what an earlier incarnation held
        try:
            while True:
                if (taken := self._next_scorable()) is None:
                    timeout = WAIT_S if self.waiting else None
                    if (got := receive(self.inbox, self.ledger, worker, self._stopped, timeout)) is not None:
                        self.waiting.add(*got)
                    continue
                ticket, batch = taken
                wait = self.out.put(self.scorer(batch), ticket, self._stopped)
                ray.get(self.ledger.put.remote(ticket, worker, self.out.name))
                self.metrics.record("opd_queue_put_wait_s", wait, queue=self.out.name)
                self.metrics.record("opd_queue_depth", self.out.depth(), queue=self.out.name)
                scored += 1
        except Stopped:
            return scored

    def _next_scorable(self) -> tuple[Ticket, AnchorBatch] | None:
        """The next batch to score (with the newest weights adopted when the scorer rebuilds), or None (also while
        the newest weights are lost with their learner's node, until the restarted learner publishes again)."""
        if not self.waiting:
            return None
        if not self.spec.rollout.rebuilt:
            return self.waiting.take(None)
        version, wrapped, checksum, _ = ray.get(self.store.latest.remote())
        if (version, checksum) != (self.scorer.draft_version, self.checksum):
            if (snapshot := fetch_snapshot(wrapped)) is None:
                return None
            self.scorer.load_drafter(snapshot.verified(version).state, version)
            self.checksum = checksum  # by checksum too: a restored learner republishes a version with other weights
        return self.waiting.take(version)

    def _stopped(self) -> bool:
        return ray.get(self.store.stopped.remote())
