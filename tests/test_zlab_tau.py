"""τ counted as z-lab counts it: a block counts only the tokens it wrote into the response.

z-lab's `dflash_generate` records, per verification, the tokens written (accepted drafts + bonus, cut at the first
stop token and at the length limit), and its benchmark's "Average Acceptance length" is the mean over responses of
each response's mean. The project's authors' τ must equal it on the same decodes; the pooled τ, the survival
curve, the first-rejection histogram, the ceiling and the expected-acceptance diagnostic follow the same rule.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
import torch

from opd.data.prompts import load_prompts
from opd.decoding.record import SequenceRecord
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.eval.acceptance import AcceptanceStats, pooled_interval
from opd.eval.ceiling import oracle_records
from opd.eval.expected import ExpectedAcceptance
from opd.models.build import build_models
from opd.spec import load_spec

# z-lab's dflash_generate calls the HF target with `past_key_values` (dflash/model.py); the project's calls pass the
# cache under the name the installed transformers takes (opd/models/target.py)
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
ROOT = Path(__file__).resolve().parents[1]
K = 4  # block size of the hand-made records: 3 drafts per block


def _record(response_len: int, anchors: list[int], accepted: list[int], finish: str) -> SequenceRecord:
    """A decoded record as `SpeculativeDecoder` leaves it (final block clipped to the response)."""
    rec = SequenceRecord(key=0, prompt_ids=[1], response_ids=list(range(10, 10 + response_len)),
                         anchors=anchors, drafts=[[0] * (K - 1) for _ in anchors], accepted=accepted,
                         finish_reason=finish)
    rec.clip_to_response()
    return rec


def test_eos_inside_the_final_block_counts_only_what_the_block_wrote():
    # 6 tokens, eos last: block 0 writes 3 (tokens 1-3); block 1 accepted drafts 4, 5 (eos) and a third draft past
    # eos, so it wrote 2 tokens and its bonus never entered the response.
    rec = _record(6, [0, 3], [2, 3], "eos")
    assert rec.accepted == [2, 2]
    assert rec.written == [3, 2]
    assert rec.tau == pytest.approx(2.5)  # (3 + 2) / 2; the old count gave (3 + 3) / 2
    assert sum(rec.written) == len(rec.response_ids) - 1


def test_length_limit_inside_the_final_block():
    # max_new_tokens 5: block 1 (anchor 2) accepted all 3 drafts, of which 2 fit.
    rec = _record(5, [0, 2], [1, 3], "length")
    assert rec.written == [2, 2]
    assert rec.tau == pytest.approx(2.0)


@pytest.mark.parametrize(("accepted", "written"), [(1, 2), (2, 2)])
def test_a_final_block_that_ends_exactly_at_the_limit(accepted, written):
    """Room 2 after the anchor: accepted 1 puts the bonus on the last allowed token (all written, a real rejection);
    accepted 2 fills the room with drafts and the bonus falls past the limit (not written)."""
    rec = _record(5, [0, 2], [1, accepted], "length")
    assert rec.written == [2, written]
    assert rec.ends_unrejected(1) == (accepted == 2)


def test_a_full_block_cut_at_the_end_is_still_a_full_accept():
    rec = _record(4, [0], [3], "eos")  # all K-1 drafts accepted, the last one eos: the bonus lies past the end
    stats = AcceptanceStats.from_records([rec], K)
    assert stats.tau == stats.tau_token_weighted == 3.0
    assert stats.survival == [1.0, 1.0, 1.0]
    assert stats.first_rejection == [0.0, 0.0, 0.0, 1.0]


def _censored_set() -> list[SequenceRecord]:
    """Three mid-response blocks (rejected at 2, rejected at 3, full accept) and a final block cut by the length
    limit after 2 accepted drafts, whose third position lies past the response."""
    return [_record(12, [0, 2, 5, 9], [1, 2, 3, 3], "length")]


def test_survival_and_histogram_censor_a_cut_final_block():
    """The cut block is accepted at positions 1-2 and absent from position 3, not rejected there: P(accepted >= 3)
    is the share of the blocks at risk at 3 that accepted (1 of 2) times P(accepted >= 2) = 3/4."""
    stats = AcceptanceStats.from_records(_censored_set(), K)
    assert stats.survival == pytest.approx([1.0, 3 / 4, 3 / 8])  # the old count: [1, 3/4, 1/4]
    assert stats.first_rejection == pytest.approx([0.0, 1 / 4, 3 / 8, 3 / 8])
    assert sum(stats.first_rejection) == pytest.approx(1.0)
    assert stats.tau_token_weighted == pytest.approx(11 / 4)  # written 2 + 3 + 4 + 2; the old count gave 12 / 4


def test_without_censoring_the_survival_is_the_plain_share():
    rec = _record(20, [0, 2, 5, 9], [1, 2, 3, 3], "length")  # the same blocks, the last one now mid-response
    stats = AcceptanceStats.from_records([rec], K)
    assert stats.survival == pytest.approx([1.0, 3 / 4, 2 / 4])
    assert stats.first_rejection == pytest.approx([0.0, 1 / 4, 1 / 4, 2 / 4])


def test_pooled_tau_and_its_interval_count_written_tokens():
    records = [_record(6, [0, 3], [2, 3], "eos"), _record(5, [0, 2], [1, 3], "length"),
               _record(9, [0, 4], [3, 3], "eos")]
    stats = AcceptanceStats.from_records(records, K)
    assert stats.tau_token_weighted == pytest.approx((5 + 4 + 8) / 6)
    assert stats.tau == pytest.approx((2.5 + 2.0 + 4.0) / 3)
    # the delta method's interval of the ratio, from the written totals t_i = n_i - 1 and s_i = 2 steps each
    t, s = [5, 4, 8], [2, 2, 2]
    tau = sum(t) / sum(s)
    expected = 1.96 * (sum((ti - tau * si) ** 2 for ti, si in zip(t, s)) / 6) ** 0.5 / 2
    assert pooled_interval(records) == pytest.approx(expected)


def test_the_ceiling_counts_its_final_block_by_what_it_wrote():
    """At greedy the oracle accepts every committed token: a 10-token response takes ⌈9 / 4⌉ = 3 verifications,
    writing 4, 4 and 1 tokens (the last block's single draft is the response's last token, its bonus past it)."""
    sample = SequenceRecord.from_text(0, [1], list(range(10, 20)), eos_id=19)
    (oracle,) = oracle_records([sample], [torch.tensor(sample.response_ids)], K)
    assert oracle.accepted == [3, 3, 1]
    assert oracle.written == [4, 4, 1]
    assert AcceptanceStats.from_records([oracle], K).tau == pytest.approx(9 / 3)


def test_expected_acceptance_counts_as_the_realised_blocks():
    """0/1 slot acceptances predict exactly; the cut block's slot past the response (acceptance 1 there, as a draft
    past eos can be) is not counted."""
    records = _censored_set()
    a = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    predicted = ExpectedAcceptance.of(a, [rec.rooms for rec in records])
    realised = AcceptanceStats.from_records(records, K)
    assert predicted.tau == pytest.approx(realised.tau, abs=1e-12)
    assert predicted.tau_token_weighted == pytest.approx(realised.tau_token_weighted, abs=1e-12)
    assert predicted.survival == pytest.approx(realised.survival, abs=1e-12)


# -- against z-lab's own code -----------------------------------------------------------------------------------

PROMPTS, MAX_NEW_TOKENS = 4, 56  # three end in eos inside their final block, one at the length limit


@pytest.fixture(scope="module")
def decodes(monkeypatch_module):
    """The first held-out prompts decoded greedily by z-lab's `dflash_generate` and by this project's decoder,
    both on the shipped tiny target and warm drafter."""
    dflash_model = pytest.importorskip("dflash.model", reason="z-lab's dflash package is not installed (extra "
                                                             "`interop`)")
    from transformers import AutoModelForCausalLM

    # its timing helper synchronises CUDA; the timings are not what this test reads
    monkeypatch_module.setattr(dflash_model, "_cuda_time", time.perf_counter)
    assets = ROOT / "opd/assets/tiny"
    spec = load_spec(ROOT / "configs/tiny.yaml", [
        f"models.target_path={assets}/target", f"models.tokenizer_path={assets}/target",
        f"models.drafter_path={assets}/drafter", f"data.train_prompts={assets}/prompts/train.jsonl",
        f"data.eval_prompts={assets}/prompts/heldout.jsonl", "models.device=cpu"])
    models = build_models(spec)
    prompts = load_prompts(spec.data.eval_prompts, models.tokenizer, max_prompt_tokens=256, limit=PROMPTS).prompts
    records = SpeculativeDecoder(models.target, models.drafter, eos_id=models.eos_id).generate(
        [p.ids for p in prompts], Sampling(0.0), max_new_tokens=MAX_NEW_TOKENS)
    target = AutoModelForCausalLM.from_pretrained(assets / "target", dtype=torch.float32).eval()
    drafter = dflash_model.DFlashDraftModel.from_pretrained(assets / "drafter", dtype=torch.float32).eval()
    outputs = [dflash_model.dflash_generate(drafter, target, torch.tensor([p.ids]), MAX_NEW_TOKENS,
                                            [models.eos_id], return_stats=True) for p in prompts]
    return records, outputs, models.drafter.block_size


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_the_decodes_are_the_same_and_informative(decodes):
    records, outputs, _ = decodes
    assert [o.output_ids[0, o.num_input_tokens:].tolist() for o in outputs] == [r.response_ids for r in records]
    assert {r.finish_reason for r in records} == {"eos", "length"}
    # every response's final block has its bonus (or drafts) past the end: the old count differs on each
    assert all(r.accepted[-1] + 1 > r.written[-1] for r in records)


def test_authors_tau_equals_zlabs_average_acceptance_length(decodes, capsys):
    records, outputs, block_size = decodes
    stats = AcceptanceStats.from_records(records, block_size)
    per_request = [o.acceptance_lengths for o in outputs if o.acceptance_lengths]
    assert stats.tau == pytest.approx(statistics.mean(statistics.mean(x) for x in per_request), abs=1e-9)
    for rec, out in zip(records, outputs):
        assert rec.tau == pytest.approx(statistics.mean(out.acceptance_lengths), abs=1e-9)
    pooled = [n for x in per_request for n in x]
    assert stats.tau_token_weighted == pytest.approx(sum(pooled) / len(pooled), abs=1e-9)
    # z-lab's own summary prints the same figure (to its two decimals)
    from dflash.benchmark import _print_decode_summary

    _print_decode_summary([{1: o, block_size: o} for o in outputs], block_size)
    assert f"Average Acceptance length: {stats.tau:.2f}" in capsys.readouterr().out
