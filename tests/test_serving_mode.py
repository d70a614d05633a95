"""The serving mode as part of a recipe (`serving`, `replay.teacher: served`, `loss.objective`): what the spec
refuses in one line, rollouts that decode in the serving setting, and `opd run` training for it end to end."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from opd.cli import main
from opd.distill.acceptance_loss import sft_block_slots
from opd.distill.losses import sft_log_weight_sum, teacher_processing
from opd.spec import LossSpec, SpecError, load_spec
from opd.train.rollout import rollout_sampling

ROOT = Path(__file__).resolve().parents[1]
TINY2 = ROOT / "configs" / "tiny-dflash2.yaml"
SAMPLED = "serving={draft: sample, temperature: 0.6, top_p: 0.95, top_k: 20}"


def _load(*overrides: str):
    return load_spec(TINY2, list(overrides), check_paths=False)


@pytest.mark.parametrize("overrides, message", [
    (["loss.objective=one_minus_alpha"], "loss.objective: one_minus_alpha without a serving section"),
    (["replay.teacher=served"], "replay.teacher: served without a serving section"),
    (["serving={temperature: 0.6}", "loss.objective=lk"], "loss.objective: lk with serving.draft argmax"),
    ([SAMPLED, "loss.objective=lk", "replay.teacher_topk=64"], "replay.teacher_topk: 64 with loss.objective lk"),
    ([SAMPLED, "rollout.source=target"], "rollout.source: target with serving.draft sample"),
    ([SAMPLED, "rollout.temperature=1.0"], "rollout.temperature: 1 differs from serving.temperature 0.6"),
    (["serving={temperature: 0.6, top_k: 20}", "replay.teacher=served", "loss.kl_mode=mixed"],
     "replay.teacher: served with loss.kl_mode mixed"),
    (["serving={draft: sample}"], "serving.draft: sample at temperature 0"),
    (["sft.acceptance_weight=1"], "sft.acceptance_weight: 1 without a serving section"),
    ([SAMPLED, "sft.acceptance_weight=1"], "sft.acceptance_weight: 1 with loss.objective kl"),
])
def test_a_recipe_the_drafter_cannot_serve_is_refused_in_one_line(overrides, message):
    with pytest.raises(SpecError) as err:
        _load(*overrides)
    assert any(m.startswith(message) for m in err.value.messages), err.value.messages
    assert all("\n" not in m for m in err.value.messages)


def test_an_eagle3_drafter_has_no_realized_q_to_sample():
    with pytest.raises(SpecError) as err:
        load_spec(ROOT / "configs" / "tiny-eagle3.yaml", [SAMPLED], check_paths=False)
    assert any(m.startswith("serving.draft: sample with an eagle3 drafter") for m in err.value.messages)


def test_rollouts_decode_in_the_serving_setting_and_mix_adds_point_mass_batches():
    spec = _load(SAMPLED, "loss.objective=expected_length", "replay.teacher=served")
    assert (spec.rollout.temperature, spec.rollout.top_p, spec.rollout.top_k) == (0.6, 0.95, 20)
    own, mixed = rollout_sampling(spec, 0), rollout_sampling(spec, 1)
    assert own.sample_drafts and (own.temperature, own.top_k, own.top_p) == (0.6, 20, 0.95)
    assert not mixed.sample_drafts and mixed.temperature == spec.rollout.mix[0].temperature
    served = teacher_processing(spec.replay, spec.serving)
    assert (served.temperature, served.top_k, served.top_p) == (0.6, 20, 0.95)
    assert load_spec(TINY2, [SAMPLED, "rollout.temperature=0.6"], check_paths=False).rollout.temperature == 0.6
    assert _load().serving is None and not rollout_sampling(_load(), 0).sample_drafts


# The micro drafter is random, so its q rarely falls below p̃ where α has a gradient: the LK hybrid's KL still
# trains its layers; the expected length, on the served p̃ at T=1, also reaches the selector.
@pytest.mark.parametrize("objective, gradient, trained", [("expected_length", "score", ("candidate_selector.", "layers.")),
                                                          ("lk", "pathwise", ("layers.",))])
def test_opd_run_trains_a_dflash2_drafter_for_sampled_serving(micro_spec_file, micro_dflash2, objective,  # noqa: F811
                                                              gradient, trained, tmp_path, capsys):
    """Rollouts draft from the selector's q at the serving setting and the acceptance objective trains the
    drafter's layers and its selector (whose q it is), with the selector's own term off."""
    run_dir = tmp_path / "run"
    args = ["run", str(micro_spec_file), "--set", f"models.drafter_path={micro_dflash2}", "--set",
            "serving={draft: sample, temperature: 1.0, top_p: 0.95, top_k: 40}", "--set", "replay.teacher=served",
            "--set", f"loss.objective={objective}", "--set", f"loss.prefix_gradient={gradient}", "--set",
            "loss.selector_weight=0", "--set", f"tracking.run_dir={run_dir}", "--set", "steps=2", "--set",
            "eval.every=0"]
    assert main(args) == 0, capsys.readouterr().err
    assert "acceptance of drafts sampled from q" in capsys.readouterr().out
    saved = sorted(p.parent for p in run_dir.rglob("config.json") if "dflash_config" in p.read_text())[-1]
    with safe_open(str(saved / "model.safetensors"), "pt") as after, \
            safe_open(str(Path(micro_dflash2) / "model.safetensors"), "pt") as before:
        changed = {name for name in before.keys() if not torch.equal(after.get_tensor(name), before.get_tensor(name))}
    assert all(any(n.startswith(prefix) for n in changed) for prefix in trained), sorted(changed)


def test_sft_slots_weigh_as_sfts_cross_entropy():
    """Per-slot objectives take SFT's weights exp(-(k-1)/gamma) over the step's sum (so they sum to 1 over the step's
    valid slots); the expected length weighs every valid slot 1 / ((K-1) x the step's blocks)."""
    valid = torch.tensor([[True, True, True], [True, True, False]])
    before = torch.zeros(2, 3, dtype=torch.long)
    log_sum = sft_log_weight_sum(valid, 2.0)
    per_slot = sft_block_slots(before, valid, LossSpec(objective="one_minus_alpha"), gamma=2.0,
                               log_weight_sum=log_sum, step_blocks=2)
    assert float(per_slot.coef.sum()) == pytest.approx(1.0) and float(per_slot.coef[1, 2]) == 0.0
    assert float(per_slot.coef[0, 1] / per_slot.coef[0, 0]) == pytest.approx(math.exp(-0.5))
    length = sft_block_slots(before, valid, LossSpec(objective="expected_length"), gamma=2.0, log_weight_sum=log_sum,
                             step_blocks=4)
    assert torch.equal(length.coef, valid.double() / 12)


def test_opd_sft_trains_the_selector_through_the_acceptance_term(micro_spec_file, micro_dflash2,  # noqa: F811
                                                                tmp_path, capsys):
    """`sft.acceptance_weight` adds the serving mode's acceptance on SFT's teacher-forced slots: with the selector's
    own term off, the selector trains (it is frozen without the acceptance term: test_dflash2)."""
    out = tmp_path / "sft"
    args = ["sft", str(micro_spec_file), "--set", f"models.drafter_path={micro_dflash2}", "--set",
            "serving={draft: sample, temperature: 0.5, top_p: 0.9, top_k: 3}", "--set", "rollout.temperature=0.5",
            "--set", "replay.teacher=served", "--set", "loss.objective=expected_length", "--set",
            "sft.acceptance_weight=1", "--set",
            "loss.selector_weight=0", "--out", str(out), "--set", "sft.epochs=1", "--set", "sft.batch_size=20",
            "--set", "sft.anchors_per_seq=2", "--set", "sft.response_max_new_tokens=6"]
    assert main(args) == 0, capsys.readouterr().err
    with safe_open(str(out / "model.safetensors"), "pt") as after, \
            safe_open(str(Path(micro_dflash2) / "model.safetensors"), "pt") as before:
        changed = {name for name in before.keys() if not torch.equal(after.get_tensor(name), before.get_tensor(name))}
    assert any(n.startswith("candidate_selector.") for n in changed), sorted(changed)


def test_the_serving_mode_is_evaluated_beside_the_eval_settings(tmp_path):
    """A spec with a serving section measures the mode it trains for: its exact setting, q-sampled drafts
    included, is an eval row named `serving` unless an eval setting already is it, and the table says what each
    row decodes with."""
    from opd.commands.run import comparison_table
    from opd.eval.row import EvalRow

    preset = tmp_path / "q.yaml"
    preset.write_text(f"base: [{ROOT / 'configs/tiny.yaml'}, {ROOT / 'configs/presets/sampled-q-serving.yaml'}]\n")
    spec = load_spec(preset)
    rows = {s.name: (s.temperature, s.top_p, s.top_k, s.draft) for s in spec.eval.sampling}
    assert rows == {"greedy": (0.0, 1.0, 0, "argmax"), "sampled": (0.6, 0.95, 20, "argmax"),
                    "serving": (0.6, 0.95, 20, "sample")}
    already = ["eval.sampling=[{name: q, temperature: 0.6, top_p: 0.95, top_k: 20, draft: sample}]"]
    assert [s.name for s in load_spec(preset, already).eval.sampling] == ["q"]  # no second copy of it
    with pytest.raises(SpecError, match="eval.sampling: the setting named 'serving' differs from the serving"):
        load_spec(preset, ["eval.sampling=[{name: serving, temperature: 0.0}]"])
    assert [s.name for s in load_spec(ROOT / "configs/tiny.yaml").eval.sampling] == ["greedy", "sampled"]

    row = EvalRow("serving", 4, 2.0, 2.0, [], [], None, None, None, None)
    caption = str(comparison_table(spec, [row], [row]).caption)
    assert caption.startswith("rows: serving = T=0.6, top-p 0.95, top-k 20, drafts sampled from q")
