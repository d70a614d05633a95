"""LedgerActor: hosts the run's `Ledger` (which batch is where; opd/train/ledger.py), and `receive`, the one way
a consumer takes a batch out of a queue.

`wait_claimable` blocks until a worker could claim a batch: every change to the ledger (a batch given up and
waiting for re-production, above all) wakes it, so a waiting rollout actor never polls.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import ray

from actors.queues import BatchQueue, Lost
from actors.signal import Signal
from opd.spec import ExperimentSpec
from opd.train.ledger import Ledger
from opd.train.policy_lag import claim_version
from opd.train.ticket import Ticket


@ray.remote(num_cpus=0)
class LedgerActor:
    """Created with the run; `begin` is called by the learner once it knows the step it resumes from."""

    def __init__(self, spec: dict) -> None:
        self.spec = ExperimentSpec.model_validate(spec)
        self.ledger: Ledger | None = None
        self.changed = Signal()

    def begin(self, first_index: int, version: int = 0, epoch: int = 0) -> None:
        """Open the ledger at `first_index`; called again by a learner restarted in the run (restored to the
        checkpoint whose next batch is `first_index`, its weights `version` in the weight store's `epoch`), it
        rewinds the ledger there instead (`Ledger.rewind`)."""
        if self.ledger is None:
            self.ledger = Ledger(first_index, partial(claim_version, spec=self.spec))
            self.ledger.epoch = epoch
        else:
            self.ledger.rewind(first_index, version, epoch)
        self.changed.fire()

    @property
    def opened(self) -> Ledger:
        """The ledger `begin` opened, for every other call: the learner begins it before it registers, and the
        driver starts the rollout and scorer loops only after that."""
        if self.ledger is None:
            raise RuntimeError("the ledger was used before the learner began it (LedgerActor.begin)")
        return self.ledger

    def register(self, name: str) -> str:
        worker = self.opened.register(name)
        self.changed.fire()
        return worker

    def retire(self, name: str) -> list[int]:
        given_up = self.opened.retire(name)
        self.changed.fire()
        return given_up

    def claim(self, worker: str, version: int, epoch: int = 0) -> Ticket | None:
        ticket = self.opened.claim(worker, version, epoch)
        if ticket is not None:  # another index is next now
            self.changed.fire()
        return ticket

    async def wait_claimable(self, worker: str, version: int, timeout_s: float) -> bool:
        """Block until `worker` could claim a batch with draft version `version` (True), or `timeout_s` passes.
        It claims nothing: the caller may be woken by a newer version first and claim with that."""
        return await self.changed.wait_for(
            lambda: self.ledger is not None and self.ledger.claimable(worker, version), timeout_s)

    def handoff(self, ticket: Ticket, worker: str) -> bool:
        taken = self.opened.handoff(ticket, worker)
        self.changed.fire()
        return taken

    def put(self, ticket: Ticket, worker: str, queue: str) -> None:
        self.opened.put(ticket, worker, queue)

    def missing(self, queue: str, present: list[Ticket]) -> list[int]:
        gone = self.opened.missing(queue, present)
        self.changed.fire()
        return gone

    def lost(self, ticket: Ticket) -> None:
        self.opened.lost(ticket)
        self.changed.fire()

    def stale(self, ticket: Ticket) -> None:
        self.opened.stale(ticket)
        self.changed.fire()

    def trained(self, tickets: list[Ticket]) -> None:
        self.opened.trained(tickets)

    def account(self) -> dict[str, int]:
        return self.opened.account()

    def trained_indices(self) -> list[int]:
        return self.opened.trained_indices()

    def holders(self) -> dict[int, str]:
        return self.opened.holders()

    def progress(self) -> dict[str, tuple[int, int]]:
        return self.opened.progress()


def receive(inbox: BatchQueue, ledger, worker: str, stopped=lambda: False,
            timeout_s: float | None = None) -> tuple[Ticket, Any] | None:
    """The next batch from `inbox`, now held by `worker`; None when it was lost with its producer (reported, so
    it is re-produced), is a copy of an attempt already given up (dropped: its re-production is on its way), or
    nothing came within `timeout_s` (None: wait as long as it takes)."""
    try:
        taken = inbox.get(stopped, timeout_s)
        if taken is None:
            return None
        ticket, item = taken
    except Lost as lost:
        ray.get(ledger.lost.remote(lost.ticket))
        return None
    return (ticket, item) if ray.get(ledger.handoff.remote(ticket, worker)) else None
