"""Signal: lets a call to an async actor block until the actor's state changes, instead of callers polling it.

Sync methods of an async Ray actor run on its event loop too, so any method may `fire` without a lock; a waiter
re-checks its predicate on every change and gives up after a timeout, so a caller that must notice shutdown (or
another actor's change) is never stuck.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Signal:
    def __init__(self) -> None:
        self._changed = asyncio.Event()

    def fire(self) -> None:
        """Wake every waiter (each re-checks its own predicate)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Whether `predicate` held within `timeout_s` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not predicate():
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return predicate()
        return True
