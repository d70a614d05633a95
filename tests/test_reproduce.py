"""`opd reproduce`: matched-FLOPs arms, the resumable job pool and the report, on the micro models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from opd.cli import main
from opd.errors import OpdError
from opd.reproduce import ArmJob, ArmSpec, load_reproduce_spec, run_arm, run_jobs, write_report
from opd.spec import load_spec

SETS = ["sft.response_max_new_tokens=12", "sft.anchors_per_seq=4", "sft.batch_size=2", "sft.max_length=160"]


def _job(micro_spec_file, tmp_path, arm: ArmSpec, marks=None, sft_data=None) -> ArmJob:
    return ArmJob(arm, seed=0, experiment=str(micro_spec_file), overrides=SETS,
                  run_dir=str(tmp_path / arm.name), opd_steps=3, eval_points=3, eval_prompts=2, marks=marks,
                  sft_data=sft_data)


def _sft_data(micro_spec_file, tmp_path) -> str:
    """The continued-SFT arm's data, drawn into the sample store as `opd gen-samples --sft` draws it."""
    path = tmp_path / "sft.jsonl"
    assert main(["gen-samples", str(micro_spec_file), "--sft", "--out", str(path),
                 *(arg for s in SETS for arg in ("--set", s))]) == 0
    return str(path)


def test_every_arm_stops_at_the_first_step_past_the_full_methods_flops(micro_spec_file, tmp_path):
    full = run_arm(_job(micro_spec_file, tmp_path, ArmSpec(name="draft-opd")))
    assert full.steps == 3 and len(full.curve) == 4  # the warm drafter, then one mark per step
    budget = full.flops["total"]
    marks = [x for x, _ in full.curve[1:]]
    assert marks[-1] == budget and marks == sorted(marks)
    assert all(full.flops[k] > 0 for k in ("target_forward", "drafter_forward", "drafter_train"))
    assert full.initial == {"greedy": full.curve[0][1]}  # the warm drafter in every eval setting, once per seed

    sft = run_arm(_job(micro_spec_file, tmp_path, ArmSpec(name="sft", kind="sft"), marks, _sft_data(micro_spec_file, tmp_path)))
    per_step = sft.flops["total"] / sft.steps
    assert budget <= sft.flops["total"] < budget + per_step * 1.5  # matched: stopped at the first step past it
    assert sft.flops["drafter_forward"] == 0 and sft.flops["target_forward"] > 0 and sft.flops["drafter_train"] > 0
    assert [x for x, _ in sft.curve[1:]] == sorted(x for x, _ in sft.curve[1:])
    assert all(x >= m for (x, _), m in zip(sft.curve[1:], marks))  # measured as each mark is crossed
    assert sft.steps > full.steps  # an SFT step is cheaper than a rollout + replay + update step

    redraft = run_arm(_job(micro_spec_file, tmp_path, ArmSpec(name="random-anchors", set=["replay.anchors=random"]),
                           marks))
    per_step = redraft.flops["total"] / redraft.steps
    assert budget <= redraft.flops["total"] < budget + per_step * 1.5
    assert redraft.steps <= full.steps  # redrafting at random anchors costs extra drafter and target forwards


