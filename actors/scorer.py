"""ReplayScorerActor: owns a frozen target and a `Scorer`; anchor queue in, scored queue out."""

from __future__ import annotations

import ray

from actors.metrics import Metrics
from actors.queues import BatchQueue, Stopped
from opd.models.build import build_target
from opd.spec import ExperimentSpec
from opd.train.local import Scorer


@ray.remote
class ReplayScorerActor:
    def __init__(self, spec: dict, store, inbox: BatchQueue, out: BatchQueue) -> None:
        self.spec = ExperimentSpec.model_validate(spec)
        self.store, self.inbox, self.out = store, inbox, out
        self.scorer = Scorer(self.spec, build_target(self.spec))
        self.metrics = Metrics()

    def run(self) -> int:
        """Score batches until the run stops; returns how many."""
        scored = 0
        try:
            while True:
                item = self.scorer(self.inbox.get(self._stopped))
                wait = self.out.put(item, item.batch.index, self._stopped)
                self.metrics.record("opd_queue_put_wait_s", wait, queue=self.out.name)
                self.metrics.record("opd_queue_depth", self.out.depth(), queue=self.out.name)
                scored += 1
        except Stopped:
            return scored

    def _stopped(self) -> bool:
        return ray.get(self.store.stopped.remote())
