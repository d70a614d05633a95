"""Drafts sampled from the drafter's q (`Sampling.sample_drafts`) are verified losslessly, batch-invariantly, and
leave the point-mass mode untouched.

Micro models in float64; keyed random numbers make every statistical test deterministic. Losslessness is the
chi-square test of tests/test_decoding.py (joint law of the first three emitted tokens, 10k sequences, 0.1%
critical value), so a correct rule fails it with probability 0.001 and the broken rules below fail it by far.
"""

from __future__ import annotations

import pytest
import torch

import opd.decoding.speculative as speculative
from opd.decoding.sampling import Sampling, keyed_uniform, sample_from, target_probs
from opd.decoding.speculative import SpeculativeDecoder
from opd.decoding.verify import STREAM_TOKEN, Verdict, verify_sampled
from opd.models.dflash import DFlashDrafter
from opd.tiny.micro import micro_drafter, micro_target
from tests.helpers.decoding import EOS, MASK, MIXED_PROMPTS, PROMPT
from tests.helpers.lossless import cases, chi_square, exact_joint

# Slot k drafts from logits FIXED_LOGITS rolled by k: q is far from the near-uniform micro target's p, differs per
# slot (a rule that used q_0 everywhere would be caught) and puts mass outside a top-k support.
FIXED_LOGITS = torch.tensor([2.0, 1.5, -1.0, 0.5, -0.5, 1.0, 0.0, -2.0], dtype=torch.float64)


class FixedDrafter(DFlashDrafter):
    """Proposes the same q whatever the context: a legitimate drafter whose q we choose."""

    def draft(self, cache, anchor_ids, anchor_positions):
        logits = torch.stack([FIXED_LOGITS.roll(k) for k in range(self.block_size - 1)])
        logits = logits.expand(len(anchor_ids), -1, -1)
        return logits.argmax(-1), logits


@pytest.fixture(scope="module")
def target():
    return micro_target(seed=0, vocab_size=8, layer_ids=[0, 2, 3])


def make_drafter(target, kind: str) -> DFlashDrafter:
    base = micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK)
    return base if kind == "random" else FixedDrafter(base.config, target.embed_tokens, target.lm_head)


def emitted_counts(target, drafter, sampling: Sampling, n: int = 10_000) -> dict[tuple, int]:
    """How often each first-three-token response occurs over n keys of PROMPT."""
    decoder = SpeculativeDecoder(target, drafter, eos_id=EOS)
    counts: dict[tuple, int] = {}
    for rec in decoder.generate([PROMPT] * n, sampling, max_new_tokens=3, seed=11, keys=list(range(n))):
        counts[tuple(rec.response_ids)] = counts.get(tuple(rec.response_ids), 0) + 1
    return counts


LOSSLESS_CASES = {
    "T1-random-drafter": (Sampling(temperature=1.0, sample_drafts=True), "random"),
    "T1-fixed-q": (Sampling(temperature=1.0, sample_drafts=True), "fixed"),
    "T0.7-topk3-topp0.9-fixed-q": (Sampling(temperature=0.7, top_k=3, top_p=0.9, sample_drafts=True), "fixed"),
}


@pytest.mark.parametrize("case", cases(LOSSLESS_CASES, slow={"T1-fixed-q"}))
def test_sampled_drafts_are_lossless(target, case):
    """The joint law of the first three emitted tokens equals the target's own, with top-k/top-p on p and q."""
    sampling, kind = LOSSLESS_CASES[case]
    n = 10_000
    stat, critical = chi_square(emitted_counts(target, make_drafter(target, kind), sampling, n),
                                exact_joint(target, PROMPT, sampling, 3, EOS), n)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"


def test_drafts_follow_q(target):
    """The recorded drafts are samples from q_k, not its argmax: first-step slot frequencies match q_k."""
    sampling, n = Sampling(temperature=1.0, sample_drafts=True), 4_000
    decoder = SpeculativeDecoder(target, make_drafter(target, "fixed"), eos_id=EOS)
    records = decoder.generate([PROMPT] * n, sampling, max_new_tokens=2, seed=2, keys=list(range(n)))
    firsts = torch.tensor([rec.drafts[0] for rec in records if rec.drafts])  # [N, K−1]
    for k in range(firsts.shape[1]):
        q = target_probs(FIXED_LOGITS.roll(k), sampling)
        freq = torch.bincount(firsts[:, k], minlength=len(q)) / len(firsts)
        assert (freq - q).abs().max() < 4 * (0.25 / len(firsts)) ** 0.5  # 4 sigma at the worst-case variance


def _residual_from_p(draft, draft_probs, logits, sampling, *, seed=0, keys=None, start=None, draft_ids=None):
    """Broken: accepts with min(1, p/q) but emits a rejection's token from p instead of norm(max(0, p − q))."""
    good = verify_sampled(draft, draft_probs, logits, sampling, seed=seed, keys=keys, start=start,
                          draft_ids=draft_ids)
    probs = target_probs(logits, sampling)[torch.arange(len(draft)), good.accepted]
    u = keyed_uniform(seed, keys, start + good.accepted, STREAM_TOKEN)
    return Verdict(good.accepted, sample_from(probs, u))


def _point_mass_residual(draft, draft_probs, logits, sampling, *, seed=0, keys=None, start=None, draft_ids=None):
    """Broken: accepts with min(1, p/q) but emits a rejection's token from p without the rejected draft, the
    point-mass residual, which is right only when q is one-hot."""
    good = verify_sampled(draft, draft_probs, logits, sampling, seed=seed, keys=keys, start=start,
                          draft_ids=draft_ids)
    rows, slot = torch.arange(len(draft)), good.accepted.clamp_max(draft.shape[1] - 1)
    probs = target_probs(logits, sampling)[rows, good.accepted].scatter(-1, draft[rows, slot][:, None], 0.0)
    u = keyed_uniform(seed, keys, start + good.accepted, STREAM_TOKEN)
    bonus = torch.where(good.accepted < draft.shape[1], sample_from(probs, u), good.bonus)
    return Verdict(good.accepted, bonus)


