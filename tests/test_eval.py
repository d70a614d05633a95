"""`opd eval` end to end on micro assets, and the acceptance statistics it reports."""

from __future__ import annotations

import json

import pytest

from opd.acceptance import AcceptanceStats
from opd.cli import main
from opd.decoding.record import SequenceRecord


def test_acceptance_stats_by_hand():
    a = SequenceRecord(key=0, prompt_ids=[1], accepted=[0, 3, 1])  # block size 4: 3 drafted slots
    b = SequenceRecord(key=1, prompt_ids=[1], accepted=[3])
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
