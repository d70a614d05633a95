"""`opd reproduce`: the paper's central claims in miniature, every arm at matched training FLOPs over seeds.

The full Draft-OPD arm runs `opd_steps` optimizer steps and sets, per seed, the FLOP budget (rollout + teacher
replay + drafter training, `opd/models/flops.py`). Every other arm — continued SFT and the ablations — starts
from the same warm drafter and trains until it has spent that budget, with held-out greedy τ measured whenever
it crosses the marks where the full arm was measured, so the curves share their x-axis. Arms run in a pool of
worker processes; each finished (arm, seed) is saved, so a killed reproduction resumes where it stopped.

Modules: `spec` (the YAML spec, one job, one result), `arms` (one arm in a worker), `pool` (the job pool),
`report` (the tables and plots); each imports only those before it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from opd.reproduce.arms import run_arm
from opd.reproduce.pool import run_jobs
from opd.reproduce.report import write_report
from opd.reproduce.spec import BUDGET_ARM, ArmJob, ArmResult, ArmSpec, ReproduceSpec, load_reproduce_spec
from opd.run_dir import RunDirLock
from opd.spec import load_spec

__all__ = ["BUDGET_ARM", "ArmJob", "ArmResult", "ArmSpec", "ReproduceSpec", "load_reproduce_spec", "run_arm",
           "run_jobs", "run_reproduce", "write_report"]


def run_reproduce(path: str, overrides: list[str] | None = None) -> int:
    """`opd reproduce SPEC`: every arm and seed, then the report; prints it and where everything went."""
    spec = load_reproduce_spec(path, overrides)
    load_spec(spec.experiment, spec.set)  # refuse a bad experiment before any compute
    out = Path(spec.out_dir)
    started = time.perf_counter()
    with RunDirLock(out, field="out_dir"):  # two reproductions in one directory would mix their arms and samples
        results = run_jobs(spec, out)
        minutes = (time.perf_counter() - started) / 60
        report = write_report(spec, results, out, minutes)
    print(report.read_text())
    print(f"Done in {minutes:.1f} min: {report}, plots and per-arm JSON in {out}; one MLflow run per arm and "
          f"seed: {sys.executable} -m mlflow ui --backend-store-uri sqlite:///{(out / 'mlflow.db').resolve()}")
    return 0
