"""Decoupled asynchronous Ray training versus the synchronous local loop: the same steps, wall time and throughput.

    python bench/pipeline.py [--steps 6] [--max-new-tokens 64] [--drafter auto|random|warm]
                             [--target auto|shipped|random] [--threads 1] [--arms local,ray1,ray2]

Three arms run in this one process, each for the same number of optimizer steps and each in its own temporary
run directory (tracking off, eval.every=0):

1. local: `LocalTrainer` (engine local): rollout -> replay -> loss -> step, one after the other;
2. ray, 1 rollout replica: `RayRun` with max_policy_lag 1 and queue_size 4;
3. ray, 2 rollout replicas: the same with two rollout actors.

Reported per arm: start-up seconds (building models / actors, the learner's pre-training eval and, for Ray,
`RayRun.start()`), train seconds (only the training steps; the final step includes the learner's end-of-run
eval and checkpoint, kept small and the same in every arm), trained anchors/s and rollout tokens/s (committed
response tokens of trained batches) over the train seconds, the learner's idle fraction (time waiting for data /
(waiting + training); the local loop never waits, so 0 by construction), stale batches and the policy-lag
distribution from the per-step reports (always 0 locally). Ray is started once here with 2 CPUs; each role
asks for `--role-cpus` so that 2 rollout replicas + scorer + learner fit. The local arm runs with `--threads`
torch threads (default 1, like each Ray actor): on a 2-core machine that is busy with other work, two
oversubscribed intra-op threads can make every forward many times slower. Writes bench/results/pipeline.json.
No assertions on wall time: the numbers depend on whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from opd.spec import ExperimentSpec, load_spec

RESULTS = Path(__file__).parent / "results" / "pipeline.json"
NOTE = ("On a 2-core machine every role (rollout replicas, scorer, learner) competes for the same two cores, so "
        "extra rollout replicas cannot add throughput: they only split the cores further and add queueing, weight "
        "broadcasts and object-store traffic. The asynchronous path's benefit, overlapping rollout, teacher scoring "
        "and learning, needs as many cores/GPUs as roles; here any gain over the local loop is bounded by the two "
        "cores (the local loop runs {threads} torch thread(s)), which are also shared with whatever else is running.")


def measured(rows: list[dict]) -> str:
    rate = {r["arm"]: r["anchors_per_s"] for r in rows}
    parts = []
    if "local" in rate and "ray, 1 rollout" in rate:
        parts.append(f"ray with 1 rollout replica trains {rate['ray, 1 rollout'] / rate['local']:.2f}x the local "
                     "loop's anchors/s")
    if "ray, 1 rollout" in rate and "ray, 2 rollout" in rate:
        parts.append(f"2 rollout replicas give {rate['ray, 2 rollout'] / rate['ray, 1 rollout']:.2f}x the anchors/s "
                     "of 1")
    return "Measured: " + "; ".join(parts) + "." if parts else ""


# ------------------------------------------------------------------------------------------------ specs


def shipped_target_ready(spec: ExperimentSpec) -> bool:
    return any(Path(spec.models.target_path).glob("model*.safetensors"))


def write_random_target(spec: ExperimentSpec, out: Path) -> str:
    """A random Qwen3 target shaped like the shipped one, saved as an HF directory so Ray actors can load it
    (built as bench/replay.py's --random-target does); the shipped tokenizer is used beside it."""
    sys.path.insert(0, str(Path(__file__).parent))
    from replay import random_models

    from opd.data.prompts import load_tokenizer

    target, _, shape = random_models(spec, spec.seed)
    target.model.config.eos_token_id = load_tokenizer(spec.models.tokenizer).eos_token_id
    target.model.save_pretrained(out)
    return shape


def arm_spec(base: list[str], args, run_dir: Path, *, engine: str, replicas: int = 1) -> ExperimentSpec:
    cpus = args.role_cpus
    sets = base + [f"engine={engine}", f"steps={args.steps}", f"tracking.run_dir={run_dir / '{name}'}",
                   "resources.cluster.num_cpus=2", f"resources.rollout.replicas={replicas}",
                   f"resources.rollout.num_cpus={cpus}", f"resources.scorer.num_cpus={cpus}",
                   f"resources.learner.num_cpus={cpus}", "resources.max_policy_lag=1", "resources.queue_size=4"]
    return load_spec(args.config, sets)


# ------------------------------------------------------------------------------------------------ arms


def summarize(name: str, startup_s: float, train_s: float, counters: dict, reports: list[dict],
              idle_note: str = "") -> dict:
    lags = Counter(int(r["metrics"]["policy_lag"]) for r in reports)
    idle, busy = counters["idle_s"], counters["busy_s"]
    return {
        "arm": name, "steps": len(reports), "startup_s": startup_s, "train_s": train_s,
        "trained_batches": counters["trained_batches"], "stale_batches": counters["stale_batches"],
        "trained_sequences": counters["trained_sequences"], "trained_anchors": counters["trained_anchors"],
        "trained_tokens": counters["trained_tokens"],
        "anchors_per_s": counters["trained_anchors"] / train_s, "tokens_per_s": counters["trained_tokens"] / train_s,
        "idle_s": idle, "busy_s": busy, "idle_fraction": idle / max(1e-9, idle + busy), "idle_note": idle_note,
        "policy_lag": {str(k): v for k, v in sorted(lags.items())},
        "step_time_s": [r["metrics"]["step_time_s"] for r in reports],
        "rollout_tau": sum(r["metrics"]["rollout_tau"] for r in reports) / max(1, len(reports)),
        "losses": [r["metrics"]["loss"] for r in reports],
    }


def run_local(spec: ExperimentSpec) -> dict:
    from opd.train.local import LocalTrainer

    t0 = time.perf_counter()
    trainer = LocalTrainer(spec, track=False)
    s = trainer.session
    trainer.start()  # resume or, fresh, the step-0 eval, as LocalTrainer.run and the Ray learner's start do
    t1 = time.perf_counter()
    reports = []
    while s.step < spec.steps:
        r = trainer.train_step()
        reports.append({"step": r.step, "metrics": r.metrics})
    t2 = time.perf_counter()
    s.close()
    return summarize("local", t1 - t0, t2 - t1, vars(s.counters), reports,
                     idle_note="0 by construction: the loop produces each batch before it trains on it")


def run_ray_arm(spec: ExperimentSpec, name: str) -> dict:
    import ray

    from actors.driver import RayRun

    t0 = time.perf_counter()
    run = RayRun(spec, track=False)
    try:
        actors = [run.learner, *run.scorers, *run.rollouts]
        ray.get([a.__ray_ready__.remote() for a in actors])  # every actor has loaded its models
        assert run.start() == 0, "a fresh run directory must start at step 0"
        t1 = time.perf_counter()
        reports = run.train(spec.steps)
        t2 = time.perf_counter()
        counters = ray.get(run.learner.counters.remote())
    finally:
        t3 = time.perf_counter()
        run.shutdown()
        shutdown_s = time.perf_counter() - t3
    row = summarize(name, t1 - t0, t2 - t1, counters, reports)
    row["shutdown_s"] = shutdown_s
    return row


def actor_threads(num_cpus: float) -> int:
    """torch intra-op threads inside a Ray worker with this CPU request (Ray sets OMP_NUM_THREADS)."""
    import ray

    @ray.remote(num_cpus=num_cpus)
    def threads() -> int:
        import torch

        return torch.get_num_threads()

    return ray.get(threads.remote())


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-paper.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="rollout.max_new_tokens")
    parser.add_argument("--drafter", choices=("auto", "random", "warm"), default="auto",
                        help="auto: the warm drafter if <drafter_path>/config.json exists, else a random one")
    parser.add_argument("--target", choices=("auto", "shipped", "random"), default="auto",
                        help="auto: the shipped target if its model*.safetensors exist, else a random one of its shape")
    parser.add_argument("--role-cpus", type=float, default=0.4,
                        help="Ray CPUs per rollout replica, scorer and learner (2 x rollout + 2 must fit 2 CPUs)")
    parser.add_argument("--arms", default="local,ray1,ray2", help="subset of local,ray1,ray2")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads of this process, i.e. the local arm (0 = torch's default); "
                             "1 matches the Ray actors, which Ray gives OMP_NUM_THREADS=1 for a fractional CPU")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    wall0 = time.perf_counter()
    load0 = os.getloadavg()

    spec = load_spec(args.config, check_paths=False)
    base = [f"rollout.max_new_tokens={args.max_new_tokens}", "eval.every=0",
            # the end-of-run eval lands inside the last training step of every arm: keep it small
            "eval.num_prompts=4", "eval.max_new_tokens=16", "eval.batch_size=4",
            "eval.sampling=[{name: greedy, temperature: 0.0}]"]
    warm = spec.models.drafter_path and Path(spec.models.drafter_path, "config.json").is_file()
    if args.drafter == "warm" and not warm:
        parser.error(f"--drafter warm: {spec.models.drafter_path}/config.json not found")
    drafter = "warm" if args.drafter == "warm" or (args.drafter == "auto" and warm) else "random"
    if drafter == "random":
        base.append("models.drafter_path=")  # None: a drafter freshly initialised from the seed
    if args.target == "shipped" and not shipped_target_ready(spec):
        parser.error(f"--target shipped: no {spec.models.target_path}/model*.safetensors yet")
    random_target = args.target == "random" or (args.target == "auto" and not shipped_target_ready(spec))

    arms = args.arms.split(",")
    rows, scratch = [], Path(tempfile.mkdtemp(prefix="opd-pipeline-"))
    try:
        target_name = spec.models.target_path
        if random_target:
            target_name = f"{write_random_target(spec, scratch / 'target')} ({scratch / 'target'})"
            base += [f"models.target_path={scratch / 'target'}", f"models.tokenizer_path={spec.models.tokenizer}"]
        if "local" in arms:
            rows.append(run_local(arm_spec(base, args, scratch / "local", engine="local")))
        threads = None
        if {"ray1", "ray2"} & set(arms):
            import ray

            ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
            threads = actor_threads(args.role_cpus)
            for replicas in (1, 2):
                if f"ray{replicas}" in arms:
                    rows.append(run_ray_arm(arm_spec(base, args, scratch / f"ray{replicas}", engine="ray",
                                                     replicas=replicas), f"ray, {replicas} rollout"))
            ray.shutdown()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wall = time.perf_counter() - wall0

    table = Table(title=f"Pipeline: {args.steps} steps, target {target_name}, drafter {drafter}, "
                        f"rollout batch 8 x {args.max_new_tokens} new tokens, {os.cpu_count()} cores\n"
                        f"local torch threads {torch.get_num_threads()}, Ray actor threads {threads}, "
                        f"{args.role_cpus} CPU per role; load avg at start {load0[0]:.2f}")
    columns = [("arm", "arm"), ("startup_s", "start-up s"), ("train_s", "train s"), ("anchors_per_s", "anchors/s"),
               ("tokens_per_s", "rollout tok/s"), ("idle_fraction", "learner idle"), ("stale_batches", "stale"),
               ("policy_lag", "policy lag {lag: steps}"), ("rollout_tau", "rollout τ")]
    for _, title in columns:
        table.add_column(title, justify="right")
    for r in rows:
        cells = []
        for key, _ in columns:
            v = r[key]
            if key == "idle_fraction" and r["arm"] == "local":
                cells.append("0 (by construction)")
            elif key == "policy_lag":
                cells.append(", ".join(f"{k}: {n}" for k, n in v.items()))
            else:
                cells.append(f"{v:.2f}" if isinstance(v, float) else str(v))
        table.add_row(*cells)
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    note = NOTE.format(threads=torch.get_num_threads())
    console.print(f"Note: {note}")
    if measured(rows):
        console.print(measured(rows))
    print(f"total wall time {wall:.0f}s")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "config": args.config, "steps": args.steps, "max_new_tokens": args.max_new_tokens, "drafter": drafter,
        "target": target_name, "random_target": random_target, "role_cpus": args.role_cpus,
        "cores": os.cpu_count(), "local_torch_threads": torch.get_num_threads(), "ray_actor_torch_threads": threads,
        "loadavg_start": load0, "loadavg_end": os.getloadavg(), "overrides": base, "wall_s": wall,
        "note": note, "measured": measured(rows), "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
