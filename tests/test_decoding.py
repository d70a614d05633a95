"""Speculative decoding is lossless, batch-invariant and records what it did.

Micro models in float64 (no argmax ties); keyed random numbers make every statistical test deterministic.
"""

from __future__ import annotations

import pytest
import torch

import opd.decoding.speculative as speculative
from opd.decoding.autoregressive import generate_autoregressive
from opd.decoding.sampling import Sampling, target_probs
from opd.decoding.speculative import SpeculativeDecoder
from opd.decoding.verify import Verdict, verify
from opd.tiny.micro import micro_drafter
from tests.helpers.decoding import EOS, MASK, MIXED_PROMPTS, PROMPT, constant_drafter, target  # noqa: F401 (a fixture)
from tests.helpers.lossless import LOSSLESS_CASES, cases, chi_square, exact_joint, sampled_joint


def drafters(target):
    return {"random": micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK),
            "constant5": constant_drafter(target, 5)}


def rescored_argmax(target, prompt: list[int], response: list[int]) -> list[int]:
    ids = torch.tensor([prompt + response])
    logits = target(ids).logits[0]
    return logits[len(prompt) - 1 : len(prompt) + len(response) - 1].argmax(-1).tolist()


@pytest.mark.parametrize("drafter_name", ["random", "constant5"])
@pytest.mark.parametrize("prompts", [MIXED_PROMPTS[2:3], MIXED_PROMPTS], ids=["batch1", "batch8"])
def test_greedy_emits_target_argmax(target, drafter_name, prompts):
    decoder = SpeculativeDecoder(target, drafters(target)[drafter_name], eos_id=EOS)
    records = decoder.generate(prompts, Sampling(), max_new_tokens=24)
    for rec in records:
        assert rec.response_ids == rescored_argmax(target, rec.prompt_ids, rec.response_ids)
    assert any(r > 0 for rec in records for r in rec.accepted) or drafter_name == "random"


def test_greedy_equals_autoregressive_and_acceptance_is_ragged(target):
    decoder = SpeculativeDecoder(target, constant_drafter(target, 5), eos_id=EOS)
    records = decoder.generate(MIXED_PROMPTS, Sampling(), max_new_tokens=24)
    baseline = generate_autoregressive(target, MIXED_PROMPTS, Sampling(), max_new_tokens=24, eos_id=EOS)
    assert [r.response_ids for r in records] == baseline
    per_row = {tuple(r.accepted) for r in records}
    assert len(per_row) > 1 and max(max(r.accepted) for r in records) == 3  # full and zero acceptance mixed


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0), Sampling(temperature=0.8, top_k=3)])
def test_batched_equals_per_sequence(target, sampling):
    for drafter in drafters(target).values():
        decoder = SpeculativeDecoder(target, drafter, eos_id=EOS)
        keys = list(range(100, 100 + len(MIXED_PROMPTS)))
        batched = decoder.generate(MIXED_PROMPTS, sampling, max_new_tokens=20, seed=3, keys=keys)
        for prompt, key, rec in zip(MIXED_PROMPTS, keys, batched):
            alone = decoder.generate([prompt], sampling, max_new_tokens=20, seed=3, keys=[key])[0]
            assert alone.response_ids == rec.response_ids
            assert alone.accepted == rec.accepted and alone.anchors == rec.anchors


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0)])
def test_records_rebuild_the_response(target, sampling):
    decoder = SpeculativeDecoder(target, constant_drafter(target, 5), eos_id=EOS, draft_version=7)
    for rec in decoder.generate(MIXED_PROMPTS, sampling, max_new_tokens=30, seed=1):
        assert rec.draft_version == 7 and rec.finish_reason in ("eos", "length")
        rebuilt = rec.response_ids[:1]
        for anchor, block, r in zip(rec.anchors, rec.drafts, rec.accepted):
            assert anchor == len(rebuilt) - 1  # every block starts at the last committed token
            assert len(block) == 3 and 0 <= r <= 3
            rebuilt += block[:r]
            if len(rebuilt) < len(rec.response_ids):
                rebuilt.append(rec.response_ids[len(rebuilt)])  # the bonus token
        assert rebuilt[: len(rec.response_ids)] == rec.response_ids
        committed = sum(r + 1 for r in rec.accepted)
        assert committed >= len(rec.response_ids) - 1 > committed - (rec.accepted[-1] + 1) if rec.accepted else True
        # a final block counts only what it wrote, so the blocks' tokens are the response less the prefill's token
        assert sum(rec.written) == len(rec.response_ids) - 1
        assert rec.tau == pytest.approx((len(rec.response_ids) - 1) / rec.num_steps) if rec.accepted else True


