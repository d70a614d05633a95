"""The decoder defers each step's verified context to the next draft, which projects it in the same forward as its
block (one drafter forward per step, as z-lab's): every draft's logits and the cache it attends to equal those of
an eager `extend_cache`, exactly, on the growing and the static cache, with ragged acceptance, rows leaving the
batch and a greedy as well as a sampled (chained, DFlash 2) draft. Same float64 micro models and prompts as
tests/test_decoding.py.
"""

from __future__ import annotations

import pytest
import torch

from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.models.drafter_cache import DrafterCache
from opd.tiny.micro import micro_drafter
from tests.helpers.decoding import EOS, MASK, MIXED_PROMPTS, target  # noqa: F401 (a fixture)
from tests.helpers.dflash2 import dflash2_drafter
from tests.helpers.dspark import dspark_drafter
from tests.helpers.static_cache import KEYS, facts

DRAFTERS = {
    "dflash": lambda t: micro_drafter(t, seed=1, num_layers=2, block_size=4, mask_token_id=MASK),
    "dflash2": lambda t: dflash2_drafter(t, base=micro_drafter(t, seed=1, num_layers=2, block_size=4,
                                                               mask_token_id=MASK)),
    "dspark": lambda t: dspark_drafter(t),
}


def decode(target, drafter, static: bool, eager: bool, sampling: Sampling) -> tuple[list, list]:
    """(records, per draft call: the logits and each row's attended (valid) cache entries)."""
    seen = []
    draft = drafter.draft

    def spy(cache: DrafterCache, anchor_ids, anchor_positions):
        drafts, logits = draft(cache, anchor_ids, anchor_positions)
        rows = [[(cache.positions[b, cache.valid[b]], k[b][:, cache.valid[b]], v[b][:, cache.valid[b]])
                 for k, v in zip(cache.keys, cache.values)] for b in range(len(anchor_ids))]
        seen.append((logits, rows))
        return drafts, logits

    drafter.draft = spy
    if eager:
        drafter.defer_context = drafter.extend_cache
    try:
        records = SpeculativeDecoder(target, drafter, eos_id=EOS, static_cache=static).generate(
            MIXED_PROMPTS, sampling, max_new_tokens=24, seed=3, keys=KEYS)
    finally:
        del drafter.draft
        if eager:
            del drafter.defer_context
    return records, seen


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_deferred_context_equals_eager_extension(target, name, static):
    drafter = DRAFTERS[name](target)
    folded, folded_seen = decode(target, drafter, static, eager=False, sampling=Sampling())
    eager, eager_seen = decode(target, drafter, static, eager=True, sampling=Sampling())
    assert facts(folded) == facts(eager)
    assert len({len(r.accepted) for r in folded}) > 2  # rows leave the batch at different steps
    assert any(0 < r < 3 for rec in folded for r in rec.accepted)  # ragged acceptance: some packing moves entries
    assert len(folded_seen) == len(eager_seen)
    for (logits, rows), (want_logits, want_rows) in zip(folded_seen, eager_seen):
        assert torch.equal(logits, want_logits)
        for row, want in zip(rows, want_rows):
            for got, expected in zip(row, want):
                assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_sampled_chained_drafts_fold_too(target):
    """DFlash 2's sampled drafts come through `draft_path`, which folds the pending context the same way."""
    drafter = DRAFTERS["dflash2"](target)
    sampling = Sampling(temperature=1.0, sample_drafts=True)
    runs = []
    for eager in (False, True):
        if eager:
            drafter.defer_context = drafter.extend_cache
        runs.append(facts(SpeculativeDecoder(target, drafter, eos_id=EOS).generate(
            MIXED_PROMPTS, sampling, max_new_tokens=24, seed=3, keys=KEYS)))
    del drafter.defer_context
    assert runs[0] == runs[1]
