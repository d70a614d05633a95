"""`rollout.source`: speculative (the paper's path), target (any lossless sampler, blocks rebuilt by the scorer)
and samples (a stored sample file), through the local trainer and `opd gen-samples`. The Ray path is in
tests/test_ray.py, on its shared cluster."""

from __future__ import annotations

import json
import re

import pytest
import torch

from opd.cli import main
from opd.data.prompts import load_tokenizer, train_prompts
from opd.errors import OpdError
from opd.sources.store import GEN_CHUNK, SampleStore, samples_needed
from opd.train.local import LocalTrainer
from tests.helpers import forked
from tests.helpers.local_runs import assert_every_source_trains_alike, losses, sample_file, spec_for
from tests.helpers.specs import validate_errors


def test_greedy_rollouts_train_identically_from_every_source(micro_spec_file, tmp_path):
    """A greedy target sample is the same text whoever draws it, and the scorer rebuilds exactly the blocks the
    speculative rollout records with the same weights: every source takes the same steps. The learning rate is
    high enough that the drafts change from step to step, so a rebuild with stale weights would not pass."""
    greedy = ["rollout.temperature=0", "optim.lr=0.03", "steps=4",
              "models.dtype=float64"]  # the shared forward and the packed row differ in shape: float32 rounding
    assert_every_source_trains_alike(micro_spec_file, tmp_path, greedy, autoregressive=True)


def test_sampled_target_rollouts_are_rebuilt_with_the_newest_drafter(micro_spec_file, tmp_path):
    """T=1: the rollout samples with the warm drafter it never updates; the scorer rebuilds every batch with the
    version published by the step before, so no batch lags, and the rebuilt blocks are real ones."""
    spec = spec_for(micro_spec_file, tmp_path, "sampled", "rollout.source=target")
    trainer = LocalTrainer(spec, track=False)
    trainer.start()
    warm = {k: v.clone() for k, v in trainer.rollout.sampler.decoder.drafter.state_dict().items()}
    for step in range(3):
        report = trainer.train_step()
        assert report.metrics["policy_lag"] == 0
        assert trainer.scorer.draft_version == step + 1
    batch = trainer.scorer(trainer.rollout.run(6))
    assert batch.batch.draft_version == 3 and all(r.anchors and r.anchors[0] == 0 for r in batch.batch.records)
    assert all(torch.equal(v, warm[k]) for k, v in trainer.rollout.sampler.decoder.drafter.state_dict().items())


