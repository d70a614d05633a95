"""The restart bookkeeping of a run that heals itself: which faults it restarted, how many each role and the run
may take (`resources.restarts`), the one line that names a fault, and how long each took to heal.

The driver (actors/driver.py) detects a fault (a rank dead, a rank not answering, a loop that raised) and tears
the replica or the learner down and starts it again; everything it decides from counts lives here, where a plain
test reaches it without Ray.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from opd.errors import OpdError
from opd.spec import ExperimentSpec, RestartsSpec

RESUME = "; run the same command again to resume from the last checkpoint"


@dataclass(frozen=True)
class Fault:
    """One fault as the driver saw it: the role (rollout, scorer, evaluator, learner), the replica's actor name
    (`scorer-0`, `learner`), the rank that died or hung (0 = the replica's own actor), and one line of cause
    (for a collective that timed out, PyTorch's text, which names the operation)."""

    role: str
    replica: str
    rank: int
    cause: str

    @property
    def line(self) -> str:
        return f"{self.replica} rank {self.rank} failed ({self.cause})"


@dataclass
class Restart:
    """A restart the budget admitted: its fault, when the fault was seen, the learner steps it cost (the learner's:
    steps trained after the checkpoint it restores; 0 for a replica) and, once the restarted replica passed on a
    batch or the learner took a step, how long that took."""

    fault: Fault
    seen_at: float
    node_lost: bool = False  # a node it ran on was gone: it was placed again, uncounted by the bound
    incarnation: int = 0  # the ledger's incarnation of the replica the fault ended: a later one heals it
    steps_lost: int = 0
    heal_s: float | None = None

    def as_dict(self) -> dict:
        return {**asdict(self.fault), "node_lost": self.node_lost, "steps_lost": self.steps_lost,
                "heal_s": None if self.heal_s is None else round(self.heal_s, 2)}


@dataclass
class RestartBudget:
    """How many restarts each role and the run have taken against `resources.restarts`."""

    spec: RestartsSpec
    restarts: list[Restart] = field(default_factory=list)

    def admit(self, fault: Fault, seen_at: float | None = None, *, node_lost: bool = False) -> Restart:
        """Count a restart for `fault`, or raise the run's last line when it is past a bound: the fault's own line,
        which bound, and that a rerun resumes (it restores the last checkpoint, as a restart does). A replica lost
        with its node is restarted and logged but not counted: the bound stops a fault that repeats, and a node
        that goes is no fault of the replica's."""
        counted = [r for r in self.restarts if not r.node_lost]
        role_count = sum(1 for r in counted if r.fault.role == fault.role)
        if not node_lost and role_count >= self.spec.per_role:
            raise OpdError(f"{fault.line}; the {fault.role} already restarted {role_count} time(s) "
                           f"(resources.restarts.per_role: {self.spec.per_role}){RESUME}")
        if not node_lost and len(counted) >= self.spec.per_run:
            raise OpdError(f"{fault.line}; the run already restarted {len(counted)} time(s) "
                           f"(resources.restarts.per_run: {self.spec.per_run}){RESUME}")
        restart = Restart(fault, time.monotonic() if seen_at is None else seen_at, node_lost=node_lost)
        self.restarts.append(restart)
        return restart

    def healing(self) -> list[Restart]:
        """Restarts whose replica or learner has not made progress since."""
        return [r for r in self.restarts if r.heal_s is None]

    def progressed(self, progress: dict[str, tuple[int, int]], at: float | None = None) -> list[Restart]:
        """Mark healed, and return, the restarts whose replica has a later incarnation than the fault ended that
        passed a batch on (the learner: trained one), by the ledger's `progress`."""
        healed = []
        for restart in self.healing():
            incarnation, count = progress.get(restart.fault.replica, (0, 0))
            if incarnation > restart.incarnation and count > 0:
                restart.heal_s = (time.monotonic() if at is None else at) - restart.seen_at
                healed.append(restart)
        return healed

    def log(self) -> list[dict]:
        return [r.as_dict() for r in self.restarts]


def log_restart(spec: ExperimentSpec, run_id: str, number: int, restart: Restart, step: int) -> None:
    """Record restart `number` of the run in its MLflow run: the tag `restart.N` holds its role, replica, rank,
    cause, steps lost and (logged again once healed) time to heal; the metric `restarts` counts them at the
    learner's step."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=spec.tracking_uri)
    client.set_tag(run_id, f"restart.{number}", json.dumps(restart.as_dict()))
    if restart.heal_s is None:
        client.log_metric(run_id, "restarts", number, step=step)
