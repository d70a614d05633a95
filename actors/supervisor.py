"""A replica as the driver supervises it: its placement group, all its ranks (rank 0 the role's actor, the others
`ShardFollower`s or learner ranks), how to start them afresh, and a liveness check of each rank.

One rule for every replica of every role, sharded or not: when any rank dies, stops answering, or rank 0's loop
raises a fault, every rank of the replica is killed and started again under the same names (the dashboard shows
the replacements where the old ones were), in a fresh torch.distributed group: on the same placement-group bundles,
or, when a node it ran on is gone, in a new group wherever Ray finds room (opd/train/fleet.py decides). Ray's own
actor restarts are not used: one path restarts a lone actor and a replica of eight ranks alike, and a lone rank
restarted by Ray could never rejoin its peers' group. The counting and the bound are opd/train/restarts.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from actors.errors import cause_line, failure, is_bad_input
from opd.train.fleet import Placement
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
    """One replica of `role`: `names[0]` is rank 0's actor name (`scorer-0`, `learner`), `launch(group)` starts every
    rank under `names` on `group` (None: no group of its own, see `Placement.shared`) and returns the handles in rank
    order; `loop` is rank 0's loop (rollout and scorer replicas). `group_of` is the group a replica without one of its
    own takes bundles of (a colocated scorer: the learner's)."""

    role: str
    names: list[str]
    launch: Callable[[Any], list]
    placement: Placement = Placement(())
    has_loop: bool = False
    group_of: Callable[[], Any] = lambda: None
    ping_s: float = PING_S
    probe_s: float = PROBE_S
    ranks: list = field(default_factory=list)
    loop: Any = None
    pings: list[Ping] = field(default_factory=list)
    group: PlacementGroup | None = None
    placing: Any = None  # the group's ready() reference while Ray places it

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def leader(self) -> Any:
        return self.ranks[0]

    def request(self, near: str | None = None) -> None:
        """Ask Ray for this replica's own placement group (`near`: a node it prefers); it is placed when Ray finds
        room, now or later (`placed`)."""
        if self.placement.shared:
            return
        self.group = placement_group(self.placement.bundle_dicts, strategy=self.placement.strategy,
                                     name=f"opd-{self.name}", _soft_target_node_id=near)
        self.placing = self.group.ready()

    def placed(self, timeout_s: float = 0.0) -> bool:
        """Whether its group is placed (waiting up to `timeout_s`); one without a group of its own always is."""
        if self.placing is not None and ray.wait([self.placing], timeout=timeout_s)[0]:
            self.placing = None
        return self.placing is None

    def nodes(self) -> frozenset[str]:
        """The nodes its group's bundles were placed on (none for a replica without a group of its own)."""
        group = self.group or self.group_of()
        if group is None:
            return frozenset()
        return frozenset(ray.util.placement_group_table(group)["bundles_to_node_id"].values())

    def release(self) -> None:
        """Give its own group back (a lost node's; or at shutdown)."""
        if self.group is not None:
            remove_placement_group(self.group)
        self.group, self.placing = None, None

    def start(self) -> None:
        """Start every rank in its group; the loop is launched by the driver once the run has begun."""
        self.ranks = self.launch(self.group if self.group is not None else self.group_of())
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
                    if is_bad_input(exc):  # a constructor that raised: a restart would raise again
                        raise failure(self.name, exc) from None
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
