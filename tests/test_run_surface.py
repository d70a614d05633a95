"""What a new user meets around a run: a tiny `epochs` still trains at least one update and its printed spec loads
again; a refusal's advice about stale eval samples works when followed; a run that lost batches says so."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from opd.cli import main
from opd.spec import load_spec

TINY = "configs/tiny.yaml"


def test_a_tiny_epochs_rounds_up_to_one_update_and_its_printed_spec_loads(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """0.0001 epochs over 4,000 prompts is 0.4 sequences: rounded up to whole updates, that is one update."""
    sets = ["steps=null", "epochs=0.0001", "data.train_pool_size=4000"]
    assert main(["validate", TINY, "--no-path-check", *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["steps"] == 1 and "# run length: 1 optimizer updates" in out
    (tmp_path / "printed.yaml").write_text(out)
    assert main(["validate", str(tmp_path / "printed.yaml"), "--no-path-check"]) == 0
    assert capsys.readouterr().out == out


def test_epochs_round_up_to_whole_updates_not_to_whole_sequences(micro_spec_file: Path) -> None:
    """40 prompts, 4 sequences an update: 0.51 epochs is 20.4 sequences, which 5 updates (20) would not cover."""
    assert load_spec(micro_spec_file, ["steps=null", "epochs=0.51"]).steps == 6
    assert load_spec(micro_spec_file, ["steps=null", "epochs=0.5"]).steps == 5  # exactly 20 sequences


# ------------------------------------------------------------------ stale eval samples: advice that works (issue 40)

SHORTER = ["--set", "eval.max_new_tokens=6"]  # the micro spec's eval samples are drawn at 8


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _follow(line: str, config: Path, new: Path, sets: list[str]) -> list[str]:
    """Do what a refusal's advice says, as a user would: run its `opd gen-samples` command (with the same --set
    flags the refused command had) and return the arguments it says to add to the refused command next."""
    commands = [c.replace("CONFIG", str(config)).replace("NEW.jsonl", str(new)) for c in re.findall("`([^`]+)`", line)]
    draw = [c for c in commands if c.startswith("opd gen-samples")]
    assert len(draw) == 1, line
    assert main([*shlex.split(draw[0])[1:], *sets]) == 0
    then = [c for c in commands if c not in draw][:1]  # the first way on; an "or ..." after it is another
    return [arg for c in then for arg in shlex.split(c)]


def _micro_eval_samples(config: Path, path: Path) -> Path:
    assert main(["gen-samples", str(config), "--eval", "--out", str(path)]) == 0
    return path


def test_train_with_eval_samples_drawn_otherwise_draws_its_own_with_a_note(micro_spec_file: Path, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]):
    """The shipped config names shipped samples; changing one eval setting used to be refused with advice that
    wrote another file, so the rerun was refused again. Now the run notes it and draws its own, before training."""
    named = _micro_eval_samples(micro_spec_file, tmp_path / "named.jsonl")
    before = named.read_text()
    argv = ["train", str(micro_spec_file), "--set", f"eval.samples_path={named}", "--set", "steps=1", *SHORTER]
    capsys.readouterr()
    assert main(argv) == 0
    own = tmp_path / "runs" / "micro" / "eval_samples.jsonl"
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: eval.samples_path: {named} line 1: max_new_tokens is 8, this run's is 6, so this run "
                     f"draws its own into {own}"]
    assert named.read_text() == before
    assert {json.loads(line)["max_new_tokens"] for line in own.read_text().splitlines()} == {6}


def test_with_eval_offline_off_a_run_decodes_instead_of_drawing(micro_spec_file: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]):
    from opd.commands.launch import held_out_samples

    named = _micro_eval_samples(micro_spec_file, tmp_path / "named.jsonl")
    spec = load_spec(micro_spec_file, [f"eval.samples_path={named}", "eval.offline=false", "eval.max_new_tokens=6"])
    capsys.readouterr()
    assert held_out_samples(spec).eval.samples_path is None
    assert capsys.readouterr().err == (f"note: eval.samples_path: {named} line 1: max_new_tokens is 8, this run's is "
                                       "6, so held-out τ is decoded instead (eval.offline is false)\n")
    assert held_out_samples(load_spec(micro_spec_file, [f"eval.samples_path={named}"])).eval.samples_path == str(named)


def test_a_run_directorys_own_samples_drawn_otherwise_are_refused_before_any_model_loads(
        micro_spec_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """RUN_DIR/eval_samples.jsonl from an earlier run at another length: refused up front, and the advice works."""
    import opd.train.evaluator

    own = _micro_eval_samples(micro_spec_file, tmp_path / "runs" / "micro" / "eval_samples.jsonl")
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(opd.train.evaluator, "build_models", lambda *a, **k: pytest.fail("models loaded first"))
        line = _refused(["train", str(micro_spec_file), "--set", "steps=1", *SHORTER], capsys)
    assert line.startswith(f"error: eval.samples_path: {own} line 1: max_new_tokens is 8, this run's is 6"), line
    more = _follow(line, micro_spec_file, tmp_path / "new.jsonl", SHORTER)
    assert main(["train", str(micro_spec_file), "--set", "steps=1", *SHORTER, *more]) == 0


@pytest.mark.parametrize("command", ["eval", "gap"])
def test_eval_samples_drawn_otherwise_name_a_draw_that_works_when_followed(micro_spec_file: Path, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str],
                                                                           command: str):
    samples = _micro_eval_samples(micro_spec_file, tmp_path / "samples.jsonl")
    drafts = ["--draft", load_spec(micro_spec_file).models.drafter_path] if command == "gap" else []
    argv = [command, str(micro_spec_file), "--samples", str(samples), *drafts, *SHORTER]
    capsys.readouterr()
    line = _refused(argv, capsys)
    assert "max_new_tokens is 8, this run's is 6" in line
    more = _follow(line, micro_spec_file, tmp_path / "new.jsonl", SHORTER)
    assert main([*argv, *more]) == 0


def test_missing_eval_samples_name_a_draw_that_writes_them_where_they_are_read(micro_spec_file: Path, tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture[str]):
    argv = ["eval", str(micro_spec_file), "--samples", str(tmp_path / "missing.jsonl")]
    line = _refused(argv, capsys)
    assert _follow(line, micro_spec_file, tmp_path / "unused.jsonl", []) == []
    assert main(argv) == 0


def test_gen_samples_into_a_file_drawn_otherwise_names_another_out(micro_spec_file: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]):
    samples = _micro_eval_samples(micro_spec_file, tmp_path / "samples.jsonl")
    capsys.readouterr()
    line = _refused(["gen-samples", str(micro_spec_file), "--eval", "--out", str(samples), *SHORTER], capsys)
    assert line.startswith(f"error: --out: {samples} line 1: max_new_tokens is 8, this run's is 6"), line
    assert _follow(line, micro_spec_file, tmp_path / "new.jsonl", SHORTER) == []
    assert main(["eval", str(micro_spec_file), "--samples", str(tmp_path / "new.jsonl"), *SHORTER]) == 0



def test_rollout_samples_drawn_otherwise_name_a_draw_that_works_when_followed(micro_spec_file: Path, tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture[str]):
    """`opd gen-samples CONFIG` writes to rollout.samples_path by default, so advice to redraw with it into a file
    made otherwise looped; the advice now names a new file and the setting that reads it."""
    old = tmp_path / "old.jsonl"
    assert main(["gen-samples", str(micro_spec_file), "--out", str(old), "--set", "steps=1"]) == 0
    sets = [f"--set={s}" for s in ("rollout.source=samples", f"rollout.samples_path={old}", "steps=1",
                                   "rollout.max_new_tokens=6")]
    argv = ["validate", str(micro_spec_file), *sets]
    capsys.readouterr()
    line = _refused(argv, capsys)
    assert "this run's is 6" in line, line
    more = _follow(line, micro_spec_file, tmp_path / "new.jsonl", sets)
    assert main([*argv, *more]) == 0
