"""Bounded queues of object references between the roles.

The payload is `ray.put` once by the producer and only a wrapped reference travels through the queue (a bare
ObjectRef would be resolved and copied into the queue actor). A full queue blocks the producer: nothing is
dropped. Ray (since 2.56) no longer lets a producer hand ownership to another actor, so a payload dies with
its producer; the consumer then gets `Lost` with the batch's `Ticket` (which travels beside the reference),
reports it to the ledger, and the batch is re-produced from its deterministic data cursor instead of silently
disappearing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.queue import Empty, Full, Queue

from opd.train.ticket import Ticket


class Stopped(Exception):
    """The run is shutting down while a producer or consumer was waiting."""


class Lost(Exception):
    """The payload's owner (its producer) died before the consumer read it."""

    def __init__(self, ticket: Ticket) -> None:
        super().__init__(f"batch {ticket.index} (attempt {ticket.attempt}) was lost with its producer")
        self.ticket = ticket


class BatchQueue:
    def __init__(self, name: str, maxsize: int, scheduling_strategy: Any = None) -> None:
        """`scheduling_strategy` places the queue's actor (the driver pins it to its own node)."""
        self.name = name
        options = {"name": f"queue-{name}", "num_cpus": 0}
        if scheduling_strategy is not None:
            options["scheduling_strategy"] = scheduling_strategy
        self.queue = Queue(maxsize=maxsize, actor_options=options)

    def put(self, item: Any, ticket: Ticket, stopped: Callable[[], bool] = lambda: False) -> float:
        """Enqueue one attempt of a batch (blocking while full); returns the seconds spent blocked."""
        ref = ray.put(item)
        start = time.perf_counter()
        while True:
            try:
                self.queue.put((ticket, [ref]), timeout=1.0)
                return time.perf_counter() - start
            except Full:
                if stopped():
                    raise Stopped from None

    def get(self, stopped: Callable[[], bool] = lambda: False,
            timeout_s: float | None = None) -> tuple[Ticket, Any] | None:
        """Dequeue (blocking while empty, or None after `timeout_s`) and fetch the payload; raises `Lost` if its
        producer died."""
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        while True:
            try:
                ticket, wrapped = self.queue.get(timeout=1.0 if timeout_s is None else min(1.0, timeout_s))
            except Empty:
                if stopped():
                    raise Stopped from None
                if deadline is not None and time.perf_counter() >= deadline:
                    return None
                continue
            try:
                return ticket, ray.get(wrapped[0])
            except (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError):
                raise Lost(ticket) from None

    def tickets(self) -> list[Ticket]:
        """The tickets of the batches in the queue now."""
        return ray.get(self.queue.actor.__ray_call__.remote(lambda actor: [t for t, _ in list(actor.queue._queue)]))

    def depth(self) -> int:
        return self.queue.qsize()

    def shutdown(self) -> None:
        self.queue.shutdown(force=True)
