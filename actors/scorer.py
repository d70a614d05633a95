"""ReplayScorerActor: owns a frozen target and a `Scorer`; anchor queue in, scored queue out."""

from __future__ import annotations

import ray

from actors.ledger import receive
from actors.metrics import Metrics
from actors.queues import BatchQueue, Stopped
from opd.models.build import build_target
from opd.spec import ExperimentSpec
from opd.train.scorer import Scorer


@ray.remote
class ReplayScorerActor:
    def __init__(self, spec: dict, name: str, store, ledger, inbox: BatchQueue, out: BatchQueue) -> None:
        self.spec, self.name = ExperimentSpec.model_validate(spec), name
        self.store, self.ledger, self.inbox, self.out = store, ledger, inbox, out
        self.scorer = Scorer(self.spec, build_target(self.spec))
        self.metrics = Metrics()

    def ready(self) -> None:
        """Answers once the constructor has finished: the driver waits on it before relaunching a restarted loop."""

    def run(self) -> int:
        """Score batches until the run stops; returns how many. Each launch is a new incarnation for the ledger,
        which re-queues whatever a killed earlier one held; a batch lost with its producer is reported, not fatal."""
        worker, scored = ray.get(self.ledger.register.remote(self.name)), 0
        try:
            while True:
                if (taken := receive(self.inbox, self.ledger, worker, self._stopped)) is None:
                    continue
                ticket, batch = taken
                wait = self.out.put(self.scorer(batch), ticket, self._stopped)
                self.metrics.record("opd_queue_put_wait_s", wait, queue=self.out.name)
                self.metrics.record("opd_queue_depth", self.out.depth(), queue=self.out.name)
                scored += 1
        except Stopped:
            return scored

    def _stopped(self) -> bool:
        return ray.get(self.store.stopped.remote())