def test_gen_samples_resumes_and_counts_what_the_budget_needs(micro_spec_file, tmp_path):
    path = sample_file(micro_spec_file, tmp_path, count=1)
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 40 and {r["sample"] for r in rows} == {0}
    assert rows[0]["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    sample_file(micro_spec_file, tmp_path, count=2)  # only sample 1 of each prompt is added
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 80 and rows[:40] == [json.loads(line) for line in open(path)][:40]
    # 12 steps x 4 prompts = 48 draws of 40 prompts reach epoch 1: two samples each; a greedy setting needs one
    long = spec_for(micro_spec_file, tmp_path, "long", "steps=12", "rollout.mix=[{temperature: 0}]")
    assert samples_needed(long, 40) == [2, 1]


def test_mixed_settings_read_their_own_samples(micro_spec_file, tmp_path):
    mix = "rollout.mix=[{temperature: 0.0}]"
    path = sample_file(micro_spec_file, tmp_path, mix, count=1)
    spec = spec_for(micro_spec_file, tmp_path, "mixed", mix, "rollout.source=samples", f"rollout.samples_path={path}")
    trainer = LocalTrainer(spec, track=False)
    rows = [json.loads(line) for line in open(path)]
    by = {(r["sampling"]["temperature"], r["id"]): r["response_ids"] for r in rows}
    for index in (0, 1):
        batch = trainer.rollout.run(index)
        temperature = [1.0, 0.0][index % 2]
        for (prompt, _), rec in zip(trainer.rollout.prompts_for(index), batch.records):
            assert rec.response_ids == by[(temperature, prompt.id)] and rec.anchors == []
    assert losses(spec)  # and it trains


def test_two_different_rows_for_one_sample_are_refused(micro_spec_file, tmp_path, capsys):
    rows = [json.loads(line) for line in open(sample_file(micro_spec_file, tmp_path))]
    rows.append({**rows[3], "response_ids": rows[3]["response_ids"][:-1] or [1]})
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:2]))  # repeats are fine
    code = main(["validate", str(micro_spec_file), "--set", "rollout.source=samples",
                 "--set", f"rollout.samples_path={tmp_path / 'bad.jsonl'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "line 41: a second, different row for sample 0 of prompt" in err[0], err


@pytest.mark.parametrize(("edit", "message"), [
    (lambda row: row.update(sampling={"temperature": 0.7, "top_p": 1.0, "top_k": 0}),  # skipped, so one missing
     "has 0 sample.* at temperature 1, top_p 1, top_k 0, but the step budget needs 1 per prompt"),
    (lambda row: row.update(id="nobody"), "line 1: prompt id 'nobody' is not in data.train_prompts"),
    (lambda row: row.update(prompt_ids=[1, 2]), "line 1: prompt .* has other prompt_ids than this run renders"),
    (lambda row: row.pop("sample"), "line 1: sample: field required"),
    # what made the row (issue 33: each was trained on silently, or a traceback much later)
    (lambda row: row.update(max_new_tokens=4), "line 1: max_new_tokens is 4, this run's is 12 .*opd gen-samples"),
    (lambda row: row["made_by"].update(target="sha256:0123"), "line 1: made_by.target is sha256:0123, this run's is "),
    (lambda row: row["made_by"].update(render="chat"), "line 1: made_by.render is chat, this run's is raw"),
    (lambda row: row.pop("made_by"), "line 1: a row from before sample rows said what made them .*opd gen-samples "
     "CONFIG --out NEW.jsonl`, then pass `--set rollout.samples_path=NEW.jsonl"),
    (lambda row: [row.pop(k) for k in ("sampling", "sample", "made_by", "max_new_tokens", "flops")],
     "line 1: an SFT data row from before the sample store .*opd gen-samples CONFIG --sft"),
    (lambda row: row["flops"].update(bogus=1), "line 1: flops.bogus: extra inputs are not permitted"),
    (lambda row: row.update(flops=[1, 2]), "line 1: flops: "),
    (lambda row: row.update(response_ids=[1, 10**6]), "line 1: response token 1000000 is outside the target's vocab"),
    (lambda row: row.update(response_ids=["1", "2"]), "line 1: response_ids.0: input should be a valid integer"),
    (lambda row: row.update(response_ids=list(range(2, 15))), "line 1: 13 response tokens, past its max_new_tokens 12"),
])
def test_a_bad_sample_file_is_one_error_before_any_model_loads(micro_spec_file, tmp_path, capsys, edit, message):
    path = sample_file(micro_spec_file, tmp_path)
    rows = [json.loads(line) for line in open(path)]
    edit(rows[0])
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["validate", str(micro_spec_file), "--set", "rollout.source=samples",
                 "--set", f"rollout.samples_path={tmp_path / 'bad.jsonl'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: rollout.samples_path: "), err
    assert re.search(message, err[0]), err


def test_too_few_sampled_samples_name_the_count_needed(micro_spec_file, tmp_path):
    path = sample_file(micro_spec_file, tmp_path, count=1)
    spec = spec_for(micro_spec_file, tmp_path, "long", "steps=12", "rollout.source=samples",
                    f"rollout.samples_path={path}")
    pool = train_prompts(spec.data, load_tokenizer(spec.models.tokenizer))
    with pytest.raises(OpdError, match="has 1 sample.* but the step budget needs 2 per prompt; sampled samples may "
                                       "not repeat across epochs .expected `opd gen-samples CONFIG --samples 2`"):
        SampleStore.for_rollout(spec, pool).check_budget(spec)
    greedy = sample_file(micro_spec_file, tmp_path / "g", "rollout.temperature=0")
    greedy_spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(
        update={"temperature": 0.0, "samples_path": greedy})})
    SampleStore.for_rollout(greedy_spec, pool).check_budget(greedy_spec)  # greedy samples repeat across epochs


@pytest.mark.parametrize(("sets", "message"), [
    (["rollout.source=samples"], "samples_path: none with source samples"),
    (["rollout.samples_path=x.jsonl"], "samples_path: x.jsonl but source is speculative"),
    (["rollout.source=samples", "rollout.samples_path=nowhere.jsonl"], "rollout.samples_path: nowhere.jsonl does not"),
    (["rollout.source=target", "replay.anchors=random"], "replay.anchors: random with rollout.source target"),
])
def test_source_spec_errors_are_one_line(micro_spec_file, capsys, sets, message):
    assert message in validate_errors(micro_spec_file, sets, capsys)


