"""`opd suite eval`: offline suite τ is the decoded τ block by block on the tiny models, the ceiling bounds every
drafter at greedy, MT-Bench's second turn holds the target's own first answer, and the report is written
(opd/eval/suite.py, opd/eval/suite_report.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from opd.cli import main
from opd.data.prompts import load_tokenizer, prompt_key
from opd.data.suite import built_suite, load_suite, read_rows
from opd.data.suite_build import build_suite
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.eval.acceptance import AcceptanceStats
from opd.eval.suite import CEILING, evaluate_suite
from opd.eval.suite_report import metrics, write_report
from opd.models.build import build_models
from opd.spec import load_spec
from tests.helpers.suites import SOURCES, suite_yaml, write

ROOT = Path(__file__).resolve().parents[1]
NEW = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The shipped tiny target and warm drafter on a small tiny suite: 6 held-out math prompts and 3 real HumanEval
    stubs (out of distribution), 24 new tokens, greedy and T=0.6; the warm drafter and a random one."""
    tmp = tmp_path_factory.mktemp("suite")
    suite = load_suite(suite_yaml(tmp, [{"name": "tiny-math", "count": 6, "max_new_tokens": NEW},
                                        {"name": "humaneval", "count": 3, "max_new_tokens": NEW}]))
    build_suite(suite, tmp / "suite", {}, log=lambda _: None)
    spec = load_spec(ROOT / "configs/tiny.yaml", ["models.device=cpu", "data.max_prompt_tokens=1024"])
    drafters = {"warm": str(ROOT / "opd/assets/tiny/drafter"), "random": "random"}
    result = evaluate_suite(spec, built_suite(tmp / "suite"), tmp / "suite", drafters, tmp / "out")
    return spec, result, tmp


def test_offline_suite_tau_is_the_decoded_tau_block_by_block(tiny):
    """The warm drafter drew the samples with the eval's keys, so its decodes are them: its rebuilt blocks on every
    benchmark and setting equal the speculative decoder's."""
    spec, result, tmp = tiny
    models = build_models(spec)
    decoder = SpeculativeDecoder(models.target, models.drafter, eos_id=models.eos_id)
    settings = {s.name: s for s in spec.eval.sampling}
    for (benchmark, setting, drafter), records in result.records.items():
        if drafter != "warm":
            continue
        keys = [r.key for r in records]
        decoded = decoder.generate([r.prompt_ids for r in records], Sampling.of(settings[setting]),
                                   max_new_tokens=NEW, seed=spec.seed, keys=keys)
        assert [(r.anchors, r.drafts, r.accepted) for r in records] == \
            [(r.anchors, r.drafts, r.accepted) for r in decoded], (benchmark, setting)
        stats = AcceptanceStats.from_records(decoded, models.drafter.block_size)
        cell = result.cell(benchmark, setting, "warm")
        assert (cell.tau, cell.tau_pooled) == pytest.approx((stats.tau, stats.tau_token_weighted), abs=1e-12)
        assert keys == [prompt_key(r["id"]) for r in read_rows(tmp / "suite" / f"{benchmark}.jsonl")]


def test_the_ceiling_bounds_every_drafter_at_greedy_and_math_beats_code(tiny):
    _, result, _ = tiny
    for benchmark in result.benchmarks:
        ceiling = result.cell(benchmark, "greedy", CEILING)
        assert ceiling.tau > 6  # K = 8: every block but a sequence's last accepts 7
        for drafter in result.drafters:
            cell = result.cell(benchmark, "greedy", drafter)
            assert cell.tau <= ceiling.tau and cell.tau_pooled <= ceiling.tau_pooled
            assert cell.beats_oracle == 0
    assert result.cell("tiny-math", "greedy", "warm").tau > result.cell("humaneval", "greedy", "warm").tau + 1
    assert result.average("greedy", "random") == 1.0


def test_the_report_has_the_papers_layout_both_taus_a_chart_and_metrics(tiny):
    _, result, tmp = tiny
    table, data, chart = write_report(result, tmp / "report")
    text = table.read_text()
    assert "| drafter | tiny-math | humaneval | avg | % of ceiling |" in text
    assert "| ceiling |" in text and "τ pooled" in text and "acceptance per position" in text
    saved = json.loads(data.read_text())
    cell = saved["cells"][1]
    assert {"tau", "tau_ci", "tau_pooled", "tau_pooled_ci", "survival", "beats_oracle"} <= cell.keys()
    assert saved["averages"]["greedy"]["warm"]["tau"] == pytest.approx(result.average("greedy", "warm"))
    assert chart.stat().st_size > 10_000
    keys = metrics(result)
    assert "suite_tiny-math_greedy_warm_tau" in keys and "suite_avg_sampled_ceiling_tau" in keys
    assert "suite_humaneval_sampled_random_accept_7" in keys


