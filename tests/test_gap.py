"""The gap diagnostic: every live slot of a drafter's blocks classified against the argmax oracle on the same text."""

from __future__ import annotations

import pytest
import torch

from opd.decoding.record import SequenceRecord
from opd.decoding.sampling import Sampling, target_probs
from opd.eval.gap import SlotFacts, gap_report, slot_facts
from opd.tiny.micro import micro_target

K = 4


def facts(argmax: list[int], top1: list[float] | None = None) -> SlotFacts:
    n = len(argmax)
    return SlotFacts(torch.tensor(argmax), torch.tensor(top1 or [0.95] * n), torch.zeros(n))


def test_each_live_slot_gets_the_outcome_its_tokens_give():
    # response tokens 10..16; the target's argmax differs from the committed token at index 3 (a sampled token)
    rec = SequenceRecord(key=0, prompt_ids=[1], response_ids=[10, 11, 12, 13, 14, 15, 16],
                         anchors=[0, 2, 5], drafts=[[11, 9, 9], [13, 14, 99], [16, 9, 9]], accepted=[1, 2, 1])
    argmax = facts([10, 11, 12, 77, 14, 15, 16], top1=[0.95, 0.95, 0.6, 0.3, 0.95, 0.95, 0.95])
    report = gap_report([rec], [argmax], K, oracle_tau=3.0)
    counts = report.by_position.counts
    assert counts["k=1"] == {"both": 2, "lost": 0, "won": 1, "neither": 0}  # 11 and 16 both; 13 won (argmax 77)
    assert counts["k=2"] == {"both": 1, "lost": 1, "won": 0, "neither": 0}  # 12 lost (drafted 9); 14 both
    assert counts["k=3"] == {"both": 0, "lost": 1, "won": 0, "neither": 0}  # 15 lost (drafted 99); block 2 ends
    assert report.by_top1.counts["[0.5, 0.7)"]["lost"] == 1 and report.by_top1.counts["[0, 0.5)"]["won"] == 1
    assert [row["share_of_lost"] for row in report.by_position.rows()] == [0.0, 0.5, 0.5]


def test_a_drafter_that_accepts_off_the_argmax_wins_a_slot():
    rec = SequenceRecord(key=0, prompt_ids=[1], response_ids=[5, 6, 7], anchors=[0], drafts=[[6, 7, 8]],
                         accepted=[2])
    report = gap_report([rec], [facts([5, 9, 7])], K, oracle_tau=1.5)
    assert report.totals() == {"both": 0.5, "lost": 0.0, "won": 0.5, "neither": 0.0}


def test_at_greedy_the_lost_slots_are_the_first_rejections_inside_the_response():
    """Every committed token is the argmax: a block's accepted slots are `both` and its first rejection `lost`."""
    gen = torch.Generator().manual_seed(0)
    records, all_facts = [], []
    for i in range(20):
        response = torch.randint(0, 30, (25,), generator=gen).tolist()
        anchors, drafts, accepted, a = [], [], [], 0
        while a < len(response) - 1:
            r = int(torch.randint(0, K, (1,), generator=gen))
            r = min(r, len(response) - 1 - a)
            block = [response[a + k] if k <= r else 99 for k in range(1, K)]
            anchors.append(a), drafts.append(block), accepted.append(r)
            a += r + 1
        records.append(SequenceRecord(key=i, prompt_ids=[1], response_ids=response, anchors=anchors, drafts=drafts,
                                      accepted=accepted))
        all_facts.append(facts(response))
    report = gap_report(records, all_facts, K, oracle_tau=4.0)
    counts = {o: sum(c[o] for c in report.by_position.counts.values()) for o in ("both", "lost", "won", "neither")}
    rejections = sum(r < K - 1 and a + r + 1 < len(rec.response_ids)
                     for rec in records for a, r in zip(rec.anchors, rec.accepted))
    assert counts == {"both": sum(sum(rec.accepted) for rec in records), "lost": rejections, "won": 0, "neither": 0}


@pytest.mark.parametrize("sampling", [Sampling(0.0), Sampling(0.6, 5, 0.95)])
def test_slot_facts_equal_the_full_logits(sampling):
    target = micro_target(seed=0, vocab_size=16, layer_ids=[0, 1]).double()
    samples = [SequenceRecord(key=i, prompt_ids=[1, 2, 3][: i + 1], response_ids=[4, 5, 6, 7, 8][: 5 - i])
               for i in range(3)]
    got = slot_facts(target, samples, sampling, batch_size=2)
    processing = sampling if not sampling.greedy else Sampling(1.0)
    for rec, fact in zip(samples, got):
        ids = torch.tensor([rec.prompt_ids + rec.response_ids])
        logits = target(ids).logits[0, len(rec.prompt_ids) - 1 : -1]
        probs = target_probs(logits, processing)
        assert torch.equal(fact.argmax, logits.argmax(-1))
        assert torch.allclose(fact.top1.double(), probs.max(-1).values.double(), atol=1e-6)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        assert torch.allclose(fact.entropy.double(), entropy.double(), atol=1e-6)


def test_opd_gap_reports_every_drafter_on_every_stored_setting(micro_spec_file, micro_assets, tmp_path, capsys):
    """End to end on the micro models: held-out samples drawn by `opd gen-samples --eval`, two drafters diagnosed;
    each report's outcomes cover its live slots, and the warm drafter that drew the samples has the τ that
    `opd eval` gives offline on them."""
    import json

    from opd.cli import main
    from opd.spec import load_spec

    samples, out = tmp_path / "eval.jsonl", tmp_path / "gap.json"
    assert main(["gen-samples", str(micro_spec_file), "--eval", "--engine", "speculative", "--out", str(samples)]) == 0
    assert main(["gap", str(micro_spec_file), "--samples", str(samples), "--draft", f"warm={micro_assets['drafter']}",
                 "--draft", f"again={micro_assets['drafter']}", "--json", str(out)]) == 0
    reports = json.loads(out.read_text())
    settings = [s.name for s in load_spec(micro_spec_file).eval.sampling if s.draft == "argmax"]
    assert [(r["setting"], r["drafter"]) for r in reports] == [(s, d) for s in settings for d in ("warm", "again")]
    for r in reports:
        assert sum(r["totals"].values()) == pytest.approx(1.0)
        assert sum(row["slots"] for row in r["by_position"]) == sum(row["slots"] for row in r["by_top1"])
        assert 1.0 <= r["tau"] and r["ceiling_share"] == pytest.approx((r["tau"] - 1) / (r["ceiling"] - 1))
    greedy = reports[0]
    assert greedy["totals"]["won"] == 0 and greedy["totals"]["neither"] == 0  # every greedy token is the argmax
    assert reports[0]["tau"] == reports[1]["tau"]  # the same weights, the same blocks
    assert main(["eval", str(micro_spec_file), "--samples", str(samples), "--json", str(tmp_path / "eval.json")]) == 0
    offline = {row["sampling"]: row["tau"] for row in json.loads((tmp_path / "eval.json").read_text())["rows"]}
    assert offline["greedy"] == pytest.approx(greedy["tau"])


def test_a_drafter_named_twice_is_one_line(micro_spec_file, capsys):
    from opd.cli import main

    assert main(["gap", str(micro_spec_file), "--draft", "a=x", "--draft", "a=y"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --draft 'a=y': label 'a' is used twice (expected LABEL=PATH to "
                                               "tell them apart)")