def test_the_pool_resumes_from_saved_arms_and_writes_the_tables(micro_spec_file, tmp_path):
    spec_file = tmp_path / "reproduce.yaml"
    spec_file.write_text(json.dumps({
        "experiment": str(micro_spec_file), "set": SETS, "seeds": [0, 1], "opd_steps": 2, "eval_points": 1,
        "eval_prompts": 2, "workers": 1, "out_dir": str(tmp_path / "out"),
        "families": {"again": load_spec(micro_spec_file).data.eval_prompts}, "keep_drafters": True,
        "arms": [{"name": "draft-opd"}, {"name": "no-decay", "set": ["loss.rejected_decay=false"]}]}))
    spec = load_reproduce_spec(spec_file)
    results = run_jobs(spec, tmp_path / "out")
    assert sorted((r.arm, r.seed) for r in results) == [("draft-opd", 0), ("draft-opd", 1), ("no-decay", 0),
                                                        ("no-decay", 1)]
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("reproduce").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["draft-opd-seed0", "draft-opd-seed1", "no-decay-seed0",
                                                      "no-decay-seed1"]
    by_name = {(r.arm, r.seed): r for r in results}
    for run in runs:
        arm, seed = run.info.run_name.rsplit("-seed", 1)
        assert run.data.metrics["final_tau_greedy"] == by_name[(arm, int(seed))].final["greedy"]
        assert run.data.metrics["final_tau_again_greedy"] == run.data.metrics["final_tau_heldout_greedy"]
        assert run.data.params["loss.rejected_decay"] == ("false" if arm == "no-decay" else "true")
    saved = sorted(p.name for p in (tmp_path / "out" / "arms").iterdir())
    kept = sorted(p.name for p in (tmp_path / "out" / "drafters").iterdir() if (p / "config.json").is_file())
    assert kept == [name.removesuffix(".json") for name in saved]  # every arm's final drafter, whole
    assert saved == ["draft-opd-seed0.json", "draft-opd-seed1.json", "no-decay-seed0.json", "no-decay-seed1.json"]
    marked = tmp_path / "out" / "arms" / "no-decay-seed1.json"
    row = json.loads(marked.read_text())
    marked.write_text(json.dumps({**row, "final": {"greedy": 123.0}}))  # a rerun must load, not retrain
    again = run_jobs(spec, tmp_path / "out")
    finals = {(r.arm, r.seed): r.final["greedy"] for r in again}
    assert finals[("no-decay", 1)] == 123.0
    assert finals == {**{(r.arm, r.seed): r.final["greedy"] for r in results}, ("no-decay", 1): 123.0}
    marked.write_text(json.dumps(row))
    again = run_jobs(spec, tmp_path / "out")
    assert len(client.search_runs([runs[0].info.experiment_id])) == 4  # loaded arms are not logged again
    report = write_report(spec, again, tmp_path / "out", minutes=1.0).read_text()
    assert "### All arms" in report and "### Table 3: loss ablations" in report and "| no-decay |" in report and "Table 10" in report
    assert "| arm | heldout greedy | again greedy |" in report and "worst vs warm" in report
    assert "| arm | greedy rule on greedy states |" in report
    assert "### Share of the reachable gain" in report and "| ceiling (τ) |" in report
    assert "### Expected τ on each arm's own training rollouts" in report
    assert (tmp_path / "out" / "tau_vs_flops.png").stat().st_size > 1000
    # each seed's arms trained on one shared sample file, every sample drawn once
    samples = tmp_path / "out" / "samples"
    assert sorted(p.name for p in samples.iterdir()) == ["seed0.jsonl", "seed1.jsonl"]
    rows = [json.loads(line) for line in (samples / "seed0.jsonl").read_text().splitlines()]
    assert rows and len({(r["id"], r["sample"]) for r in rows}) == len(rows)
    assert "each seed's opd arms train on one shared file of target samples" in report
    # held-out τ offline on each seed's stored warm decodes of each family, shared by the arms
    assert sorted(p.name for p in (tmp_path / "out" / "eval_samples").glob("*.jsonl")) == [
        "seed0-again.jsonl", "seed0-heldout.jsonl", "seed1-again.jsonl", "seed1-heldout.jsonl"]
    # the warm drafter's rows are measured once per seed and shared by that seed's arms
    assert [len(list((tmp_path / "out" / "eval_samples").glob(f"seed{s}-warm-*.json"))) for s in (0, 1)] == [1, 1]
    assert by_name[("draft-opd", 0)].initial_rows == by_name[("no-decay", 0)].initial_rows
    # the expected-acceptance diagnostic on the main family only: the report's diagnostic tables read no other
    assert all(row["expected"] for r in results for row in r.final_rows["heldout"])
    assert not any(row["expected"] for r in results for row in r.final_rows["again"])
    assert all(row["offline"] and row["tau_ci"] >= 0 for r in results for rows in r.final_rows.values()
               for row in rows)


