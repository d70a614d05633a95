"""`opd eval` end to end on micro assets, and the acceptance statistics it reports."""

from __future__ import annotations

import json

import pytest

from opd.cli import main
from opd.decoding.record import SequenceRecord
from opd.eval.acceptance import AcceptanceStats


def test_acceptance_stats_by_hand():
    # block size 4: 3 drafted slots; every block's bonus lies inside its response
    a = SequenceRecord(key=0, prompt_ids=[1], response_ids=list(range(8)), anchors=[0, 1, 5], accepted=[0, 3, 1])
    b = SequenceRecord(key=1, prompt_ids=[1], response_ids=list(range(5)), anchors=[0], accepted=[3])
    stats = AcceptanceStats.from_records([a, b], block_size=4)
    assert stats.tau == pytest.approx(((1 + 4 + 2) / 3 + 4) / 2)
    assert stats.tau_token_weighted == pytest.approx((1 + 4 + 2 + 4) / 4)
    assert stats.survival == pytest.approx([3 / 4, 2 / 4, 2 / 4])
    assert stats.first_rejection == pytest.approx([1 / 4, 1 / 4, 0, 2 / 4])  # positions 1..3, then full accept


def test_opd_eval_prints_the_table_and_writes_json(micro_spec_file, tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = main(["eval", str(micro_spec_file), "--draft", "random", "--json", str(out),
                 "--set", "eval.sampling=[{name: greedy}, {name: sampled, temperature: 0.6, top_p: 0.95, top_k: 20}]"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "greedy" in printed and "sampled" in printed and "full accept" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["sampling"] for r in rows] == ["greedy", "sampled"]
    greedy = rows[0]
    assert greedy["greedy_match"] == 1.0  # speculative greedy == autoregressive greedy, token for token
    assert 1.0 <= greedy["tau"] <= 4.0 and greedy["speedup"] > 0
    assert len(greedy["survival"]) == 3 and sum(greedy["first_rejection"]) == pytest.approx(1.0)
    # the diagnostic: both rules on both settings' states; on greedy states the greedy rule is what happened
    assert "Expected τ from p and q" in printed
    assert set(greedy["expected"]) == set(rows[1]["expected"]) == {"greedy", "sampled"}
    assert greedy["expected"]["greedy"]["tau"] == pytest.approx(greedy["tau"])


def test_opd_eval_missing_drafter_is_one_line(micro_spec_file, capsys):
    assert main(["eval", str(micro_spec_file), "--draft", "/nonexistent/drafter"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/nonexistent/drafter" in err[0]


def test_the_evaluator_decodes_the_weights_it_is_handed(micro_spec_file):
    """The periodic eval runs on a snapshot, in a drafter copy of the evaluator's own: its rows are those of the
    snapshot's weights (here a drafter other than the copy it started with), at the snapshot's step; a corrupted
    snapshot is refused; `checkpoint` is `opd run`'s before/after evaluation of a drafter directory."""
    import torch

    from opd.errors import OpdError
    from opd.eval.online import evaluate
    from opd.models.build import Models, build_models
    from opd.spec import load_spec
    from opd.train.evaluator import Evaluator
    from opd.train.messages import WeightSnapshot

    both = "eval.sampling=[{name: greedy}, {name: sampled, temperature: 1.0}]"
    spec = load_spec(micro_spec_file, [both])
    evaluator = Evaluator(spec)
    other = build_models(spec, "random", seed=5)
    with torch.no_grad():  # weights large enough to draft other tokens than the warm drafter does
        for param in other.drafter.parameters():
            if param.dim() > 1:
                param.normal_(std=1.0)
    result = evaluator(WeightSnapshot.of(other.drafter.state_dict(), 7))
    e = spec.eval

    def direct(models: Models, **kwargs) -> list:
        return evaluate(models, evaluator.prompts, e.sampling, max_new_tokens=e.max_new_tokens,
                        batch_size=e.batch_size, seed=spec.seed, **kwargs)

    expected = direct(other, baseline=False, diagnose=True)
    warm = direct(build_models(spec), baseline=False, diagnose=True)

    def sampled_rule(rows) -> float:  # p_T(argmax q) on greedy states: continuous in the drafter's weights
        return rows[0].expected["sampled"].tau_token_weighted

    assert result.step == 7 and sampled_rule(result.rows) == sampled_rule(expected) != sampled_rule(warm)
    assert [r.tau for r in result.rows] == [r.tau for r in expected]
    corrupted = WeightSnapshot.of(other.drafter.state_dict(), 8)
    next(iter(corrupted.state.values())).add_(1.0)
    with pytest.raises(OpdError, match="checksum mismatch"):
        evaluator(corrupted)
    rows = evaluator.checkpoint(spec.models.drafter_path)
    reference = direct(build_models(spec), baseline=True)
    assert [(r.tau, r.greedy_match, r.survival) for r in rows] == \
        [(r.tau, r.greedy_match, r.survival) for r in reference]
    assert rows[0].speedup is not None and rows[0].greedy_match == 1.0
    assert torch.equal(next(iter(evaluator.models.drafter.state_dict().values())),
                       next(iter(other.drafter.state_dict().values())))  # checkpoint() left the copy alone
