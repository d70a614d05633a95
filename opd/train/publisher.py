"""The learner's weight publisher: it finishes each `WeightSnapshot` (CPU copy, checksum) and hands it on off the
step's critical path.

A Qwen3-4B drafter is ~1 GB in bf16: copying it to the CPU and CRC-32-ing it is too slow to sit in the step
(bench/results/scale.md times the whole publish), and the Ray engine then puts it in the object store and tells the
weight store, at every publication. The step only takes a copy the next optimizer step cannot change: a clone on the
weights' own device (on a GPU a millisecond of memory bandwidth; on the CPU it is the CPU copy itself). One background
thread does the rest, in version order, then calls `sink` (the Ray engine's weight store; none in the local engine,
whose rollout reads `latest`).

At most one publication is pending: the next `submit` waits for it, which bounds the extra memory to one copy of
the weights and is where the loop waits when publishing takes longer than the steps between two publications.
`latest` waits for the pending one (checkpoints, evaluations and the local engine need the finished snapshot). A
failure in the thread surfaces in the learner at its next `check`, `submit` or `latest`, as one OpdError line.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from opd.errors import OpdError
from opd.train.messages import WeightSnapshot, checksum


class Publisher:
    """Publishes draft weights from one background thread; `first` is the snapshot already published."""

    def __init__(self, first: WeightSnapshot, sink: Callable[[WeightSnapshot], None] | None = None) -> None:
        self._latest, self._sink = first, sink
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opd-publisher")
        self._pending: tuple[int, Future[WeightSnapshot]] | None = None
        self.waited_s = 0.0  # learner time spent waiting for a pending publication

    def submit(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Publish `state` as `version` (after waiting for the previous publication): the tensors are cloned here,
        so the caller may change them as soon as this returns."""
        self._wait()
        frozen = {k: v.detach().clone() for k, v in state.items()}
        self._pending = version, self._pool.submit(self._finish, frozen, version)

    def latest(self) -> WeightSnapshot:
        """The newest snapshot, once published (waits for a pending publication)."""
        self._wait()
        return self._latest

    def replace(self, snapshot: WeightSnapshot) -> None:
        """Take `snapshot` as the one published (a resumed run's), after any pending publication."""
        self._wait()
        self._latest = snapshot

    def check(self) -> None:
        """Raise what a finished publication raised; never waits."""
        if self._pending is not None and self._pending[1].done():
            self._wait()

    def close(self) -> None:
        """Wait for the pending publication (so the last version reaches the sink), then stop the thread."""
        try:
            self._wait()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _finish(self, frozen: dict[str, torch.Tensor], version: int) -> WeightSnapshot:
        """In the thread: the CPU copy (none when `frozen` is already on the CPU), the checksum, then the sink."""
        cpu = {k: v.to("cpu") for k, v in frozen.items()}
        snapshot = WeightSnapshot(version, cpu, checksum(cpu))
        if self._sink is not None:
            self._sink(snapshot)
        return snapshot

    def _wait(self) -> None:
        if self._pending is None:
            return
        (version, future), self._pending = self._pending, None
        t0 = time.perf_counter()
        try:
            self._latest = future.result()
        except Exception as e:
            first = next(iter(str(e).splitlines()), "")  # Ray's errors run over several lines
            raise OpdError(f"weight publication v{version} failed: {type(e).__name__}: {first}") from e
        finally:
            self.waited_s += time.perf_counter() - t0
