"""`opd run` (what `make run` does) on micro assets: the before/after table, the plot and the MLflow run."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlflow
import pytest

from opd.cli import main
from opd.spec import load_spec


def check_outputs(spec, printed: str) -> None:
    assert "τ before" in printed and "greedy" in printed and "sampled" in printed
    assert (spec.run_dir / "tau_over_steps.png").stat().st_size > 1000
    summary = json.loads((spec.run_dir / "summary.json").read_text())
    # held-out τ offline on the warm drafter's stored decodes, with an interval; the speedup still decoded
    assert (spec.run_dir / "eval_samples.jsonl").stat().st_size > 0
    assert all(r["offline"] and r["speedup"] is not None for r in summary["before"] + summary["after"])
    assert "±" in printed
    assert sorted(int(s) for s in summary["history"]) == [0, 1, 2]
    mlflow.set_tracking_uri(spec.tracking_uri)
    runs = mlflow.search_runs(experiment_names=[spec.tracking.experiment])
    assert len(runs) == 1
    assert {"metrics.heldout_tau_greedy_before", "metrics.heldout_tau_greedy_after", "metrics.loss"} <= set(runs)
    # an undisturbed run: the ledger's account recorded (zeros but the batches trained), and no ledger line
    ledger = summary["ledger"]
    assert ledger["trained"] == 4 and ledger["lost"] == ledger["orphaned"] == ledger["restarts"] == 0
    assert (runs["metrics.ledger_lost"][0], runs["metrics.ledger_trained"][0]) == (0, 4) and "ledger:" not in printed
    # printed on one line whatever the terminal's width, so it survives copy and paste
    assert any(line.endswith(f" ui --backend-store-uri {spec.tracking_uri}") for line in printed.splitlines())


SETS = ["steps=2", "eval.every=1", "eval.sampling=[{name: greedy}, {name: sampled, temperature: 0.6, top_p: 0.95, top_k: 20}]"]


def test_main_job_local(micro_spec_file, capsys):
    args = ["run", str(micro_spec_file), *[a for s in SETS for a in ("--set", s)]]
    assert main(args) == 0
    spec = load_spec(micro_spec_file, SETS)
    printed = capsys.readouterr().out
    check_outputs(spec, printed)
    # its last line takes the trained checkpoint out to vLLM, and runs as printed (the run recorded the target)
    line = next(line for line in printed.splitlines() if "to serve it in vLLM: " in line)
    opd, *args = shlex.split(line.split("to serve it in vLLM: ")[1])
    assert Path(opd).name == "opd" and args[0] == "export" and main(args) == 0
    assert "--speculative-config" in capsys.readouterr().out
    # the warm drafter drew the samples, so its offline τ is exactly its decoded τ
    from opd.data.prompts import eval_prompts
    from opd.eval.online import evaluate
    from opd.models.build import build_models

    models = build_models(spec)
    decoded = evaluate(models, eval_prompts(spec.data, models.tokenizer, spec.eval.num_prompts), spec.eval.sampling,
                       max_new_tokens=spec.eval.max_new_tokens, batch_size=spec.eval.batch_size, seed=spec.seed,
                       baseline=False)
    before = json.loads((spec.run_dir / "summary.json").read_text())["before"]
    assert [r["tau"] for r in before] == pytest.approx([r.tau for r in decoded], abs=1e-12)


def test_main_job_decodes_with_eval_offline_off(micro_spec_file, capsys):
    sets = SETS + ["eval.offline=false", "eval.every=0"]
    assert main(["run", str(micro_spec_file), *[a for s in sets for a in ("--set", s)]]) == 0
    spec = load_spec(micro_spec_file, sets)
    summary = json.loads((spec.run_dir / "summary.json").read_text())
    assert not (spec.run_dir / "eval_samples.jsonl").exists()
    assert not any(r["offline"] for r in summary["before"] + summary["after"])


@pytest.mark.slow
def test_main_job_ray(micro_spec_file, capsys, monkeypatch):
    """Before/after evals run in an evaluator actor, not in this driver process (where they would fail here)."""
    def not_here(*args, **kwargs):
        raise AssertionError("opd run evaluated in the driver process")

    monkeypatch.setattr("opd.train.evaluator.Evaluator.__init__", not_here)
    sets = SETS + ["engine=ray"]
    assert main(["run", str(micro_spec_file), *[a for s in sets for a in ("--set", s)]]) == 0
    check_outputs(load_spec(micro_spec_file, sets), capsys.readouterr().out)


@pytest.mark.slow
def test_a_ray_run_is_quiet_and_shows_the_dashboard_while_it_is_live(micro_spec_file):
    """Issue 16, item 12: no token-auth banner, no red core_worker.cc line about constructor arguments, no MLflow
    table-creation lines; the dashboard link comes before training ends. Ray runs in a private temp dir."""
    ray_tmp = tempfile.mkdtemp(prefix="opd-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"TMPDIR": ray_tmp, "RAY_TMPDIR": ray_tmp}
    try:
        run = subprocess.run([str(Path(sys.executable).with_name("opd")), "train", str(micro_spec_file), "--set",
                              "engine=ray", "--set", "steps=1", "--set", "eval.num_prompts=1"],
                             capture_output=True, text=True, env=env, timeout=600)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert run.returncode == 0, run.stderr
    for noise in ("Token authentication", "core_worker.cc", "Creating initial MLflow", "alembic", "Context impl"):
        assert noise not in run.stdout + run.stderr, noise
    assert run.stdout.index("Ray dashboard (while the run is live): http") < run.stdout.index("trained to step")


def test_the_table_names_the_recipe_that_ran():
    """`make run`'s table caption says which recipe trained: the recommended preset, or the paper's loss."""
    from opd.commands.run import describe_recipe

    root = Path(__file__).resolve().parents[1]
    tiny = describe_recipe(load_spec(root / "configs/tiny.yaml", check_paths=False))
    paper = describe_recipe(load_spec(root / "configs/tiny-paper.yaml", check_paths=False))
    assert tiny == ("forward KL on the accepted prefix and the first rejected slot, teacher at T=0.1; rollouts at T=0 "
                    "and T=0.6")
    assert paper.startswith("the paper's loss") and paper.endswith("; greedy rollouts")
