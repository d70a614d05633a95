"""`opd run` (what `make run` does) on micro assets: the before/after table, the plot and the MLflow run."""

from __future__ import annotations

import json

import mlflow
import pytest

from opd.cli import main
from opd.spec import load_spec


def check_outputs(spec, printed: str) -> None:
    assert "τ before" in printed and "greedy" in printed and "sampled" in printed
    assert (spec.run_dir / "tau_over_steps.png").stat().st_size > 1000
    summary = json.loads((spec.run_dir / "summary.json").read_text())
    assert sorted(int(s) for s in summary["history"]) == [0, 1, 2]
    mlflow.set_tracking_uri(spec.tracking_uri)
    runs = mlflow.search_runs(experiment_names=[spec.tracking.experiment])
    assert len(runs) == 1
    assert {"metrics.heldout_tau_greedy_before", "metrics.heldout_tau_greedy_after", "metrics.loss"} <= set(runs)


SETS = ["steps=2", "eval.every=1", "eval.sampling=[{name: greedy}, {name: sampled, temperature: 0.6, top_p: 0.95, top_k: 20}]"]


def test_main_job_local(micro_spec_file, capsys):
    args = ["run", str(micro_spec_file), *[a for s in SETS for a in ("--set", s)]]
    assert main(args) == 0
    check_outputs(load_spec(micro_spec_file, SETS), capsys.readouterr().out)


@pytest.mark.slow
def test_main_job_ray(micro_spec_file, capsys):
    sets = SETS + ["engine=ray"]
    assert main(["run", str(micro_spec_file), *[a for s in sets for a in ("--set", s)]]) == 0
    check_outputs(load_spec(micro_spec_file, sets), capsys.readouterr().out)