# ---------------------------------------------------------------------------------------------- losslessness


def make_drafter(target, kind: str, sampling: Sampling):
    if kind == "random":
        return micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK)
    p = target_probs(target(torch.tensor([PROMPT])).logits[0, -1], sampling)
    token = {"mode": p.argmax(), "least": p.argmin(), "outside_topk": p.argmin()}[kind]
    if kind == "outside_topk":
        assert p[token] == 0.0
    return constant_drafter(target, int(token))


@pytest.mark.parametrize("case", cases(LOSSLESS_CASES, slow={"T1-topp0.8-mostly-right", "near-one-hot-mostly-right"}))
def test_sampling_is_lossless(target, case):
    """The joint law of the first three emitted tokens equals the target's own (chi-square, 10k samples)."""
    sampling, kind = LOSSLESS_CASES[case]
    n = 10_000
    counts = sampled_joint(target, make_drafter(target, kind, sampling), PROMPT, sampling, n, length=3)
    stat, critical = chi_square(counts, exact_joint(target, PROMPT, sampling, 3, EOS), n)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"


def _accept_with_q(draft, logits, sampling, **kw):
    """Broken: a point-mass draft has q(d) = 1, so 'accept with min(1, q/q)' accepts everything."""
    good = verify(draft, logits, sampling, **kw)
    k1 = draft.shape[1]
    bonus = torch.where(good.accepted == k1, good.bonus, torch.zeros_like(good.bonus))
    full = torch.full_like(good.accepted, k1)
    return Verdict(full, torch.where(full == k1, logits[:, -1].argmax(-1), bonus))


def _keep_rejected_token(draft, logits, sampling, *, seed=0, keys=None, start=None):
    """Broken: on rejection the bonus is sampled from p without removing the rejected draft token."""
    from opd.decoding.sampling import keyed_uniform, sample_from
    from opd.decoding.verify import STREAM_TOKEN

    good = verify(draft, logits, sampling, seed=seed, keys=keys, start=start)
    probs = target_probs(logits, sampling)[torch.arange(len(draft)), good.accepted]
    u = keyed_uniform(seed, keys, start + good.accepted, STREAM_TOKEN)
    return Verdict(good.accepted, sample_from(probs, u))


# The broken-rule tests show the chi-square has teeth (each mistake fails it); they test the test, not the decoder,
# so they run under make test-all.
@pytest.mark.slow
@pytest.mark.parametrize("broken", [_accept_with_q, _keep_rejected_token])
def test_broken_rules_are_caught(target, monkeypatch, broken):
    """The lossless test has teeth: each classic mistake in the acceptance rule fails it."""
    monkeypatch.setattr(speculative, "verify", broken)
    sampling = Sampling(temperature=1.0)
    n = 10_000
    counts = sampled_joint(target, make_drafter(target, "mode", sampling), PROMPT, sampling, n, length=3)
    try:
        stat, critical = chi_square(counts, exact_joint(target, PROMPT, sampling, 3, EOS), n)
    except AssertionError:
        return  # it even emitted a sequence the target cannot produce
    assert stat > 3 * critical
