"""The ticket that travels through the queues beside every rollout batch: which batch, which attempt.

A module of its own, free of torch, because the queue and ledger actors unpickle tickets and nothing else: they start
without importing torch or the models.
"""

from __future__ import annotations

from typing import NamedTuple


class Ticket(NamedTuple):
    """One production attempt of batch `index`. A NamedTuple: it is a heap key and a dict key in the ledger."""

    # the rollout batch number (the data cursor); it shadows tuple.index, which nothing calls on a Ticket
    index: int  # type: ignore[assignment]
    attempt: int  # 0 for the first production, +1 for every re-production of a given-up attempt
