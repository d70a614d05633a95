"""The newest published draft weights (a reference to a `WeightSnapshot`) and the run's stop flag.

`wait_newer` blocks until another version is published or the run stops, so a rollout actor waiting for weights
is woken by the publish instead of polling. A learner restarted in the run `restore`s the version of its checkpoint,
an older one, and then publishes the versions after it again with other weights than the dead learner's: the
store's `epoch` counts restores, and a claim made with weights of an older epoch is refused by the ledger, so no
batch is drafted with weights that no longer exist under a number the restored learner reuses.
"""

from __future__ import annotations

import ray

from actors.signal import Signal
from opd.train.messages import WeightSnapshot


def fetch_snapshot(wrapped: list) -> WeightSnapshot | None:
    """The published snapshot behind a store's wrapped reference, or None when it died with its owner (the learner,
    whose node was lost): the restarted learner publishes again, and a waiter takes that one."""
    try:
        return ray.get(wrapped[0])
    except (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError):
        return None


@ray.remote(num_cpus=0)
class WeightStore:
    def __init__(self) -> None:
        self.version, self.checksum, self.stop, self.epoch = -1, "", False, 0
        self.ref: list | None = None  # the newest snapshot's reference, wrapped (see `publish`)
        self.changed = Signal()

    def publish(self, version: int, wrapped_ref: list, checksum: str) -> None:
        """Replace the current snapshot; the reference is wrapped in a list so Ray does not resolve it here."""
        if version > self.version:
            self.version, self.ref, self.checksum = version, wrapped_ref, checksum
            self.changed.fire()

    def restore(self, version: int, wrapped_ref: list, checksum: str) -> int:
        """Make `version` the newest: the learner's first publication, or a restarted learner's checkpoint (older
        than what the store holds), which opens a new epoch; returns the epoch."""
        self.epoch += self.version >= 0
        self.version, self.ref, self.checksum = version, wrapped_ref, checksum
        self.changed.fire()
        return self.epoch

    def latest(self) -> tuple[int, list | None, str, int]:
        """(version, wrapped reference, checksum, epoch) of the newest snapshot."""
        return self.version, self.ref, self.checksum, self.epoch

    async def wait_newer(self, version: int, timeout_s: float, epoch: int | None = None) -> bool:
        """Block until a version other than `version` is the newest (a restore makes it older), another epoch than
        `epoch` began (a restore of the same version), or the run stops (True), or `timeout_s` passes (False)."""
        return await self.changed.wait_for(
            lambda: self.version != version or (epoch is not None and self.epoch != epoch) or self.stop, timeout_s)

    def request_stop(self) -> None:
        self.stop = True
        self.changed.fire()

    def stopped(self) -> bool:
        return self.stop
