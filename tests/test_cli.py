"""`opd validate` end to end: good specs print YAML, every malformed input is one clean line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opd.cli import main
from opd.commands.validate import STATIC_CACHE_NOTE
from opd.spec import ExperimentSpec

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def on_tiny(text: str) -> str:
    """A spec that differs from tiny.yaml by `text`."""
    return f"base: {TINY}\n{text}"


# (id, config text or None for "no file", --set overrides, extra files {name: text}, text every stderr line has)
MALFORMED = [
    ("unknown key", on_tiny("optim: {lrr: 0.1}"), [], {}, "optim.lrr: unknown key (did you mean 'lr'?)"),
    ("unknown section", on_tiny("optimizer: {lr: 0.1}"), [], {}, "optimizer: unknown key"),
    ("wrong type", on_tiny("steps: many"), [], {}, "steps: got 'many'"),
    ("negative lr", on_tiny("optim: {lr: -1.0e-4}"), [], {}, "optim.lr: got -0.0001 (should be greater than 0)"),
    ("gamma 0", on_tiny("loss: {gamma: 0}"), [], {}, "loss.gamma: got 0 (should be greater than 0)"),
    ("gamma 1.5", on_tiny("loss: {gamma: 1.5}"), [], {}, "loss.gamma: got 1.5 (should be less than or equal"),
    ("layer beyond depth", on_tiny("models: {drafter_path: null, drafter: {target_layer_ids: [1, 6]}}"), [], {},
     "models.drafter.target_layer_ids: layer 6 is outside the target"),
    ("negative layer id", on_tiny("models: {drafter: {target_layer_ids: [-1, 3]}}"), [], {},
     "models.drafter.target_layer_ids[0]: got -1"),
    ("layers unordered", on_tiny("models: {drafter_path: null, drafter: {target_layer_ids: [3, 1]}}"), [], {},
     "models.drafter.target_layer_ids: [3, 1] is not strictly increasing"),
    ("block size 1", on_tiny("models: {drafter: {block_size: 1}}"), [], {}, "models.drafter.block_size: got 1"),
    ("role beyond cluster", on_tiny("resources: {cluster: {num_gpus: 4}, learner: {replicas: 2, num_gpus: 4}}"), [],
     {}, "resources.learner: 2 replicas x 4 GPUs = 8 GPUs, but the cluster declares 4"),
    ("roles beyond cluster", on_tiny("resources: {cluster: {num_gpus: 3}, rollout: {num_gpus: 1}, "
                                     "scorer: {num_gpus: 1}, learner: {num_gpus: 1}, "
                                     "evaluator: {num_gpus: 1, num_cpus: 0}}"), [], {},
     "resources.cluster.num_gpus: the roles need rollout 1 + scorer 1 + learner 1 + evaluator 1 = 4 GPUs"),
    ("evaluator on cpu", on_tiny("resources: {cluster: {num_gpus: 2}, rollout: {num_gpus: 1}}"), [], {},
     "resources.evaluator.num_gpus: 0 while rollout decodes on GPUs"),
    ("cpus beyond cluster", on_tiny("resources: {rollout: {replicas: 3, num_cpus: 1}}"), [], {},
     "resources.rollout: 3 replicas x 1 CPUs = 3 CPUs, but the cluster declares 2"),
    ("fractional gpus above 1", on_tiny("resources: {cluster: {num_gpus: 8}, scorer: {num_gpus: 1.5}}"), [], {},
     "resources.scorer.num_gpus: 1.5"),
    ("--set without =", on_tiny(""), ["optim.lr"], {}, "--set 'optim.lr': malformed"),
    ("--set empty key", on_tiny(""), ["=3"], {}, "--set '=3': malformed"),
    ("--set empty segment", on_tiny(""), ["optim..lr=3"], {}, "--set 'optim..lr=3': malformed"),
    ("--set unknown key", on_tiny(""), ["optim.lrr=1"], {}, "optim.lrr: unknown key"),
    ("--set wrong type", on_tiny(""), ["resources.rollout.replicas=two"], {}, "resources.rollout.replicas: got 'two'"),
    ("--set into a scalar", on_tiny(""), ["optim.lr.x=1"], {}, "optim.lr is a float, not a section"),
    ("--set bad yaml value", on_tiny(""), ["optim.betas=[0.9,"], {}, "--set 'optim.betas=[0.9,': invalid YAML"),
    ("missing file", None, [], {}, "spec.yaml: file not found"),
    ("yaml syntax error", on_tiny("optim:\n  lr: 0.1\n   batch_size: 4\n"), [], {}, "invalid YAML at line 4"),
    ("empty file", "", [], {}, "spec.yaml: file is empty"),
    ("only a comment", "# nothing here\n", [], {}, "spec.yaml: file is empty"),
    ("list as top level", "- steps: 1\n", [], {}, "spec.yaml: top level is a list (expected a mapping"),
    ("list for a section", on_tiny("optim: [1, 2]"), [], {}, "optim: got a list (expected a mapping of fields)"),
    ("base cycle", "base: other.yaml\n", [], {"other.yaml": "base: spec.yaml\n"}, "base cycle"),
    ("missing base", "base: nowhere.yaml\n", [], {}, "spec.yaml: base: "),
    ("base not a path", "base: {a: b}\n", [], {}, "spec.yaml: base: got {'a': 'b'}"),
    ("base list with a number", "base: [a.yaml, 3]\n", [], {}, "spec.yaml: base: got ['a.yaml', 3]"),
    ("batch not divisible", on_tiny("optim: {batch_size: 8, micro_batch_size: 3}"), [], {},
     "optim.batch_size: 8 is not divisible by optim.micro_batch_size 3"),
    ("lag below broadcast period", on_tiny("resources: {broadcast_every: 3, max_policy_lag: 1}"), [], {},
     "resources.max_policy_lag: 1 with broadcast_every 3"),
    ("batch not whole rollout batches", on_tiny("optim: {batch_size: 12}"), [], {},
     "optim.batch_size: 12 is not a multiple of rollout.batch_size 8"),
    ("lambdas both zero", on_tiny("loss: {lambda_acc: 0, lambda_rej: 0}"), [], {}, "loss.lambda_rej: lambda_acc + "),
    ("negative temperature", on_tiny("rollout: {temperature: -0.5}"), [], {}, "rollout.temperature: got -0.5"),
    ("infinite temperature", on_tiny(""), ["rollout.temperature=.inf"], {},
     "rollout.temperature: got inf (should be a finite number)"),
    ("NaN lr", on_tiny("optim: {lr: .nan}"), [], {}, "optim.lr: got nan (should be a finite number)"),
    ("infinite top_p", on_tiny(""), ["eval.sampling.0.top_p=-.inf"], {}, "eval.sampling[0].top_p: got -inf (should "
                                                                          "be a finite number)"),
    ("eval top_p 0", on_tiny("eval: {sampling: [{name: g, top_p: 0}]}"), [], {}, "eval.sampling[0].top_p: got 0"),
    ("duplicate sampling names", on_tiny("eval: {sampling: [{name: g}, {name: g}]}"), [], {},
     "eval.sampling: name 'g' is used twice"),
    ("bad engine", on_tiny("engine: spark"), [], {}, "engine: got 'spark' (should be 'local' or 'ray')"),
    ("zero without deepspeed", on_tiny("optim: {zero_stage: 2}"), [], {},
     "optim.zero_stage: 2 needs backend deepspeed"),
    ("missing required", "models: {target_path: t}\ndata: {train_prompts: a, eval_prompts: b}\n", [], {},
     "steps: missing"),
    ("bad run_dir placeholder", on_tiny("tracking: {run_dir: 'runs/{nam}'}"), [], {}, "tracking.run_dir:"),
]


@pytest.mark.parametrize("text, overrides, files, expected", [case[1:] for case in MALFORMED],
                         ids=[case[0] for case in MALFORMED])
def test_malformed_spec_is_one_clean_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None,
                                          overrides: list[str], files: dict[str, str], expected: str) -> None:
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    config = tmp_path / "spec.yaml"
    if text is not None:
        config.write_text(text)
    argv = ["validate", str(config), "--no-path-check"] + [arg for item in overrides for arg in ("--set", item)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and expected in lines[0], err


def test_missing_target_path_with_path_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tok").mkdir()
    (tmp_path / "train.jsonl").write_text('{"prompt": "a"}\n')
    config = tmp_path / "spec.yaml"
    config.write_text(yaml.safe_dump({
        "steps": 1, "models": {"target_path": str(tmp_path / "target"), "tokenizer_path": str(tmp_path / "tok")},
        "data": {"train_prompts": str(tmp_path / "train.jsonl"), "eval_prompts": str(tmp_path / "train.jsonl")}}))
    assert main(["validate", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: models.target_path: {tmp_path / 'target'} does not exist "
                                "(expected a model directory with config.json)"]
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    assert main(["validate", str(config)]) == 2  # the paths exist; now the inputs are checked as `opd train` does
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: tokenizer {tmp_path / 'tok'}: ")


def test_every_error_gets_its_own_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "spec.yaml"
    config.write_text(on_tiny("optim: {lr: -1}\nloss: {gamma: 0}\nsteps: 0\n"))
    assert main(["validate", str(config), "--no-path-check"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert sorted(line.split(":")[1].strip() for line in lines) == ["loss.gamma", "optim.lr", "steps"]


@pytest.mark.parametrize("config", [TINY, "configs/tiny-eagle3.yaml"])
def test_validate_tiny_prints_yaml_that_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    config: str) -> None:
    """The printed spec is a valid spec, and validating it prints it again unchanged (an EAGLE-3 drafter gets no
    derived mask token: it has none, and a DFlash-only option on its spec is an error)."""
    assert main(["validate", config, "--no-path-check", "--set", "optim.lr=1e-4"]) == 0
    out, err = capsys.readouterr()
    spec = ExperimentSpec.model_validate(yaml.safe_load(out))
    assert err == "" and spec.name == Path(config).stem and spec.optim.lr == 1e-4
    (tmp_path / "printed.yaml").write_text(out)
    assert main(["validate", str(tmp_path / "printed.yaml"), "--no-path-check"]) == 0
    assert capsys.readouterr().out == out


def test_validate_prints_derived_fields_resolved(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fields whose null means 'derive it' print what a run uses; nulls that mean 'off' stay null."""
    config = tmp_path / "spec.yaml"
    config.write_text(on_tiny("name: derived\nmodels: {tokenizer_path: null}\ntracking: {uri: null}\n"))
    assert main(["validate", str(config), "--no-path-check"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    models = printed["models"]
    assert models["tokenizer_path"] == models["target_path"] == "opd/assets/tiny/target"
    assert models["target_num_layers"] == 6  # the tiny target's config.json
    assert models["drafter"]["target_layer_ids"] == [1, 3]  # DFlash's default for 2 drafter layers over 6
    assert models["drafter"]["mask_token_id"] == 2  # '<|mask|>' in the tiny tokenizer.json
    assert printed["tracking"]["run_dir"] == "runs/derived"
    assert printed["tracking"]["uri"] == (os.environ.get("OPD_TRACKING_URI")
                                          or f"sqlite:///{Path('runs/derived/mlflow.db').resolve()}")
    assert printed["replay"]["teacher_topk"] is None and printed["sft"]["max_flops"] is None


def test_validate_says_what_the_static_cache_is_for(capsys: pytest.CaptureFixture[str]) -> None:
    for value in ("false", "true"):
        assert main(["validate", TINY, "--no-path-check", "--set", f"rollout.static_cache={value}"]) == 0
        line = next(row for row in capsys.readouterr().out.splitlines() if "static_cache" in row)
        assert line == f"  static_cache: {value}  # {STATIC_CACHE_NOTE}" and "rollout.compile" in line


def test_console_script_lists_commands_without_heavy_imports() -> None:
    script = Path(sys.executable).with_name("opd")
    help_run = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert help_run.returncode == 0 and "validate" in help_run.stdout and "check a spec" in help_run.stdout
    probe = ("import sys; from opd.cli import main; rc = main(['validate', sys.argv[1], '--no-path-check']); "
             "heavy = {'torch', 'ray', 'mlflow', 'transformers'} & set(sys.modules); "
             "sys.exit(rc or (3 if heavy else 0))")
    run = subprocess.run([sys.executable, "-c", probe, TINY], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    module_run = subprocess.run([sys.executable, "-m", "opd.cli", "validate", "nowhere.yaml"],
                                capture_output=True, text=True, timeout=60)
    assert module_run.returncode == 2
    assert module_run.stderr == "error: nowhere.yaml: file not found (expected a YAML spec)\n"


def test_layer_ids_that_disagree_with_the_warm_drafter_are_refused(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(on_tiny("models: {drafter: {target_layer_ids: [1, 4]}}"))
    assert main(["validate", str(spec)]) == 2
    assert "disagrees with the warm drafter's [1, 3]" in capsys.readouterr().err


def test_getting_started_says_to_activate_the_venv_before_its_opd_commands() -> None:
    page = (Path(__file__).parents[1] / "docs" / "getting-started.md").read_text()
    assert page.index("source .venv/bin/activate") < page.index("opd validate")


def test_printed_commands_name_the_venv_when_it_is_not_active(monkeypatch) -> None:
    from opd.commands.shell import command

    venv_mlflow = Path(sys.executable).with_name("mlflow")
    monkeypatch.setattr("shutil.which", lambda name: str(venv_mlflow))
    assert command("mlflow") == "mlflow"  # the shell finds this very one
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.chdir(venv_mlflow.parents[2])
    assert command("mlflow") == f"{venv_mlflow.parent.parent.name}/bin/mlflow"  # e.g. .venv/bin/mlflow
