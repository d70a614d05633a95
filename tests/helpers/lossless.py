"""The losslessness check: the exact joint law of a micro target's first tokens by enumeration, the speculative
decoder's sampled counts of the same, and a chi-square test between them."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from opd.decoding.sampling import Sampling, target_probs
from opd.decoding.speculative import SpeculativeDecoder
from tests.helpers.decoding import EOS, PROMPT

# name -> (sampling, the drafter to draft with), the cases every drafter family is checked on
LOSSLESS_CASES = {
    "T1-random-drafter": (Sampling(temperature=1.0), "random"),
    "T0.7-topk3-always-wrong": (Sampling(temperature=0.7, top_k=3), "outside_topk"),
    "T1-topp0.8-mostly-right": (Sampling(temperature=1.0, top_p=0.8), "mode"),
    "near-one-hot-mostly-right": (Sampling(temperature=0.1), "mode"),
    "near-one-hot-always-wrong": (Sampling(temperature=0.1), "least"),
}


def cases(names, slow: set[str]) -> list:
    """`names` as pytest parameters, those in `slow` marked `slow`: make test keeps one chi-square per verification
    path (accept, residual, processed p), make test-all every case."""
    return [pytest.param(name, marks=pytest.mark.slow) if name in slow else name for name in names]


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


def assert_lossless(target, drafter, sampling: Sampling, n: int, prompt: list[int] = PROMPT) -> None:
    """The speculative decoder's first three tokens from `prompt`, n rows, follow the target's exact law (chi-square)."""
    counts = sampled_joint(target, drafter, prompt, sampling, n, length=3)
    stat, critical = chi_square(counts, exact_joint(target, prompt, sampling, 3, EOS), n)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"
