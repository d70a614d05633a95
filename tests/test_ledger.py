"""The run's batch ledger and the learner's reorder buffer, without Ray."""

from __future__ import annotations

import subprocess
import sys

from opd.train.ledger import Ledger, StepBuffer, VersionGate, account_metrics, fault_line, reconciles, undisturbed
from opd.train.ticket import Ticket


def ledger(first: int = 0, per_step: int = 2, lag: int = 0) -> Ledger:
    """Batch i belongs to step i // per_step and may be drafted with any version >= that step - lag."""
    return Ledger(first, lambda i: max(0, i // per_step - lag))


def test_indices_are_handed_out_in_order_and_throttled_by_the_version():
    led = ledger(first=4)
    w = led.register("rollout-0")
    assert led.claim(w, version=1) is None  # batch 4 is step 2's: version 2 needed
    assert [led.claim(w, version=2), led.claim(w, version=2)] == [Ticket(4, 0), Ticket(5, 0)]
    assert led.claim(w, version=2) is None
    assert led.claim(w, version=3) == Ticket(6, 0)


def test_a_restarted_worker_loses_what_it_held_and_it_is_reproduced_first():
    led = ledger()
    r, s = led.register("rollout-0"), led.register("scorer-0")
    for _ in range(3):
        led.claim(r, version=1)
    assert led.handoff(Ticket(0, 0), s)  # batch 0 reached the scorer: no longer the rollout's to lose
    r2 = led.register("rollout-0")  # the actor restarted: 1 and 2 died with it
    assert led.account()["orphaned"] == 2 and led.account()["restarts"] == 1
    assert led.claim(r, version=9) is None  # the old incarnation gets nothing more
    assert [led.claim(r2, version=1), led.claim(r2, version=1), led.claim(r2, version=1)] == [
        Ticket(1, 1), Ticket(2, 1), Ticket(3, 0)]
    assert not led.handoff(Ticket(1, 0), s)  # a copy of the dead attempt that still arrived is dropped
    assert led.account()["dropped"] == 1 and led.account()["reproduced"] == 2
    s2 = led.register("scorer-0")
    assert not led.handoff(Ticket(3, 0), s)  # a late message from a replaced incarnation: batch 3 goes back
    assert led.claim(r2, version=1) == Ticket(0, 1) and led.claim(r2, version=1) == Ticket(3, 1)
    assert led.handoff(Ticket(3, 1), s2) and led.account()["orphaned"] == 4  # 1, 2, then 0 and 3


def test_a_retired_replica_gives_up_what_it_held_at_once_even_if_it_never_returns():
    """rollout-1's node was lost and there is no room for it: rollout-0 produces what it held, the learner trains
    each batch once, what the dead one still reports is dropped, and the account reconciles."""
    led = ledger()
    r0, r1 = led.register("rollout-0"), led.register("rollout-1")
    assert [led.claim(r0, 1), led.claim(r1, 1), led.claim(r1, 1)] == [Ticket(0, 0), Ticket(1, 0), Ticket(2, 0)]
    led.put(Ticket(1, 0), r1, "anchors")
    assert led.retire("rollout-1") == [1, 2]
    assert led.claim(r1, 1) is None  # the lost incarnation gets nothing more
    assert [led.claim(r0, 1), led.claim(r0, 1)] == [Ticket(1, 1), Ticket(2, 1)]
    assert not led.handoff(Ticket(1, 0), "scorer-0#1")  # its payload, if it still turns up, is dropped
    led.trained([Ticket(0, 0), Ticket(1, 1), Ticket(2, 1)])
    account = led.account()
    assert (account["orphaned"], account["reproduced"], account["dropped"], account["trained"]) == (2, 2, 1, 3)
    assert reconciles(account) and led.trained_indices() == [0, 1, 2]
    r1_again = led.register("rollout-1")  # room came back: a new incarnation, nothing left to orphan
    assert led.account()["orphaned"] == 2 and led.claim(r1_again, 1) == Ticket(3, 0)


def test_lost_in_a_queue_is_reproduced_once_even_if_the_restart_reports_it_too():
    led = ledger()
    r, s = led.register("rollout-0"), led.register("scorer-0")
    led.claim(r, version=0)
    led.lost(Ticket(0, 0))  # the scorer found it dead
    r2 = led.register("rollout-0")  # then the restart: 0 is no longer held by anyone
    led.lost(Ticket(0, 0))  # and a second report of the same attempt
    assert led.claim(r2, version=0) == Ticket(0, 1)
    a = led.account()
    assert (a["lost"], a["orphaned"], a["reproduced"], a["dropped"]) == (1, 0, 1, 1)
    assert led.handoff(Ticket(0, 1), s)


def test_stale_goes_back_and_the_account_reconciles():
    led = ledger()
    r, s, learner = led.register("rollout-0"), led.register("scorer-0"), led.register("learner")
    tickets = [led.claim(r, version=0), led.claim(r, version=0)]
    for t in tickets:
        assert led.handoff(t, s) and led.handoff(t, learner)
    led.stale(tickets[0])
    assert not reconciles({**led.account(), "reproduced": 1})  # the check can fail
    redo = led.claim(r, version=0)
    assert redo == Ticket(0, 1) and led.handoff(redo, learner)
    led.trained([redo, tickets[1]])
    led.trained([redo])
    a = led.account()
    assert (a["claimed"], a["trained"], a["stale"], a["in_flight"], a["waiting"]) == (3, 2, 1, 0, 0)
    assert a["duplicates"] == 1 and not reconciles(a)
    assert led.trained_indices() == [0, 1]


def test_the_account_reconciles_through_every_kind_of_fault():
    led = ledger(lag=1)
    r, s, learner = led.register("rollout-0"), led.register("scorer-0"), led.register("learner")
    t = [led.claim(r, version=0) for _ in range(4)]
    assert led.handoff(t[0], s) and led.handoff(t[1], s)
    led.lost(t[2])
    s2 = led.register("scorer-0")  # 0 and 1 orphaned
    assert led.handoff(t[3], s2)
    assert reconciles(led.account())
    batches = [led.claim(r, version=0) for _ in range(3)]
    for b in batches:
        assert led.handoff(b, s2)
    for b in batches + [t[3]]:
        assert led.handoff(b, learner)
    led.trained(sorted(batches + [t[3]]))
    a = led.account()
    assert reconciles(a) and led.trained_indices() == [0, 1, 2, 3]
    assert (a["claimed"], a["lost"], a["orphaned"], a["reproduced"]) == (7, 1, 2, 3)


def test_the_step_buffer_releases_a_step_only_complete_fresh_and_in_index_order():
    def is_stale(item: str) -> bool:
        return item == "old"

    buf = StepBuffer(per_step=2)
    buf.add(Ticket(3, 0), "d")  # step 1's, early
    buf.add(Ticket(1, 0), "b")
    assert buf.take(0, is_stale) == (None, [])
    buf.add(Ticket(0, 0), "old")
    assert buf.take(0, is_stale) == (None, [(Ticket(0, 0), "old")])  # removed, to be re-produced
    buf.add(Ticket(0, 1), "a")
    assert buf.take(0, is_stale) == ([(Ticket(0, 1), "a"), (Ticket(1, 0), "b")], [])
    assert buf.take(1, is_stale) == (None, [])


def test_claimable_says_exactly_what_claim_would_do():
    """A waiting rollout blocks on `claimable`, so it must agree with `claim` in every state, hand-checked."""
    led = ledger(per_step=2, lag=0)
    w = led.register("rollout-0")
    assert not led.claimable(w, version=-1)  # batch 0 needs version 0
    assert led.claimable(w, version=0) and led.claim(w, version=0) == Ticket(0, 0)
    led.claim(w, version=0)
    assert not led.claimable(w, version=0) and led.claim(w, version=0) is None  # batch 2 needs version 1
    led.stale(Ticket(0, 0))  # a given-up batch 0 is claimable again at version 0
    assert led.claimable(w, version=0) and led.claim(w, version=0) == Ticket(0, 1)
    w2 = led.register("rollout-0")
    assert not led.claimable(w, version=9) and led.claim(w, version=9) is None  # a replaced incarnation
    assert led.claimable(w2, version=1)


def test_a_signal_wakes_a_waiter_when_its_predicate_turns_true_and_times_out_otherwise():
    import asyncio
    import time

    from actors.signal import Signal

    async def scenario() -> tuple[bool, float, bool, float, bool]:
        signal, state = Signal(), {"ready": False}

        async def flip() -> None:
            await asyncio.sleep(0.05)
            signal.fire()  # a change that does not satisfy the waiter: it keeps waiting
            await asyncio.sleep(0.05)
            state["ready"] = True
            signal.fire()

        t0 = time.perf_counter()
        task = asyncio.create_task(flip())
        woken = await signal.wait_for(lambda: state["ready"], timeout_s=5.0)
        woke_after = time.perf_counter() - t0
        await task
        t1 = time.perf_counter()
        timed_out = await signal.wait_for(lambda: False, timeout_s=0.2)
        waited = time.perf_counter() - t1
        return woken, woke_after, timed_out, waited, await signal.wait_for(lambda: True, timeout_s=0.0)

    woken, woke_after, timed_out, waited, at_once = asyncio.run(scenario())
    assert woken and 0.09 <= woke_after < 2.0  # woken by the second fire, not by the timeout
    assert not timed_out and 0.19 <= waited < 2.0
    assert at_once


def test_the_version_gate_releases_the_lowest_ready_batch_and_holds_the_rest():
    """Batch i needs version i // 2 (max_policy_lag 0, two batches a step); they arrive out of order."""
    gate = VersionGate(lambda i: i // 2)
    for i in (7, 2, 5, 3):
        gate.add(Ticket(i, 0), f"b{i}")
    assert gate.take(0) is None and len(gate) == 4  # every batch here needs version 1 or newer
    assert [gate.take(1), gate.take(1)] == [(Ticket(2, 0), "b2"), (Ticket(3, 0), "b3")]  # lowest first
    assert gate.take(1) is None and len(gate) == 2  # 5 and 7 wait for versions 2 and 3
    assert gate.take(3) == (Ticket(5, 0), "b5")
    assert gate.take(None) == (Ticket(7, 0), "b7") and gate.take(None) is None  # no gate: lowest of all


def test_an_undisturbed_account_reconciles_and_prints_no_line():
    account = undisturbed(6)
    assert reconciles(account) and account["trained"] == 6 and fault_line(account) is None
    assert account_metrics(account)["ledger_lost"] == 0.0 and account_metrics(account)["ledger_trained"] == 6.0


def test_a_restart_that_cost_batches_is_one_line_naming_every_count():
    led = ledger()
    r, s = led.register("rollout-0"), led.register("scorer-0")
    for _ in range(3):
        led.claim(r, version=1)
    led.handoff(Ticket(0, 0), s)
    led.lost(Ticket(0, 0))  # found dead in a queue
    led.register("rollout-0")  # restarted: 1 and 2 died with it
    assert fault_line(led.account()) == ("ledger: rollout batches lost 1, orphaned 2, stale 0, rewound 0; produced "
                                         "again 0, still waiting 3; actor restarts 1, late copies dropped 0, "
                                         "trained twice 0")
    stale_only = undisturbed(4) | {"stale": 1, "reproduced": 1, "claimed": 5}
    assert reconciles(stale_only) and fault_line(stale_only) is None  # max_policy_lag at work, not a fault


def test_a_restored_learner_rewinds_the_ledger_to_its_checkpoint():
    """Learner restarted from the checkpoint of step 1 (next batch 2, weights v1): batches 2 and 3, trained by the
    dead learner, go back (rewound, no longer trained); batch 6, in flight with the dead learner's v2, goes back
    stale and its late copy is dropped; batch 4, drafted with v1, is reused; batch 5, held by the dead learner,
    is orphaned when the new one registers. Every batch ends trained once and the account reconciles."""
    led = ledger(lag=2)
    r, s, learner = led.register("rollout-0"), led.register("scorer-0"), led.register("learner")
    for version in (0, 0, 0, 0, 1, 1, 2):  # batches 0..6, each claimed with the newest version then
        led.claim(r, version)
    for i in range(4):
        assert led.handoff(Ticket(i, 0), learner)
    led.trained([Ticket(i, 0) for i in range(4)])  # steps 1 and 2 (the checkpoint is step 1's)
    assert led.handoff(Ticket(4, 0), s) and led.handoff(Ticket(5, 0), learner)
    assert led.progress() == {"rollout-0": (1, 6), "scorer-0": (1, 0), "learner": (1, 4)}
    led.rewind(first_index=2, restored_version=1, epoch=1)
    learner2 = led.register("learner")
    a = led.account()
    assert (a["trained"], a["rewound"], a["stale"], a["orphaned"], a["waiting"]) == (2, 2, 1, 1, 4)
    assert reconciles(a) and led.trained_indices() == [0, 1] and led.progress()["learner"] == (2, 0)
    assert not led.handoff(Ticket(6, 0), s) and led.account()["dropped"] == 1  # the dead learner's v2 draft
    assert led.claim(r, version=1) is None  # with the dead learner's weights (the store's epoch before the restore)
    redo = [led.claim(r, version=1, epoch=1) for _ in range(4)]
    assert redo == [Ticket(2, 1), Ticket(3, 1), Ticket(5, 1), Ticket(6, 1)]
    for ticket in [*redo, Ticket(4, 0)]:
        assert led.handoff(ticket, learner2)
    led.trained([*redo, Ticket(4, 0)])
    a = led.account()
    assert led.trained_indices() == list(range(7)) and a["trained"] == 7 and a["duplicates"] == 0 and reconciles(a)
    assert "rewound 2;" in fault_line(a)


def test_a_batch_a_dead_consumer_took_out_of_its_queue_is_lost_not_waited_for():
    """Batches 0 and 1 were put in the anchors queue; the scorer took 0 out and died before reporting it. When it
    restarts, 0 is not in the queue and nobody holds it: lost and produced again; 1, still queued, is kept."""
    led = ledger()
    r, s = led.register("rollout-0"), led.register("scorer-0")
    tickets = [led.claim(r, version=0), led.claim(r, version=0)]
    for t in tickets:
        led.put(t, r, "anchors")
    led.put(Ticket(0, 0), s, "anchors")  # not the holder's: ignored
    assert led.missing("scored", []) == []  # another queue
    assert led.missing("anchors", [Ticket(1, 0)]) == [0]
    s2 = led.register("scorer-0")
    assert led.claim(r, version=0) == Ticket(0, 1) and led.handoff(Ticket(1, 0), s2)
    assert led.missing("anchors", []) == []  # 1 was taken: no longer queued
    a = led.account()
    assert (a["lost"], a["orphaned"]) == (1, 0) and reconciles(a)


def test_the_queue_and_ledger_actors_start_without_torch():
    """They unpickle tickets and specs only, so their processes need not import torch or the models."""
    code = "import sys, actors.queues, actors.ledger; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
