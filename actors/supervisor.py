"""A replica as the driver supervises it: all its ranks (rank 0 the role's actor, the others `ShardFollower`s or
learner ranks), how to start them afresh, and a liveness check of each rank.

One rule for every replica of every role, sharded or not: when any rank dies, stops answering, or rank 0's loop
raises a fault, every rank of the replica is killed and started again on the same placement-group bundles under
the same names (the dashboard shows the replacements where the old ones were), in a fresh torch.distributed group.
Ray's own actor restarts are not used: one path restarts a lone actor and a replica of eight ranks alike, and a
lone rank restarted by Ray could never rejoin its peers' group. The counting and the bound are
opd/train/restarts.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from opd.train.restarts import Fault

PING_S = 2.0  # how often each rank's liveness is asked
PROBE_S = 5.0  # how long a rank may take to answer when the driver looks for the one that failed
RELEASE_S = 60.0  # how long a killed rank's name may take to be released before its replacement takes it
RESTART_TIMEOUT_S = 600.0  # a restarted replica rebuilds its models (a large target takes minutes to load)


@dataclass
class Ping:
    """The outstanding liveness call to one rank (None: the next is due at `due`)."""

    ref: Any = None
    sent: float = 0.0
    due: float = 0.0
    answered: bool = False  # a rank is timed only once it has answered once: its constructor may take minutes


@dataclass
class Replica:
    """One replica of `role`: `names[0]` is rank 0's actor name (`scorer-0`, `learner`), `launch` starts every rank
    under `names` and returns the handles in rank order; `loop` is rank 0's loop (rollout and scorer replicas)."""

    role: str
    names: list[str]
    launch: Callable[[], list]
    has_loop: bool = False
    ping_s: float = PING_S
    probe_s: float = PROBE_S
    ranks: list = field(default_factory=list)
    loop: Any = None
    pings: list[Ping] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def leader(self) -> Any:
        return self.ranks[0]

    def start(self) -> None:
        """Start every rank; the loop is launched by the driver once the run has begun."""
        self.ranks = self.launch()
        self.pings = [Ping() for _ in self.ranks]

    def ready(self) -> None:
        """Return once every rank's constructor has finished (raises the Ray error of one that failed)."""
        ray.get([rank.ready.remote() for rank in self.ranks], timeout=RESTART_TIMEOUT_S)

    def kill(self) -> None:
        """Kill every rank for good and wait until their names are free for the replacements."""
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)
        deadline = time.monotonic() + RELEASE_S
        for name in self.names:
            while _named(name) and time.monotonic() < deadline:
                time.sleep(0.2)

    def check(self, stall_s: float, now: float | None = None) -> Fault | None:
        """A fault of a rank seen by its liveness call (dead, or no answer for `stall_s` once it had answered), or
        None; sends the calls that are due."""
        now = time.monotonic() if now is None else now
        for rank, (actor, ping) in enumerate(zip(self.ranks, self.pings)):
            if ping.ref is None:
                if now >= ping.due:
                    ping.ref, ping.sent = actor.ready.remote(), now
            elif ray.wait([ping.ref], timeout=0)[0]:
                try:
                    ray.get(ping.ref)
                except ray.exceptions.RayError as exc:
                    return self.fault(rank, cause_line(exc))
                ping.ref, ping.due, ping.answered = None, now + self.ping_s, True
            elif ping.answered and now - ping.sent > stall_s:
                return self.fault(rank, f"no answer for {now - ping.sent:.0f}s: stopped or hung "
                                        f"(resources.restarts.stall_timeout_s: {stall_s:g})")
        return None

    def culprit(self, cause: str) -> Fault:
        """The fault behind rank 0's error `cause` (its loop or step raised, e.g. a collective whose peer died or
        stopped): the first rank that is dead or does not answer within `probe_s`, else rank 0 itself. The cause
        stays rank 0's error, which for a collective names the operation."""
        probes = [rank.ready.remote() for rank in self.ranks[1:]]
        ray.wait(probes, num_returns=len(probes), timeout=self.probe_s)
        for rank, probe in enumerate(probes, start=1):
            try:
                ray.get(probe, timeout=0)
            except ray.exceptions.RayError:  # dead, or no answer yet (GetTimeoutError)
                return self.fault(rank, cause)
        return self.fault(0, cause)

    def fault(self, rank: int, cause: str) -> Fault:
        return Fault(self.role, self.name, rank, cause)


def _named(name: str) -> bool:
    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


def cause_line(exc: BaseException) -> str:
    """`Type: first line` of what a rank raised (the exception a task raised, not Ray's wrapper)."""
    while isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        exc = exc.cause
    lines = [line for line in str(exc).strip().splitlines() if line.strip()] or [""]
    return f"{type(exc).__name__}: {lines[0]}".rstrip(": ")
