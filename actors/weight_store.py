"""The newest published draft weights (a reference to a `WeightSnapshot`) and the run's stop flag."""

from __future__ import annotations

import ray


@ray.remote(num_cpus=0)
class WeightStore:
    def __init__(self) -> None:
        self.version, self.ref, self.checksum, self.stop = -1, None, "", False

    def publish(self, version: int, wrapped_ref: list, checksum: str) -> None:
        """Replace the current snapshot; the reference is wrapped in a list so Ray does not resolve it here."""
        if version > self.version:
            self.version, self.ref, self.checksum = version, wrapped_ref, checksum

    def latest(self) -> tuple[int, list | None, str]:
        return self.version, self.ref, self.checksum

    def request_stop(self) -> None:
        self.stop = True

    def stopped(self) -> bool:
        return self.stop