def test_the_warm_rows_are_read_back_only_under_their_key(micro_spec_file, tmp_path):
    from opd.reproduce.arms import _warm_key

    samples = tmp_path / "eval_samples"
    job = ArmJob(ArmSpec(name="draft-opd"), seed=0, experiment=str(micro_spec_file), overrides=SETS,
                 run_dir=str(tmp_path / "a"), opd_steps=2, eval_points=1, eval_prompts=2,
                 eval_samples_dir=str(samples))
    first = run_arm(job)
    (cached,) = samples.glob("seed0-warm-*.json")
    rows = json.loads(cached.read_text())
    assert rows == first.initial_rows and rows["heldout"][0]["offline"]
    rows["heldout"][0]["tau"] = 99.0  # a marker: the next arm of this seed must read the file, not re-measure
    cached.write_text(json.dumps(rows))
    job.arm, job.run_dir = ArmSpec(name="no-decay", set=["loss.rejected_decay=false"]), str(tmp_path / "b")
    assert run_arm(job).initial_rows["heldout"][0]["tau"] == 99.0

    spec = load_spec(micro_spec_file, SETS)
    key = _warm_key(spec, job)
    assert _warm_key(load_spec(micro_spec_file, [*SETS, "eval.max_new_tokens=7"]), job) != key
    assert _warm_key(spec, ArmJob(**{**vars(job), "seed": 1})) != key
    with open(next(samples.glob("seed0-heldout.jsonl")), "a") as f:
        f.write("\n")  # the seed's stored samples changed
    assert _warm_key(spec, job) != key


def test_only_arms_that_need_the_speculative_engine_decode_their_own(micro_spec_file):
    from opd.reproduce.arms import shares_samples

    assert shares_samples(str(micro_spec_file), SETS, ArmSpec(name="a", set=["loss.rejected_decay=false"]))
    assert not shares_samples(str(micro_spec_file), SETS, ArmSpec(name="b", set=["replay.anchors=random"]))
    assert not shares_samples(str(micro_spec_file), SETS, ArmSpec(name="c", set=["rollout.source=speculative"]))
    assert not shares_samples(str(micro_spec_file), SETS, ArmSpec(name="sft", kind="sft"))


