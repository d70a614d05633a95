"""bench/gpu_first_light.py, the first GPU session's one script, dry-run on the CPU at tiny shapes: every section
passes, the result file has what the GPU run will be read by, nothing it imports or runs needs Ray or MLflow (the
GPU image has neither), and a failing or overrunning section is recorded while the others still run."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["lossless", "replay_bf16", "learner", "decode", "memory"]
# Runs main() in a fresh interpreter, then lists the Ray and MLflow modules that importing and running it loaded.
DRY_RUN = ("import json, sys; sys.path.insert(0, 'bench'); import gpu_first_light; "
           "code = gpu_first_light.main(sys.argv[1:]); "
           "print(json.dumps({'exit': code, 'modules': sorted(m for m in sys.modules "
           "if m.split('.')[0] in ('ray', 'mlflow'))}))")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, dict]:
    """The script's tiny CPU run, once for the module: (its result file, what the wrapper printed last)."""
    out = tmp_path_factory.mktemp("first_light") / "result.json"
    env = os.environ | {"OMP_NUM_THREADS": "1"}  # tiny shapes: a second thread only contends with pytest-xdist's
    run = subprocess.run([sys.executable, "-c", DRY_RUN, "--device", "cpu", "--tiny", "--json", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text()), json.loads(run.stdout.strip().splitlines()[-1])


def test_every_section_passes_on_the_cpu_at_tiny_shapes(dry_run):
    result, wrapper = dry_run
    sections = result["sections"]
    assert wrapper["exit"] == 0 and list(sections) == SECTIONS
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(SECTIONS, "passed")
    assert all(s["criterion"] and s["seconds"] >= 0 for s in sections.values())
    assert {"device", "device_name", "torch", "transformers", "python"} <= set(result["environment"])
    assert result["tiny"] and result["environment"]["device"] == "cpu"

    lossless = sections["lossless"]
    assert lossless["greedy_equal"] and set(lossless["chi_square"]) == {"T=0.6", "T=1.0"}
    replay = sections["replay_bf16"]
    assert all(0 < replay[k]["rel"] <= replay["tolerance_rel"] for k in ("teacher", "student"))  # bf16 did round
    losses = sections["learner"]["losses"]
    assert len(losses) == 5 and losses[-1] < losses[0]
    decoded = {(r["mode"], r["batch"]) for r in sections["decode"]["rows"]}
    assert {("autoregressive", 1), ("speculative", 1), ("autoregressive", 4), ("speculative", 4)} <= decoded
    roles = sections["memory"]["roles"]
    assert set(roles) == {"scorer", "learner"} and all(r["measured_gb"] > 0 and r["projected_gb"] > 0
                                                       for r in roles.values())


def test_nothing_it_imports_or_runs_loads_ray_or_mlflow(dry_run):
    assert dry_run[1]["modules"] == []


def test_a_failing_or_overrunning_section_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    first_light = importlib.import_module("gpu_first_light")

    def broken(ctx, deadline):
        raise RuntimeError("boom")

    def slow(ctx, deadline):
        time.sleep(30)

    def fine(ctx, deadline):
        return True, {"summary": "ok"}

    Section = first_light.Section
    monkeypatch.setattr(first_light, "SECTIONS", (Section("broken", broken, "-"), Section("slow", slow, "-"),
                                                  Section("fine", fine, "-")))
    # the slow section's deadline is half the budget away: room for a loaded machine's start before it
    monkeypatch.setattr(first_light, "SHARES", {"broken": 0.05, "slow": 0.5, "fine": 1.0})
    out = tmp_path / "result.json"
    t0 = time.monotonic()
    assert first_light.main(["--device", "cpu", "--tiny", "--budget-s", "10", "--json", str(out)]) == 1
    assert time.monotonic() - t0 < 10  # the slow section was stopped at its deadline plus the grace
    sections = json.loads(out.read_text())["sections"]
    assert [s["status"] for s in sections.values()] == ["failed", "failed", "passed"]
    assert sections["broken"]["error"] == "RuntimeError: boom" and sections["slow"]["error"].startswith("Overrun")
