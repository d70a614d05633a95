"""Time to heal: a tiny Ray run with sharded replicas and a fault injected every few steps, each timed from the
fault to the faulted role's next batch (rollout, scorer) or next step (learner), beside the time that role took to
start fresh in the same run.

    python bench/soak.py [--config configs/tiny.yaml] [--steps 12] [--every 3]

The run: `engine: ray`, the rollout and scorer replicas each 2 gloo ranks (`gpus_per_replica` 2), checkpoints
every 2 steps, max_policy_lag 0, `resources.restarts.collective_timeout_s` 15 and `stall_timeout_s` 30. Every
`--every` steps one fault from a fixed cycle: SIGKILL of the scorer's follower rank, SIGKILL of the rollout's
leader rank, SIGKILL of the learner, SIGSTOP of the scorer's follower rank (caught by the collective timeout or
the stall timeout, so its detection takes that long by design). Fresh start: from `RayRun(...)` until that
replica passed its first batch on (ledger progress) or the learner took its first step, polled every 0.2 s in a
thread. Heal: from the fault (the signal) to the restarted incarnation's first batch or step, polled the same
way. Writes bench/results/soak.json and soak.md. No assertions on wall time: the numbers depend on whatever else
the machine is doing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from actors.driver import RayRun  # noqa: E402
from opd.spec import load_spec  # noqa: E402
from opd.train.ledger import reconciles  # noqa: E402

RESULTS = Path(__file__).parent / "results"
FAULTS = [("scorer-0", 1, signal.SIGKILL), ("rollout-0", 0, signal.SIGKILL), ("learner", 0, signal.SIGKILL),
          ("scorer-0", 1, signal.SIGSTOP)]


class Progress(threading.Thread):
    """Polls the ledger's per-incarnation progress every 0.2 s: when each name first made progress (its fresh
    start), and after `expect(name, at)` (a fault at `at`) when a later incarnation of it did (its heal)."""

    def __init__(self, run: RayRun, t0: float) -> None:
        super().__init__(daemon=True)
        self.ray_run, self.t0, self.stop = run, t0, threading.Event()
        self.first: dict[str, float] = {}
        self.waiting: dict[str, tuple[float, int]] = {}  # name -> (time of its fault, incarnation it ended)
        self.healed: dict[str, list[float]] = {}
        self.seen: dict[str, tuple[int, int]] = {}

    def expect(self, name: str, at: float) -> None:
        self.waiting[name] = (at, self.seen.get(name, (0, 0))[0])

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.seen = ray.get(self.ray_run.ledger.progress.remote())
            except ray.exceptions.RayError:  # not begun yet (the learner opens it), or gone at shutdown
                time.sleep(0.2)
                continue
            now = time.monotonic()
            for name, (incarnation, count) in self.seen.items():
                if count > 0:
                    self.first.setdefault(name, now - self.t0)
                if name in self.waiting and incarnation > self.waiting[name][1] and count > 0:
                    self.healed.setdefault(name, []).append(now - self.waiting.pop(name)[0])
            time.sleep(0.2)


def pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def soak(config: str, steps: int, every: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="opd-soak-"))
    sets = ["engine=ray", f"steps={steps}", "eval.every=0", "eval.offline=false", "resources.max_policy_lag=0",
            "resources.queue_size=1", "tracking.checkpoint_every=2", f"tracking.run_dir={out}",
            "resources.cluster.num_cpus=4", "resources.rollout.gpus_per_replica=2",
            "resources.scorer.gpus_per_replica=2", "resources.restarts.collective_timeout_s=15",
            "resources.restarts.stall_timeout_s=30", "resources.restarts.per_role=4"]
    spec = load_spec(config, sets)
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    t0 = time.monotonic()
    run = RayRun(spec, track=False)
    poll = Progress(run, t0)
    poll.start()
    stopped: list[int] = []
    faults: list[dict] = []
    try:
        run.start()
        cycle = iter(FAULTS * steps)
        for until in range(every, steps + every, every):
            run.train(min(until, steps))
            if until >= steps:
                break
            name, index, sig = next(cycle)
            replica = run.learners if name == "learner" else next(r for r in run.replicas if r.name == name)
            target = pid(replica.ranks[index])
            poll.expect(name, time.monotonic())
            os.kill(target, sig)
            if sig == signal.SIGSTOP:
                stopped.append(target)
            faults.append({"replica": name, "rank": index, "signal": signal.Signals(sig).name, "at_step": until})
        deadline = time.monotonic() + 60
        while poll.waiting and time.monotonic() < deadline:
            time.sleep(0.2)
        ledger = ray.get(run.ledger.account.remote())
        restarts = run.budget.log()
    finally:
        poll.stop.set()
        run.shutdown()
        for p in stopped:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
        ray.shutdown()
    for fault in faults:
        heals = poll.healed.get(fault["replica"], [])
        fault["heal_s"] = round(heals.pop(0), 2) if heals else None
        fault["fresh_start_s"] = round(poll.first[fault["replica"]], 2) if fault["replica"] in poll.first else None
    return {"config": config, "steps": steps, "every": every, "sets": sets, "faults": faults,
            "restarts": restarts, "ledger": ledger, "reconciles": reconciles(ledger),
            "fresh_start_s": {k: round(v, 2) for k, v in poll.first.items()}}


def markdown(result: dict) -> str:
    rows = ["| fault | at step | heal: signal → next batch / step, s | of which after detection, s | fresh start "
            "of the role, s | heal − fresh, s | steps lost | cause the driver logged |",
            "|---|---|---|---|---|---|---|---|"]
    for fault, restart in zip(result["faults"], result["restarts"]):
        heal, fresh = fault["heal_s"], fault["fresh_start_s"]
        delta = f"{heal - fresh:+.1f}" if heal is not None and fresh is not None else "–"
        rows.append(f"| {fault['signal']} {fault['replica']} rank {fault['rank']} | {fault['at_step']} | "
                    f"{_s(heal)} | {_s(restart['heal_s'])} | {_s(fresh)} | {delta} | {restart['steps_lost']} | "
                    f"`{restart['cause'][:100]}` |")
    ledger = result["ledger"]
    return "\n".join([
        f"# Soak: {result['config']}, {result['steps']} steps, a fault every {result['every']} steps", "",
        *rows, "",
        f"Ledger: trained {ledger['trained']}, lost {ledger['lost']}, orphaned {ledger['orphaned']}, stale "
        f"{ledger['stale']}, rewound {ledger['rewound']}, reproduced {ledger['reproduced']}, dropped "
        f"{ledger['dropped']}, trained twice {ledger['duplicates']}; reconciles: {result['reconciles']}.", "",
        "Fresh start: from `RayRun(...)` to the role's first batch passed on (the learner: its first step), which "
        "includes starting every actor of the run at once on the same cores. Heal: from the signal to the "
        "restarted incarnation's first batch or step: detection (a liveness call every 2 s, the collective "
        "timeout or the stall timeout for a stopped rank), killing the ranks and waiting for their names, "
        "starting the processes, loading the target again, rebuilding the process group and producing one batch "
        "(the learner: restoring its checkpoint and retraining the steps since). Both scale with the target's "
        "load time: a restart reloads the target, so on a real target heal ≈ detection + load + one batch, and "
        "the learner's also + the steps since its last checkpoint.", ""])


def _s(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    args = parser.parse_args()
    result = soak(args.config, args.steps, args.every)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "soak.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