def test_mt_bench_two_turns_feed_the_targets_own_first_answer_back(chat_assets, tmp_path, capsys):
    """On a chat target: every second-turn prompt is the chat template over [question 1, the target's decoded first
    answer at that setting, question 2], and both turns are evaluated."""
    rows = [{**SOURCES["mtbench"][0], "question_id": i} for i in range(3)]
    source = write(tmp_path / "question.jsonl", rows)
    suite = suite_yaml(tmp_path, [{"name": "mtbench", "turns": 2, "max_new_tokens": 6}])
    assert main(["suite", "build", "--suite", suite, "--out", str(tmp_path / "s"), "--file", f"mtbench={source}"]) == 0
    spec = {"name": "chat", "engine": "local", "steps": 1,
            "models": {"target_path": chat_assets["target"], "drafter_path": chat_assets["drafter"],
                       "dtype": "float32", "device": "cpu",
                       "drafter": {"num_layers": 1, "block_size": 4, "target_layer_ids": [1, 2]}},
            "data": {"train_prompts": chat_assets["train"], "eval_prompts": chat_assets["heldout"],
                     "render": "chat", "enable_thinking": False, "max_prompt_tokens": 512},
            "rollout": {"batch_size": 2}, "optim": {"batch_size": 2},
            "tracking": {"run_dir": str(tmp_path / "runs")}}
    (tmp_path / "chat.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    assert main(["suite", "eval", str(tmp_path / "chat.yaml"), "--suite", str(tmp_path / "s"), "--draft",
                 f"d={chat_assets['drafter']}", "--out", str(out), "--no-mlflow"]) == 0
    assert "| d |" in capsys.readouterr().out
    tokenizer = load_tokenizer(chat_assets["target"])
    first, second = SOURCES["mtbench"][0]["turns"]
    for setting in ("greedy", "sampled"):
        turn1 = [json.loads(line) for line in (out / "samples" / "mtbench.jsonl").read_text().splitlines()]
        turn1 = [r for r in turn1 if r["sampling"]["temperature"] == (0 if setting == "greedy" else 0.6)]
        turn2 = {r["id"]: r for r in map(json.loads, (out / "samples" / f"mtbench-turn2-{setting}.jsonl")
                                         .read_text().splitlines())}
        assert len(turn1) == len(turn2) == 3
        for r in turn1:
            answer = tokenizer.decode(r["response_ids"], skip_special_tokens=True)
            served = [{"role": "user", "content": first}, {"role": "assistant", "content": answer},
                      {"role": "user", "content": second}]
            assert turn2[f"{r['id']}#turn2@{setting}"]["prompt_ids"] == tokenizer.apply_chat_template(
                served, add_generation_prompt=True, tokenize=True, return_dict=False, enable_thinking=False)
    saved = json.loads((out / "suite.json").read_text())
    assert {c["sequences"] for c in saved["cells"]} == {6}  # both turns of 3 questions


def test_an_interrupted_sample_draw_resumes_without_duplicates(tiny):
    """A draw killed mid-file (a partial last line) is finished by the next eval: every (prompt, setting) once."""
    spec, result, tmp = tiny
    path = tmp / "out" / "samples" / "tiny-math.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:5]) + lines[5][:20])
    again = evaluate_suite(spec, built_suite(tmp / "suite"), tmp / "suite", {"warm": result.drafters["warm"]},
                           tmp / "out")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    keys = [(r["id"], r["sampling"]["temperature"]) for r in rows]
    assert len(keys) == len(set(keys)) == 12
    for setting in result.settings:
        assert again.cell("tiny-math", setting, "warm") == result.cell("tiny-math", setting, "warm")


def test_the_speedup_column_decodes_each_drafter_on_the_subset(tiny):
    """With speedup prompts, every drafter's cell gets a decoded speedup over the target alone (the ceiling, never
    decoded, gets none), and the report leads each setting with the paper's speedup table."""
    from opd.eval.suite_report import markdown, metrics

    spec, first, tmp = tiny
    result = evaluate_suite(spec, built_suite(tmp / "suite"), tmp / "suite", {"warm": first.drafters["warm"]},
                            tmp / "out", speedup_prompts=2)
    warm = [c for c in result.cells if c.drafter == "warm"]
    assert warm and all(c.speedup is not None and c.speedup > 0 for c in warm)
    assert all(c.speedup is None for c in result.cells if c.drafter == "ceiling")
    assert [c.tau for c in warm] == [first.cell(c.benchmark, c.setting, "warm").tau for c in warm]  # same samples
    text = markdown(result)
    assert "speedup over the target alone (decoded subset)" in text
    assert all(f"{c.speedup:.2f}x" in text for c in warm)
    assert metrics(result)[f"suite_{warm[0].benchmark}_{warm[0].setting}_warm_speedup"] == warm[0].speedup