def _argmax_draft(draft_logits, sampling, **kw):
    """Broken: drafts q's argmax yet hands q to verification, which then applies min(1, p/q) to a point mass."""
    q = target_probs(draft_logits, sampling)
    return q.argmax(-1), q


# Not among them: verifying sampled drafts with the point-mass rule (accept with p(d), residual p without d). It is
# lossless for any draft drawn independently of the coins, only accepted less often (Σ p·q instead of Σ min(p, q)).
BROKEN = {"residual-from-p": ("verify_sampled", _residual_from_p),
          "point-mass-residual": ("verify_sampled", _point_mass_residual),
          "argmax-drafts-with-q": ("sample_draft", _argmax_draft)}


# The broken-rule tests show the chi-square has teeth (each mistake fails it); they test the test, not the decoder,
# so they run under make test-all.
@pytest.mark.slow
@pytest.mark.parametrize("broken", BROKEN)
def test_broken_sampled_rules_are_caught(target, monkeypatch, broken):
    """The lossless test has teeth: each plausible mistake in the sampled-draft rule fails it by far."""
    monkeypatch.setattr(speculative, *BROKEN[broken])
    sampling, n = LOSSLESS_CASES["T1-fixed-q"][0], 10_000
    counts = emitted_counts(target, make_drafter(target, "fixed"), sampling, n)
    try:
        stat, critical = chi_square(counts, exact_joint(target, PROMPT, sampling, 3, EOS), n)
    except AssertionError:
        return  # it even emitted a sequence the target cannot produce
    assert stat > 3 * critical


def test_q_equal_to_p_accepts_everything():
    """A drafter whose q is the target's p is always accepted: u·q(d) < p(d) = q(d) for every coin u < 1."""
    logits = torch.randn(64, 4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sampling = Sampling(temperature=0.9, top_k=5, sample_drafts=True)
    q = target_probs(logits[:, :-1], sampling)
    draft = sample_from(q, torch.rand(64, 3, generator=torch.Generator().manual_seed(1)))
    assert bool((verify_sampled(draft, q, logits, sampling).accepted == 3).all())


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0, sample_drafts=True),
                                      Sampling(temperature=0.8, top_k=3, top_p=0.9, sample_drafts=True)])
def test_sampled_batched_equals_per_sequence(target, sampling):
    """Draft samples are keyed by (seed, key, response index) too, so a sequence ignores its batch."""
    for kind in ("random", "fixed"):
        decoder = SpeculativeDecoder(target, make_drafter(target, kind), eos_id=EOS)
        keys = list(range(100, 100 + len(MIXED_PROMPTS)))
        batched = decoder.generate(MIXED_PROMPTS, sampling, max_new_tokens=20, seed=3, keys=keys)
        assert any(r > 0 for rec in batched for r in rec.accepted)
        for prompt, key, rec in zip(MIXED_PROMPTS, keys, batched):
            alone = decoder.generate([prompt], sampling, max_new_tokens=20, seed=3, keys=[key])[0]
            assert (alone.response_ids, alone.drafts, alone.accepted, alone.anchors) == \
                (rec.response_ids, rec.drafts, rec.accepted, rec.anchors)


# Records of the point-mass path (random micro drafter, prompts [1,2,3], [4,5], [0..5], keys 3..5, seed 5,
# 12 new tokens) made by the code before sample_drafts existed (f74e84a): (response_ids, drafts, accepted).
POINT_MASS_RECORDS = {
    Sampling(temperature=1.0): [
        ([2, 6], [[4, 4, 4]], [0]),
        ([3, 5, 5, 0, 2, 7, 7, 5, 0, 4, 5, 6], [[7, 4, 4]] + [[4, 4, 4]] * 9, [0] * 8 + [1, 0]),
        ([3, 7, 7, 6], [[4, 4, 4]] * 3, [0, 0, 0])],
    Sampling(temperature=0.7, top_k=3, top_p=0.9): [
        ([1, 6], [[4, 4, 4]], [0]),
        ([4, 7, 6], [[4, 4, 4]] * 2, [0, 0]),
        ([4, 5, 4, 7, 4, 1, 3, 1, 6], [[4, 4, 4]] * 6, [0, 1, 1, 0, 0, 0])],
}


@pytest.mark.parametrize("sampling", POINT_MASS_RECORDS)
def test_point_mass_path_is_unchanged(target, sampling):
    """sample_drafts=False keeps the argmax drafts and the p(d) rule bit for bit; greedy ignores sample_drafts."""
    decoder = SpeculativeDecoder(target, make_drafter(target, "random"), eos_id=EOS)
    prompts, keys = [[1, 2, 3], [4, 5], [0, 1, 2, 3, 4, 5]], [3, 4, 5]
    records = decoder.generate(prompts, sampling, max_new_tokens=12, seed=5, keys=keys)
    assert [(r.response_ids, r.drafts, r.accepted) for r in records] == POINT_MASS_RECORDS[sampling]
    greedy = [decoder.generate(prompts, Sampling(sample_drafts=flag), max_new_tokens=12, seed=5, keys=keys)
              for flag in (False, True)]
    assert [(r.response_ids, r.drafts, r.accepted) for r in greedy[0]] == \
        [(r.response_ids, r.drafts, r.accepted) for r in greedy[1]]
