"""A run across nodes that come and go: learner steps per minute against the number of rollout replicas, and the
time a lost node's replica takes to heal, on a Ray cluster simulated on this machine (`ray.cluster_utils.Cluster`:
a CPU-less head for the driver and control actors, worker nodes of 1 CPU).

    python bench/elastic.py [--config configs/tiny.yaml] [--steps 6] [--replicas 1 2 3]

Throughput: one run per rollout replica count, each role on a node of its own (learner, scorer, every rollout
replica: 1 CPU each, so the nodes say where everything is and torch runs one thread a process), timed from the
second step to the last. Heal: one run of three times the steps with two rollout replicas and a spare node, the
node of rollout-1 removed without a graceful stop after the first step ("room"), then one with no spare node,
where a node is added 20 s after the loss ("node joins later"); each timed from the removal to the replaced
replica running again (its group placed, its ranks started) and to the first batch it passes on (the ledger's
progress, polled every 0.2 s). Writes bench/results/elastic.json and elastic.md. No assertions on wall time:
every node shares this machine's cores, so more replicas add processes, not CPUs, and the numbers say what the
pipeline does, not what a cluster of real machines would.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from tqdm import tqdm  # noqa: E402

from actors.driver import RayRun  # noqa: E402
from opd.spec import ExperimentSpec, load_spec  # noqa: E402
from opd.train.ledger import reconciles  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WHOLE_NODES = ["resources.cluster.num_cpus=null", "resources.learner.num_cpus=1", "resources.scorer.num_cpus=1",
               "resources.rollout.num_cpus=1", "resources.evaluator.num_cpus=0", "eval.every=0",
               "eval.offline=false", "resources.max_policy_lag=1", "tracking.checkpoint_every=2"]
FAST_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4, "health_check_timeout_ms": 500}
JOIN_AFTER_S = 20.0


def cluster(workers: int) -> Cluster:
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                         "_system_config": FAST_DEATH})
    for _ in range(workers):
        made.add_node(num_cpus=1)
    made.wait_for_nodes()
    ray.init(address=made.address, configure_logging=False, log_to_driver=False)
    return made


def spec_for(config: str, steps: int, replicas: int) -> ExperimentSpec:
    run_dir = tempfile.mkdtemp(prefix="opd-elastic-")
    return load_spec(config, ["engine=ray", f"steps={steps}", f"resources.rollout.replicas={replicas}",
                              f"tracking.run_dir={run_dir}", *WHOLE_NODES])


def throughput(config: str, steps: int, replicas: int) -> dict:
    """Learner steps per minute with `replicas` rollout replicas, each on a node of its own."""
    made = cluster(2 + replicas)
    run = RayRun(spec_for(config, steps, replicas), track=False)
    try:
        run.start()
        run.train(1)  # the first step waits for every actor to load its models: not timed
        t0 = time.monotonic()
        run.train(steps)
        minutes = (time.monotonic() - t0) / 60
        account = ray.get(run.ledger.account.remote())
        return {"replicas": replicas, "steps_per_min": round((steps - 1) / minutes, 2),
                "seconds": round(minutes * 60, 1), "reconciles": reconciles(account)}
    finally:
        run.shutdown()
        ray.shutdown()
        made.shutdown()


class FirstBatch(threading.Thread):
    """Polls the ledger every 0.2 s for the first batch a later incarnation of `name` than `before` passes on,
    until `done` is set."""

    def __init__(self, run: RayRun, name: str, before: int) -> None:
        super().__init__(daemon=True)
        self.ray_run, self.name, self.before = run, name, before
        self.at: float | None = None
        self.done = threading.Event()

    def run(self) -> None:
        while self.at is None and not self.done.is_set():
            incarnation, passed = ray.get(self.ray_run.ledger.progress.remote()).get(self.name, (0, 0))
            if incarnation > self.before and passed > 0:
                self.at = time.monotonic()
            self.done.wait(0.2)


def heal(config: str, steps: int, spare: bool) -> dict:
    """Seconds from losing rollout-1's node to its replacement running and to its first batch: with a spare node,
    or with a node added `JOIN_AFTER_S` later. Three times the steps, so there is work left after the join."""
    made = cluster(4 + spare)
    run = RayRun(spec_for(config, 3 * steps, 2), track=False)
    try:
        run.start()
        run.train(1)
        lost = next(iter(next(r for r in run.replicas if r.name == "rollout-1").nodes()))
        first = FirstBatch(run, "rollout-1", ray.get(run.ledger.progress.remote())["rollout-1"][0])
        made.remove_node(next(n for n in made.worker_nodes if n.node_id == lost), allow_graceful=False)
        t0 = time.monotonic()
        first.start()
        step, joined = 1, spare
        while step < 3 * steps:  # a step at a time, so the node joins from this thread (Ray's node start needs it)
            step += 1
            run.train(step)
            if not joined and time.monotonic() - t0 > JOIN_AFTER_S:
                made.add_node(num_cpus=1)
                joined = True
        first.done.set()
        first.join()
        member = run.fleet.member("rollout-1")
        account = ray.get(run.ledger.account.remote())
        return {"case": "room" if spare else f"node joins {JOIN_AFTER_S:g}s later",
                "running_s": round(member.since - t0, 1) if member.state == "running" else None,
                "first_batch_s": None if first.at is None else round(first.at - t0, 1),
                "orphaned": account["orphaned"], "lost": account["lost"], "reconciles": reconciles(account)}
    finally:
        run.shutdown()
        ray.shutdown()
        made.shutdown()


def markdown(result: dict) -> str:
    lines = ["# Elastic runs on a simulated cluster (bench/elastic.py)", "",
             f"`python bench/elastic.py --config {result['config']} --steps {result['steps']}`, on this 2-core "
             "machine: every simulated node shares its cores, so more rollout replicas add processes, not CPUs.", "",
             "| rollout replicas | learner steps / min | seconds (steps 2..N) | ledger reconciles |",
             "|---|---|---|---|"]
    lines += [f"| {r['replicas']} | {r['steps_per_min']} | {r['seconds']} | {r['reconciles']} |"
              for r in result["throughput"]]
    lines += ["", "| node of rollout-1 lost | seconds until it runs again | until its first batch | orphaned | "
                  "lost in a queue | ledger reconciles |", "|---|---|---|---|---|---|"]
    lines += [f"| {h['case']} | {h['running_s']} | {h['first_batch_s']} | {h['orphaned']} | {h['lost']} | "
              f"{h['reconciles']} |" for h in result["heal"]]
    return "\n".join(lines) + "\n"


def in_fresh_process(*args: str) -> dict:
    """One measurement in a Python process of its own: a process that shut one simulated cluster down does not
    start another cleanly."""
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False)
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode or not last.startswith("{"):
        raise SystemExit(f"bench/elastic.py {' '.join(args)} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--json", default=str(RESULTS / "elastic.json"))
    parser.add_argument("--one", choices=["throughput", "heal-room", "heal-join"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:  # one measurement, printed as JSON for the parent process
        one = (throughput(args.config, args.steps, args.replicas[0]) if args.one == "throughput"
               else heal(args.config, args.steps, spare=args.one == "heal-room"))
        print(json.dumps(one), flush=True)
        return
    common = ["--config", args.config, "--steps", str(args.steps)]
    result: dict = {"config": args.config, "steps": args.steps, "throughput": [], "heal": []}
    for n in tqdm(args.replicas, desc="throughput runs"):
        result["throughput"].append(in_fresh_process("--one", "throughput", "--replicas", str(n), *common))
        tqdm.write(json.dumps(result["throughput"][-1]))
    for case in tqdm(["heal-room", "heal-join"], desc="heal runs"):
        result["heal"].append(in_fresh_process("--one", case, *common))
        tqdm.write(json.dumps(result["heal"][-1]))
    print(markdown(result))
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    Path(args.json).with_suffix(".md").write_text(markdown(result))


if __name__ == "__main__":
    main()