def test_a_shared_sample_cache_is_drawn_once_and_charged_to_every_reader(micro_spec_file, tmp_path):
    """rollout.source target with a samples_path: the first run draws into the file, the second reads it and
    draws nothing; both are charged the stored cost, equal to what drawing live costs, and train identically."""
    cache = tmp_path / "shared.jsonl"
    live_trainer = LocalTrainer(spec_for(micro_spec_file, tmp_path, "live", "rollout.source=target"), track=False)
    live = live_trainer.run()
    runs = []
    for name in ("first", "second"):
        spec = spec_for(micro_spec_file, tmp_path, name, "rollout.source=target", f"rollout.samples_path={cache}")
        trainer = LocalTrainer(spec, track=False)
        runs.append((trainer.run(), trainer.session.flops.as_dict(), cache.read_text()))
    (first, first_flops, first_text), (second, second_flops, second_text) = runs
    # the first run's first batch drew the batches after it along, GEN_CHUNK samples in one call, enough for the
    # 3 steps x 4 prompts of both runs: the second draws nothing
    assert second_text == first_text and len(first_text.splitlines()) == GEN_CHUNK
    assert first.losses == second.losses == pytest.approx(live.losses, rel=1e-6)
    assert first_flops == second_flops == pytest.approx(live_trainer.session.flops.as_dict(), rel=1e-9)


def test_processes_filling_one_sample_file_draw_each_sample_once(micro_spec_file, tmp_path):
    """Two `opd gen-samples` processes (forked: tests/helpers/forked.py) fill one file that a killed writer left
    cut off mid-line; every sample is drawn once."""
    path = tmp_path / "concurrent.jsonl"
    path.write_text('{"id": "cut off by a kil')  # a writer killed mid-line
    args = ["gen-samples", str(micro_spec_file), "--samples", "2", "--out", str(path), "--set",
            f"tracking.run_dir={tmp_path / 'gen'}"]
    logs = [tmp_path / f"writer{i}.log" for i in range(2)]
    forked.join([forked.start(main, args, log=log) for log in logs], logs, timeout=300)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 80 and len({(r["id"], r["sample"]) for r in rows}) == 80


# ------------------------------------------------------------------------------- opd eval --samples (issue 33)


def _eval_error(micro_spec_file, samples, capsys) -> str:
    code = main(["eval", str(micro_spec_file), "--samples", str(samples)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --samples: "), err
    return err[0]


def test_eval_samples_missing_is_one_line_before_any_model_loads(micro_spec_file, tmp_path, capsys, monkeypatch):
    import opd.eval.online

    monkeypatch.setattr(opd.eval.online, "build_models", lambda *a, **k: pytest.fail("models loaded first"))
    line = _eval_error(micro_spec_file, tmp_path / "nope.jsonl", capsys)
    assert line.endswith("is not a file (expected held-out target samples; draw them with `opd gen-samples CONFIG "
                         f"--eval --out {tmp_path / 'nope.jsonl'}`)")


def test_eval_samples_from_another_target_are_refused(micro_spec_file, tmp_path, capsys):
    """Offline τ on another target's samples measured 1.071 against 1.000 decoded: now the row's target digest
    differs from the run's, and the read stops there."""
    samples = tmp_path / "eval.jsonl"
    assert main(["gen-samples", str(micro_spec_file), "--eval", "--out", str(samples)]) == 0
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    for row in rows:
        row["made_by"]["target"] = "sha256:another0target00"
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert "line 1: made_by.target is sha256:another0target00, this run's is sha256:" in _eval_error(
        micro_spec_file, samples, capsys)


def test_training_samples_given_as_eval_samples_name_the_eval_draw(micro_spec_file, tmp_path, capsys):
    """A rollout sample file holds the training prompts: the held-out ones are missing, and the hint names
    `--eval`, the draw that makes them."""
    path = sample_file(micro_spec_file, tmp_path, "rollout.temperature=0")
    capsys.readouterr()
    line = _eval_error(micro_spec_file, path, capsys)
    assert "has no sample 0 of prompt" in line and line.endswith("(draw this run's into a new file with `opd "
                                                                 "gen-samples CONFIG --eval --out NEW.jsonl`, then "
                                                                 "pass `--samples NEW.jsonl`)")
