"""Where every rollout batch of a run is, so a restarted actor costs a re-production, never a lost or doubled batch.

The data cursor is the batch index (opd/train/rollout.py): batch i holds the same prompts and seeds whoever
produces it, so a batch that died with its holder is simply produced again. The `Ledger` (one per run, hosted
by `actors/ledger.py`) hands out indices, knows which worker incarnation holds the current attempt of each, and
keeps one account:

    claimed = trained + lost + orphaned + stale + rewound + in flight     (every claim is one production attempt)
    reproduced = lost + orphaned + stale + rewound - waiting              (every attempt given up is produced again)

An attempt is given up when a consumer reports it `lost` (its producer died while it sat in a queue, or its
consumer died after taking it out of the queue, before reporting it: `missing`), when the
incarnation holding it is replaced (`orphaned`: its actor restarted), or when the learner sends it back as
`stale`. A copy of a given-up attempt that still turns up anywhere is `dropped`, never trained. A learner that
restarts in the run restores its last checkpoint, and `rewind` hands back what it trained since (`rewound`: no
longer counted trained, produced and trained again, so the final drafter trained each batch once) and what is in
flight with weights the restored learner never had (`stale`, by `policy_lag.survives_restore`).

`StepBuffer` is the learner's side: batches arrive in any order, steps take them strictly by index.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from opd.train.policy_lag import survives_restore
from opd.train.ticket import Ticket


@dataclass
class LedgerCounts:
    claimed: int = 0  # production attempts handed out
    reproduced: int = 0  # of which re-productions of a given-up batch
    trained: int = 0  # batches the learner trained on
    lost: int = 0  # attempts a consumer found dead in a queue (their producer died)
    orphaned: int = 0  # attempts held by an incarnation that a restart replaced
    stale: int = 0  # attempts the learner sent back for exceeding max_policy_lag
    dropped: int = 0  # copies of given-up (or unknown) attempts that still arrived; thrown away
    duplicates: int = 0  # batches reported trained twice (a bug if ever non-zero)
    rewound: int = 0  # batches a restarted learner trains again: trained after the checkpoint it restored
    restarts: int = 0  # loop launches that replaced an earlier incarnation of the same actor


class Ledger:
    """Hands out batch indices and keeps the account; `required(index)` is the oldest published version with which
    batch `index` may be started (rollout.claim_version), so a claim never outruns max_policy_lag."""

    def __init__(self, first_index: int, required: Callable[[int], int]) -> None:
        self.next, self.required = first_index, required
        self.epoch = 0  # the weight store's epoch (its restores); a claim with weights of another is refused
        self.attempt: dict[int, int] = {}  # index -> its current attempt, until trained
        self.holder: dict[int, str] = {}  # index -> worker holding that attempt (absent while waiting for redo)
        self.redo: list[int] = []  # heap of given-up indices waiting to be produced again
        self.done: set[int] = set()
        self.incarnation: dict[str, int] = {}  # actor name -> its live incarnation
        self.claimed_with: dict[int, int] = {}  # index -> draft version its current attempt was claimed with
        self.passed: dict[str, int] = {}  # worker id -> batches it passed on (a producer) or trained (the learner)
        self.queued: dict[int, str] = {}  # index -> the queue its holder put it in, until a consumer takes it
        self.counts = LedgerCounts()

    def register(self, name: str) -> str:
        """A worker loop (re)starting under `name` gets a new id; whatever an earlier incarnation held and had not
        passed on died with it, so it goes back for re-production."""
        n = self.incarnation.get(name, 0) + 1
        self.incarnation[name] = n
        if n > 1:
            self.counts.restarts += 1
            for index in [i for i, w in self.holder.items() if _name(w) == name]:
                self._redo(index)
                self.counts.orphaned += 1
        return f"{name}#{n}"

    def retire(self, name: str) -> list[int]:
        """The incarnation running under `name` is gone (killed to restart, or lost with its node, perhaps for the
        rest of the run): what it held goes back for re-production by whoever claims next, and anything it still
        reports is dropped. Returns the indices given up."""
        self.incarnation[name] = self.incarnation.get(name, 0) + 1
        held = [i for i, w in self.holder.items() if _name(w) == name]
        for index in held:
            self._redo(index)
            self.counts.orphaned += 1
        return held

    def claimable(self, worker: str, version: int) -> bool:
        """Whether `claim(worker, version)` would hand out a batch now (a waiting worker blocks on this)."""
        index = self.redo[0] if self.redo else self.next
        return self._live(worker) and self.required(index) <= version

    def claim(self, worker: str, version: int, epoch: int = 0) -> Ticket | None:
        """The lowest index waiting for re-production, else the next new one; None while drafting it would need
        a newer version than `version` (or the worker is a replaced incarnation, or `version` is of another
        `epoch` of the weight store than the learner's: weights of a learner that restarted since)."""
        if epoch != self.epoch or not self.claimable(worker, version):
            return None
        index = self.redo[0] if self.redo else self.next
        if self.redo:
            heapq.heappop(self.redo)
            self.counts.reproduced += 1
        else:
            self.next += 1
            self.attempt[index] = 0
        self.holder[index] = worker
        self.claimed_with[index] = version
        self.counts.claimed += 1
        return Ticket(index, self.attempt[index])

    def handoff(self, ticket: Ticket, worker: str) -> bool:
        """`worker` took `ticket` out of a queue and now holds it. False means drop it: a copy of a given-up
        attempt (its re-production is on its way), or taken by a replaced incarnation, which cannot be trusted to
        pass it on (so it goes back for re-production now rather than never arriving)."""
        if not self._current(ticket):
            self.counts.dropped += 1
            return False
        if not self._live(worker):
            self._redo(ticket.index)
            self.counts.orphaned += 1
            return False
        self._passed(self.holder[ticket.index])
        self.holder[ticket.index] = worker
        self.queued.pop(ticket.index, None)
        return True

    def put(self, ticket: Ticket, worker: str, queue: str) -> None:
        """`worker` put `ticket` in `queue` (unless a consumer has taken it already)."""
        if self._current(ticket) and self.holder[ticket.index] == worker:
            self.queued[ticket.index] = queue

    def missing(self, queue: str, present: Iterable[Ticket]) -> list[int]:
        """A consumer of `queue` died: a queue hands an item out before its consumer reports taking it, so an
        attempt put in `queue` that is no longer there (`present`) and that nobody took was lost with that
        consumer: give it up as `lost`. One a live consumer took but had not yet reported is given up too; its
        report then finds it replaced and drops it (waste, never a loss)."""
        there = set(present)
        gone = [i for i, q in self.queued.items() if q == queue and Ticket(i, self.attempt[i]) not in there]
        for index in gone:
            self._redo(index)
            self.counts.lost += 1
        return gone

    def lost(self, ticket: Ticket) -> None:
        """A consumer found the payload dead (its producer died with it enqueued)."""
        self._give_up(ticket, "lost")

    def stale(self, ticket: Ticket) -> None:
        """The learner will not train on it (too old for max_policy_lag); a fresh copy is produced instead."""
        self._give_up(ticket, "stale")

    def trained(self, tickets: Iterable[Ticket]) -> None:
        for ticket in tickets:
            if ticket.index in self.done:
                self.counts.duplicates += 1
                continue
            self.done.add(ticket.index)
            if (worker := self.holder.pop(ticket.index, None)) is not None:
                self._passed(worker)
            self.queued.pop(ticket.index, None)
            self.counts.trained += 1

    def rewind(self, first_index: int, restored_version: int, epoch: int) -> None:
        """A learner restarted from the checkpoint whose next batch is `first_index` and whose published weights
        are `restored_version`: what it trained from `first_index` on goes back for training again (`rewound`), and
        an attempt in flight that was drafted with weights it never had goes back as `stale` (its copy, if it still
        arrives, is dropped). What it held itself is orphaned when it registers again. From now on claims must
        come with the weight store's `epoch` of the restore."""
        self.epoch = epoch
        for index in sorted(i for i in self.done if i >= first_index):
            self.done.discard(index)
            self.counts.trained -= 1
            self.counts.rewound += 1
            self.attempt[index] += 1
            heapq.heappush(self.redo, index)
        for index in [i for i in self.holder if not survives_restore(self.claimed_with[i], restored_version)]:
            self._redo(index)
            self.counts.stale += 1

    def progress(self) -> dict[str, tuple[int, int]]:
        """(incarnation, batches it passed on or trained) of each worker's live incarnation: a restarted one has
        healed once a later incarnation's count moves."""
        return {name: (n, self.passed.get(f"{name}#{n}", 0)) for name, n in self.incarnation.items()}

    def account(self) -> dict[str, int]:
        """The counts plus what is in flight and waiting; `reconciles(account)` checks the two equations."""
        return {**vars(self.counts), "in_flight": len(self.holder), "waiting": len(self.redo)}

    def trained_indices(self) -> list[int]:
        return sorted(self.done)

    def holders(self) -> dict[int, str]:
        return dict(self.holder)

    def _passed(self, worker: str) -> None:
        self.passed[worker] = self.passed.get(worker, 0) + 1

    def _give_up(self, ticket: Ticket, reason: str) -> None:
        if not self._current(ticket):
            self.counts.dropped += 1
            return
        self._redo(ticket.index)
        setattr(self.counts, reason, getattr(self.counts, reason) + 1)

    def _redo(self, index: int) -> None:
        self.attempt[index] += 1
        del self.holder[index]
        self.queued.pop(index, None)
        heapq.heappush(self.redo, index)

    def _current(self, ticket: Ticket) -> bool:
        return ticket.index in self.holder and self.attempt[ticket.index] == ticket.attempt

    def _live(self, worker: str) -> bool:
        return f"{_name(worker)}#{self.incarnation.get(_name(worker))}" == worker


def reconciles(account: dict[str, int]) -> bool:
    """Every attempt ended exactly once (trained, given up, or still in flight), every given-up one was produced
    again or is waiting to be, and no batch was trained twice."""
    a = account
    given_up = a["lost"] + a["orphaned"] + a["stale"] + a["rewound"]
    return (a["claimed"] == a["trained"] + given_up + a["in_flight"]
            and a["reproduced"] == given_up - a["waiting"] and a["duplicates"] == 0)


def undisturbed(trained: int) -> dict[str, int]:
    """The account of `trained` batches each produced once and trained once: the local engine's, which drafts
    every batch in its own process, so there is no actor to lose one."""
    return Ledger(0, lambda index: 0).account() | {"claimed": trained, "trained": trained}


def account_metrics(account: dict[str, int]) -> dict[str, float]:
    """The account as MLflow metrics, `ledger_lost` and so on."""
    return {f"ledger_{name}": float(count) for name, count in account.items()}


def fault_line(account: dict[str, int]) -> str | None:
    """One line for a run in which an actor died or a batch was lost, saying what became of its batches; None
    for an undisturbed run. A batch lost with its producer is produced again, so the steps do not show it: only
    this line, and the account in MLflow and summary.json, do."""
    a = account
    if not (a["lost"] or a["orphaned"] or a["restarts"] or a["rewound"]):
        return None
    return (f"ledger: rollout batches lost {a['lost']}, orphaned {a['orphaned']}, stale {a['stale']}, rewound "
            f"{a['rewound']}; produced again {a['reproduced']}, still waiting {a['waiting']}; actor restarts "
            f"{a['restarts']}, late copies dropped {a['dropped']}, trained twice {a['duplicates']}")


def _name(worker: str) -> str:
    return worker.rpartition("#")[0]


class StepBuffer:
    """The learner's reorder buffer. Batches arrive in any order (several rollout replicas, re-productions), but
    step s trains on exactly indices s*per_step .. (s+1)*per_step - 1, so the steps a run takes do not depend on
    timing, and a missing batch never lets a later one jump the queue."""

    def __init__(self, per_step: int) -> None:
        self.per_step = per_step
        self.waiting: dict[int, tuple[Ticket, Any]] = {}

    def add(self, ticket: Ticket, item: Any) -> None:
        self.waiting[ticket.index] = (ticket, item)

    def take(self, step: int, is_stale: Callable[[Any], bool]) -> tuple[list[tuple[Ticket, Any]] | None,
                                                                       list[tuple[Ticket, Any]]]:
        """(step's entries by index if all arrived and none is stale, else None; the stale ones, removed here so
        they can be re-produced)."""
        wanted = range(step * self.per_step, (step + 1) * self.per_step)
        stale = [self.waiting.pop(i) for i in wanted if i in self.waiting and is_stale(self.waiting[i][1])]
        if stale or any(i not in self.waiting for i in wanted):
            return None, stale
        return [self.waiting.pop(i) for i in wanted], []


class VersionGate:
    """The scorer's reorder buffer with a rebuilt rollout source: batches arrive in any order, and each may be
    rebuilt only once the version max_policy_lag needs for it (`required(index)`) is published. The lowest ready
    index goes first, and waiting batches never stop new ones from being taken in, so a later batch cannot hold
    up an earlier one the learner waits for."""

    def __init__(self, required: Callable[[int], int]) -> None:
        self.required = required
        self.waiting: dict[int, tuple[Ticket, Any]] = {}

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, ticket: Ticket, item: Any) -> None:
        self.waiting[ticket.index] = (ticket, item)

    def take(self, version: int | None) -> tuple[Ticket, Any] | None:
        """The lowest-index entry that `version` may rebuild (None: no gate, the lowest of all), or None."""
        ready = [i for i in self.waiting if version is None or self.required(i) <= version]
        return self.waiting.pop(min(ready)) if ready else None

    def clear(self) -> None:
        self.waiting.clear()
