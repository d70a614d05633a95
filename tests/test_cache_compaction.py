"""The rollout caches stay as long as the text: each row holds its prompt and committed tokens, packed, in order.

Without compaction every verify step appended K columns whatever was accepted (prompt width + K x steps); with it
the width before step t is the longest live row's prompt + committed tokens. Same float64 micro models and
prompts as tests/test_decoding.py (ragged acceptance, rows finishing at different steps).
"""

from __future__ import annotations

import pytest
import torch

from opd.decoding.compaction import pack_block
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.tiny.micro import micro_drafter, micro_target
from tests.helpers.decoding import EOS, MASK, MIXED_PROMPTS, constant_drafter

K = 4


@pytest.fixture(scope="module")
def target():
    return micro_target(seed=0, vocab_size=8, layer_ids=[0, 2, 3])


def test_pack_block_equals_a_per_row_loop():
    """Row b's last-block slots land at used[b].., everything before stays, the width is what was asked."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 9 + K, 5, generator=gen)
    used, width = torch.tensor([9, 4, 7]), 12
    packed = pack_block(x.clone(), 2, used, K, width)
    for b, u in enumerate(used.tolist()):
        expected = torch.cat([x[b, :, :u], x[b, :, 9:], x[b, :, u + K :]], 1)[:, :width]
        assert torch.equal(packed[b], expected)
    assert packed.shape == (3, 2, width, 5)


def spy_cache_lengths(target, drafter, monkeypatch) -> tuple[list[int], list[tuple]]:
    """Per verify step: the target cache's length, and the drafter cache's (length, per-row valid positions)."""
    target_lengths, draft_views = [], []
    target_forward, draft = type(target).forward, type(drafter).draft

    def spy_target(self, ids, **kw):
        if kw["past_key_values"] is not None:
            target_lengths.append(kw["past_key_values"].get_seq_length())
        return target_forward(self, ids, **kw)

    def spy_draft(self, cache, anchor_ids, anchor_positions):
        out = draft(self, cache, anchor_ids, anchor_positions)  # writes the context the decoder deferred
        self.commit_context(cache)  # a drafter that drafts without its forward (constant5) leaves it pending
        rows = [cache.positions[b][cache.valid[b]].tolist() for b in range(len(anchor_ids))]
        draft_views.append((cache.length, rows))
        return out

    monkeypatch.setattr(type(target), "forward", spy_target)
    monkeypatch.setattr(type(drafter), "draft", spy_draft)
    return target_lengths, draft_views


@pytest.mark.parametrize("drafter_name", ["random", "constant5"])
def test_cache_length_is_prompt_plus_committed(target, drafter_name, monkeypatch):
    drafter = {"random": micro_drafter(target, seed=1, block_size=K, mask_token_id=MASK),
               "constant5": constant_drafter(target, 5, block_size=K)}[drafter_name]
    target_lengths, draft_views = spy_cache_lengths(target, drafter, monkeypatch)
    records = SpeculativeDecoder(target, drafter, eos_id=EOS).generate(MIXED_PROMPTS, Sampling(),
                                                                       max_new_tokens=40)
    steps = max(r.num_steps for r in records)
    assert len(target_lengths) == len(draft_views) == steps > 10
    for t in range(steps):
        live = [r for r in records if r.num_steps > t]
        committed = [len(r.prompt_ids) + r.anchors[t] for r in live]  # the pending anchor is not cached yet
        assert target_lengths[t] == max(committed)
        length, rows = draft_views[t]
        assert length == max(committed)
        assert rows == [list(range(n)) for n in committed]  # each row's own text, in order, nothing else
    holes_width = max(map(len, MIXED_PROMPTS)) + K * (steps - 1)  # what the uncompacted cache reached
    assert target_lengths[-1] <= max(len(r.prompt_ids) + len(r.response_ids) for r in records) < holes_width