@pytest.mark.parametrize("content, message", [
    ("experiment: x.yaml\nopd_steps: 4\narms: [{name: sft, kind: sft}, {name: other}]", "including 'draft-opd'"),
    ("experiment: x.yaml\nopd_steps: 1\narms: [{name: draft-opd}, {name: sft}]", "opd_steps"),
    ("experiment: x.yaml\nopd_steps: 4\narms: [{name: draft-opd}, {name: sft, kind: dpo}]", "arms.1.kind"),
    ("experiment: [", "not valid YAML"),
    ("experiment: x.yaml\nopd_steps: 4\nfamilies: {x: nope.jsonl}\narms: [{name: draft-opd}, {name: o}]",
     "families: x: nope.jsonl does not exist"),
    ("experiment: x.yaml\nopd_steps: 4\nfamilies: {heldout: a.jsonl}\narms: [{name: draft-opd}, {name: o}]",
     "'heldout' is the experiment's data.eval_prompts"),
])
def test_a_bad_reproduce_spec_is_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "r.yaml"
    path.write_text(content)
    assert main(["reproduce", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and str(path) in err


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "configs" / "reproduce").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_reproduce_specs_validate_with_every_arm(path):
    spec = load_reproduce_spec(path)
    root = path.parents[2]
    for arm in spec.arms:
        load_spec(root / spec.experiment, [*spec.set, *arm.set], check_paths=False)


def test_a_built_suite_is_one_held_out_family_per_benchmark(tmp_path):
    """`families: {paper: SUITE_DIR}` evaluates each benchmark of the suite as its own family, its prompts rendered
    as `opd suite eval` renders them; the reproduce spec accepts the directory, and a missing one is one line."""
    from opd.data.prompts import load_tokenizer
    from opd.data.render import Rendering
    from opd.data.suite import built_suite, load_suite, read_rows, suite_prompts
    from opd.data.suite_build import build_suite
    from opd.reproduce.arms import family_prompts
    from tests.helpers.suites import suite_yaml

    root = Path(__file__).resolve().parents[1]
    build_suite(load_suite(suite_yaml(tmp_path, [{"name": "tiny-math", "count": 5}, {"name": "tiny-reworded",
                                                                                   "count": 4}])),
                tmp_path / "suite", {}, log=lambda _: None)
    spec = load_spec(root / "configs/tiny-paper.yaml", check_paths=False)
    tokenizer = load_tokenizer(spec.models.tokenizer)
    families = family_prompts(spec.data, tokenizer, "mini", str(tmp_path / "suite"), 3)
    assert list(families) == ["mini-tiny-math", "mini-tiny-reworded"]
    card = built_suite(tmp_path / "suite")
    expected = suite_prompts(read_rows(tmp_path / "suite" / card.benchmarks[0].file), tokenizer,
                             Rendering.of(spec.data), spec.data.max_prompt_tokens, "x")[:3]
    assert [p.ids for p in families["mini-tiny-math"]] == [p.ids for p in expected] and len(expected) == 3

    config = tmp_path / "r.yaml"
    config.write_text(yaml.safe_dump({"experiment": str(root / "configs/tiny-paper.yaml"), "opd_steps": 2,
                                      "families": {"mini": str(tmp_path / "suite")},
                                      "arms": [{"name": "draft-opd"}, {"name": "sft", "kind": "sft"}]}))
    assert load_reproduce_spec(config).families == {"mini": str(tmp_path / "suite")}
    with pytest.raises(OpdError, match="families: mini: .*nowhere does not exist .expected a prompts jsonl or a built"):
        load_reproduce_spec(config, [f"families={{mini: {tmp_path / 'nowhere'}}}"])


def test_the_ceiling_table_gives_each_arms_share_of_the_reachable_gain():
    from opd.reproduce.report import _ceiling_table
    from opd.reproduce.spec import ArmResult

    def rows(greedy: float, sampled_q: float, q_ceiling: float) -> dict[str, list[dict]]:
        return {"heldout": [{"sampling": "greedy", "tau": greedy, "ceiling": 5.0},
                            {"sampling": "sampled-q", "tau": sampled_q, "ceiling": q_ceiling},
                            {"sampling": "decoded", "tau": 2.0, "ceiling": None}]}

    def result(arm: str, seed: int, final: dict, initial: dict | None = None) -> ArmResult:
        return ArmResult(arm, seed, steps=1, flops={"total": 1.0}, curve=[], final={}, final_rows=final,
                         initial_rows=initial or {})

    warm = rows(3.0, 2.0, 8.0)
    results = [result("draft-opd", 0, rows(4.0, 3.0, 8.0), warm), result("draft-opd", 1, rows(4.2, 3.4, 7.8), warm),
               result("sft", 0, rows(2.0, 1.0, 8.0))]
    table = "\n".join(_ceiling_table(results, ["draft-opd", "sft"]))
    assert "| arm | heldout greedy | heldout sampled-q |" in table  # no column without a ceiling
    assert "| ceiling (τ) | 5.000 | 8.000 |" in table
    assert "| warm drafter | 50% | 14% |" in table
    assert "| draft-opd | 78% | 32% |" in table  # (3/4 + 3.2/4) / 2; (2/7 + 2.4/6.8) / 2
    assert "| sft | 25% | 0% |" in table
