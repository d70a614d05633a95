"""Speculative decoding is lossless, batch-invariant and records what it did.

Micro models in float64 (no argmax ties); keyed random numbers make every statistical test deterministic.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import opd.decoding.speculative as speculative
from opd.decoding.autoregressive import generate_autoregressive
from opd.decoding.sampling import Sampling, target_probs
from opd.decoding.speculative import SpeculativeDecoder
from opd.decoding.verify import Verdict, verify
from opd.models.drafter import DFlashDrafter
from opd.tiny.micro import micro_drafter, micro_target

EOS, MASK = 6, 7
MIXED_PROMPTS = [[1, 2, 3], [4, 5], [1, 1, 1, 1, 2], [3], [2, 2], [0, 1, 2, 3, 4, 5], [5, 4], [1]]


class ConstantDrafter(DFlashDrafter):
    """Drafts the same token everywhere: a legitimate point-mass draft whose acceptance we can steer."""

    token: int = 0

    def draft(self, cache, anchor_ids, anchor_positions):
        tokens = torch.full((len(anchor_ids), self.block_size - 1), self.token, dtype=torch.long)
        return tokens, None


def constant_drafter(target, token: int, block_size: int = 4) -> ConstantDrafter:
    base = micro_drafter(target, block_size=block_size, mask_token_id=MASK)
    drafter = ConstantDrafter(base.config, target.embed_tokens, target.lm_head)
    drafter.token = token
    return drafter


@pytest.fixture(scope="module")
def target():
    return micro_target(seed=0, vocab_size=8, layer_ids=[0, 2, 3])


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


def exact_joint(target, prompt: list[int], sampling: Sampling, length: int, eos: int) -> dict[tuple, float]:
    """P(first `length` emitted tokens) by enumeration (one batched forward), a sequence stopping at eos."""
    seqs = torch.tensor(list(itertools.product(range(target.vocab_size), repeat=length)))
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)
    probs = target_probs(target(ids).logits[:, len(prompt) - 1 : -1], sampling)  # [N, length, V]
    step_p = probs.gather(-1, seqs[..., None])[..., 0]
    joint: dict[tuple, float] = {}
    for seq, p in zip(seqs.tolist(), step_p.tolist()):
        n = seq.index(eos) + 1 if eos in seq else length
        joint[tuple(seq[:n])] = math.prod(p[:n])
    return joint


def chi_square(observed: dict[tuple, int], expected: dict[tuple, float], n: int) -> tuple[float, float]:
    """Statistic and the 0.1% critical value (Wilson–Hilferty), pooling cells expected below 5."""
    stat, pool_obs, pool_exp, df = 0.0, 0, 0.0, -1
    for cell, p in expected.items():
        e, o = p * n, observed.get(cell, 0)
        if e < 5:
            pool_obs, pool_exp = pool_obs + o, pool_exp + e
            continue
        stat, df = stat + (o - e) ** 2 / e, df + 1
    if pool_exp > 0:
        stat, df = stat + (pool_obs - pool_exp) ** 2 / max(pool_exp, 1e-9), df + 1
    z = 3.09
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert sum(observed.values()) == n and not set(observed) - set(expected), "impossible sequence emitted"
    return stat, critical


def sampled_joint(target, drafter, prompt, sampling, n: int, length: int) -> dict[tuple, int]:
    decoder = SpeculativeDecoder(target, drafter, eos_id=EOS)
    records = decoder.generate([prompt] * n, sampling, max_new_tokens=length, seed=11, keys=list(range(n)))
    counts: dict[tuple, int] = {}
    for rec in records:
        counts[tuple(rec.response_ids)] = counts.get(tuple(rec.response_ids), 0) + 1
    return counts


PROMPT = [1, 2, 3]
LOSSLESS_CASES = {
    "T1-random-drafter": (Sampling(temperature=1.0), "random"),
    "T0.7-topk3-always-wrong": (Sampling(temperature=0.7, top_k=3), "outside_topk"),
    "T1-topp0.8-mostly-right": (Sampling(temperature=1.0, top_p=0.8), "mode"),
    "near-one-hot-mostly-right": (Sampling(temperature=0.1), "mode"),
    "near-one-hot-always-wrong": (Sampling(temperature=0.1), "least"),
}


def make_drafter(target, kind: str, sampling: Sampling):
    if kind == "random":
        return micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK)
    p = target_probs(target(torch.tensor([PROMPT])).logits[0, -1], sampling)
    token = {"mode": p.argmax(), "least": p.argmin(), "outside_topk": p.argmin()}[kind]
    if kind == "outside_topk":
        assert p[token] == 0.0
    return constant_drafter(target, int(token))


@pytest.mark.parametrize("case", LOSSLESS_CASES)
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
