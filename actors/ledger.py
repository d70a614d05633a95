"""LedgerActor: hosts the run's `Ledger` (which batch is where; opd/train/ledger.py), and `receive`, the one way
a consumer takes a batch out of a queue."""

from __future__ import annotations

from functools import partial
from typing import Any

import ray

from actors.queues import BatchQueue, Lost
from opd.spec import ExperimentSpec
from opd.train.ledger import Ledger
from opd.train.messages import Ticket
from opd.train.rollout import required_version


@ray.remote(num_cpus=0)
class LedgerActor:
    """Created with the run; `begin` is called by the learner once it knows the step it resumes from."""

    def __init__(self, spec: dict) -> None:
        self.spec = ExperimentSpec.model_validate(spec)
        self.ledger: Ledger | None = None

    def begin(self, first_index: int) -> None:
        self.ledger = Ledger(first_index, partial(required_version, spec=self.spec))

    def register(self, name: str) -> str:
        return self.ledger.register(name)

    def claim(self, worker: str, version: int) -> Ticket | None:
        return self.ledger.claim(worker, version)

    def handoff(self, ticket: Ticket, worker: str) -> bool:
        return self.ledger.handoff(ticket, worker)

    def lost(self, ticket: Ticket) -> None:
        self.ledger.lost(ticket)

    def stale(self, ticket: Ticket) -> None:
        self.ledger.stale(ticket)

    def trained(self, tickets: list[Ticket]) -> None:
        self.ledger.trained(tickets)

    def account(self) -> dict[str, int]:
        return self.ledger.account()

    def trained_indices(self) -> list[int]:
        return self.ledger.trained_indices()

    def holders(self) -> dict[int, str]:
        return self.ledger.holders()


def receive(inbox: BatchQueue, ledger, worker: str, stopped=lambda: False) -> tuple[Ticket, Any] | None:
    """The next batch from `inbox`, now held by `worker`; None when it was lost with its producer (reported, so
    it is re-produced) or is a copy of an attempt already given up (dropped: its re-production is on its way)."""
    try:
        ticket, item = inbox.get(stopped)
    except Lost as lost:
        ray.get(ledger.lost.remote(lost.ticket))
        return None
    return (ticket, item) if ray.get(ledger.handoff.remote(ticket, worker)) else None
