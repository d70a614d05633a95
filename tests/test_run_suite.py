"""`opd run` with `eval.suite`: the run ends with the benchmark table in the paper's layout (warm and trained drafter
beside the ceiling) in stdout, RUN_DIR/suite/ and the run's MLflow run; a suite that is not built, or a prompt
too long for the target's context, is one line before any compute; the Qwen3 configs name the paper suite."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest

from opd.cli import main
from opd.spec import load_spec
from tests.helpers.suites import one_error, suite_yaml, write

ROOT = Path(__file__).resolve().parents[1]
SETS = ["steps=2", "eval.every=0", "eval.num_prompts=2", "eval.speedup_prompts=1", "eval.max_new_tokens=8",
        "eval.sampling=[{name: greedy}, {name: sampled, temperature: 0.6, top_p: 0.95, top_k: 20}]"]


@pytest.fixture
def micro_suite(micro_assets, tmp_path) -> str:
    """Two benchmarks of the micro held-out prompts (the tiny families' `prompt` column): 2 rows and 1, 8 tokens."""
    benchmarks = [{"name": "tiny-math", "count": 2, "max_new_tokens": 8},
                  {"name": "tiny-reworded", "count": 1, "max_new_tokens": 8}]
    out = tmp_path / "suite"
    files = [a for name in ("tiny-math", "tiny-reworded") for a in ("--file", f"{name}={micro_assets['heldout']}")]
    assert main(["suite", "build", "--suite", suite_yaml(tmp_path, benchmarks), "--out", str(out), *files]) == 0
    return str(out)


def _args(spec_file: Path, sets: list[str]) -> list[str]:
    return ["run", str(spec_file), *[a for s in sets for a in ("--set", s)]]


def test_opd_run_ends_with_the_suite_table(micro_spec_file, micro_suite, capsys):
    sets = [*SETS, f"eval.suite={micro_suite}"]
    assert main(_args(micro_spec_file, sets)) == 0
    printed = capsys.readouterr().out
    spec = load_spec(micro_spec_file, sets)
    for text in (printed, (spec.run_dir / "suite" / "table.md").read_text()):
        assert "| drafter | tiny-math | tiny-reworded | avg | % of ceiling |" in text
        assert all(f"\n| {row} |" in text for row in ("warm", "draft-opd", "ceiling"))
    assert printed.index("τ before") < printed.index("# Suite") < printed.index("Done in")
    assert f"suite table: {spec.run_dir / 'suite' / 'table.md'}" in printed
    saved = json.loads((spec.run_dir / "suite" / "suite.json").read_text())
    checkpoint = json.loads((spec.run_dir / "summary.json").read_text())["checkpoint"]
    assert saved["drafters"] == {"warm": spec.models.drafter_path, "draft-opd": checkpoint}
    assert saved["settings"] == ["greedy", "sampled"] and {c["sequences"] for c in saved["cells"]} == {1, 2}
    assert (spec.run_dir / "suite" / "samples" / "tiny-math.jsonl").is_file()
    assert (spec.run_dir / "suite" / "tau.png").stat().st_size > 1000
    mlflow.set_tracking_uri(spec.tracking_uri)
    runs = mlflow.search_runs(experiment_names=[spec.tracking.experiment])
    assert len(runs) == 1  # the training run carries the table
    assert {"metrics.suite_tiny-math_greedy_draft-opd_tau", "metrics.suite_avg_sampled_ceiling_tau",
            "metrics.heldout_tau_greedy_after"} <= set(runs)


@pytest.mark.parametrize("case", ["missing", "no card", "too long"])
def test_a_suite_the_run_cannot_use_is_one_line_before_any_compute(micro_spec_file, tmp_path, capsys, monkeypatch,
                                                                  case):
    def no_compute(*args, **kwargs):
        raise AssertionError("trained before refusing the suite")

    monkeypatch.setattr("opd.commands.launch.train", no_compute)
    monkeypatch.setattr("opd.commands.launch.held_out_samples", no_compute)
    (tmp_path / "empty").mkdir()
    long = write(tmp_path / "long.jsonl", [{"prompt": "What is 12 + 30? " * 120}])  # past the micro context
    assert main(["suite", "build", "--suite", suite_yaml(tmp_path, [{"name": "tiny-math"}], "long"), "--out",
                 str(tmp_path / "long"), "--file", f"tiny-math={long}"]) == 0
    capsys.readouterr()
    suite, expected = {"missing": (tmp_path / "nowhere", "does not exist (expected the directory `opd suite build"),
                       "no card": (tmp_path / "empty", "no card.json (expected a directory `opd suite build"),
                       "too long": (tmp_path / "long", "new tokens pass the target's context of 512")}[case]
    assert main(_args(micro_spec_file, [*SETS, f"eval.suite={suite}"])) == 2
    line = one_error(capsys)
    assert "eval.suite: " in line and expected in line, line


@pytest.mark.parametrize("name", ["qwen3-4b", "qwen3-8b", "qwen3-4b-thinking", "qwen3-8b-thinking"])
def test_the_qwen3_configs_name_the_paper_suite(name, capsys):
    """Beside their data on shared storage; the thinking configs evaluate it with thinking on (8192 new tokens)."""
    spec = load_spec(ROOT / "configs" / f"{name}.yaml", check_paths=False)
    assert spec.eval.suite == "/mnt/data/opd/suites/paper"
    assert Path(spec.eval.suite).is_relative_to(Path(spec.data.eval_prompts).parent)
    assert spec.data.enable_thinking is name.endswith("thinking")
    assert main(["validate", str(ROOT / "configs" / f"{name}.yaml"), "--no-path-check"]) == 0
