"""The newest published draft weights (a reference to a `WeightSnapshot`) and the run's stop flag.

`wait_newer` blocks until a newer version is published or the run stops, so a rollout actor waiting for weights
is woken by the publish instead of polling.
"""

from __future__ import annotations

import ray

from actors.signal import Signal


@ray.remote(num_cpus=0)
class WeightStore:
    def __init__(self) -> None:
        self.version, self.checksum, self.stop = -1, "", False
        self.ref: list | None = None  # the newest snapshot's reference, wrapped (see `publish`)
        self.changed = Signal()

    def publish(self, version: int, wrapped_ref: list, checksum: str) -> None:
        """Replace the current snapshot; the reference is wrapped in a list so Ray does not resolve it here."""
        if version > self.version:
            self.version, self.ref, self.checksum = version, wrapped_ref, checksum
            self.changed.fire()

    def latest(self) -> tuple[int, list | None, str]:
        return self.version, self.ref, self.checksum

    async def wait_newer(self, version: int, timeout_s: float) -> bool:
        """Block until a version newer than `version` is published or the run stops (True), or `timeout_s` passes
        (False)."""
        return await self.changed.wait_for(lambda: self.version > version or self.stop, timeout_s)

    def request_stop(self) -> None:
        self.stop = True
        self.changed.fire()

    def stopped(self) -> bool:
        return self.stop
