"""Rebuild a speculative rollout's record from its text alone: (prompt, response, drafter) -> `SequenceRecord`.

Rollout drafts are point masses (d = argmax q), so verification accepts d at a slot exactly when the committed
token there equals d (greedy: the target commits argmax p; sampled: a rejection resamples with d removed). The
drafter's block at anchor a depends only on the target's features of the committed tokens before a and on the
anchor token. So the record is recovered by drafting at the candidate anchors, accepting the prefix of each draft
that matches the committed text, and walking a -> a + r + 1 from anchor 0 (the first response token, which
prefill commits). Any lossless sampler of the target can therefore produce the rollouts.

Strategy: walk every sequence's chain, all sequences of a batch in step. One target forward gives the features
of the whole text (decoder only, no [T, V] logits); the drafter's context cache takes them once, and `draft`
drafts one block per sequence per step, seeing only cached positions before its anchor, exactly as in decoding.
The alternative, drafting at every response position in parallel (`forward_blocks`) and walking afterwards,
needs no sequential steps but drafts L(K−1) slots per sequence instead of the walk's M(K−1), through the LM head.
Measured (commit ea8ae34, shipped tiny models, one CPU thread, 48 sequences x 128 tokens, batches of 8, target
features 1.0 s in both): drafting everywhere took 3.4 s of drafter time, the walk 1.5 s with the warm drafter
(τ≈4) and 5.7 s with a random one (τ=1). At Qwen3-4B shapes (bench/rollout.py: 151,936-token head, 2048 tokens,
τ 6) drafting everywhere is 23.9 TFLOP of LM head per sequence against the walk's 4.0, more than the target's own
forward over the text, while the walk's ~341 steps are small batched drafter calls. Trained drafters are what
Draft-OPD rebuilds with, so the walk is what is kept.

The final block follows one rule, `SequenceRecord.clip_to_response`, which the speculative decoder applies to its
own records: a block is drafted at anchor a exactly when a < n − 1 (n = response length; the decoder stops once
the response holds eos or max_new_tokens tokens and cuts it after the first eos / at max_new_tokens); `drafts`
holds all K−1 drafted tokens, those past the response end included; `accepted` counts only drafts that match
*response* tokens, r = min(verification's r, n − 1 − a). So the rebuilt record equals the decoder's.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from opd.decoding.batch import right_pad
from opd.decoding.record import SequenceRecord
from opd.errors import OpdError
from opd.models.drafter import DFlashDrafter
from opd.models.target import Target


@torch.no_grad()
def rebuild_records(target: Target, drafter: DFlashDrafter, samples: list[SequenceRecord], *, draft_version: int = 0,
                    batch_size: int = 8) -> list[SequenceRecord]:
    """Each sample's record as `drafter` would have decoded it, in order: its text, key and finish reason with the
    blocks rebuilt (any blocks it came with are ignored)."""
    for i, rec in enumerate(samples):
        if not rec.prompt_ids or not rec.response_ids:
            raise OpdError(f"rebuild sample {i}: empty {'prompt' if not rec.prompt_ids else 'response'} (expected at "
                           "least one token: a rollout's first response token is committed by prefill)")
    records = []
    for start in range(0, len(samples), batch_size):
        part = samples[start : start + batch_size]
        for rec, (anchors, blocks, accepted) in zip(part, walk_chains(target, drafter, part)):
            records.append(replace(rec, anchors=anchors, drafts=blocks, accepted=accepted,
                                   draft_version=draft_version))
    return records


def walk_chains(target: Target, drafter: DFlashDrafter,
                samples: list[SequenceRecord]) -> list[tuple[list[int], list[list[int]], list[int]]]:
    """(anchors, drafts, accepted) per sample: from anchor 0, draft a block, accept the drafts that match the
    response, move to a + r + 1, until the anchor is the response's last token. Rows leave the batch as they end."""
    device = target.device
    ids, mask = right_pad([r.prompt_ids + r.response_ids for r in samples], pad_id=0, device=device)
    _, features = target.hidden_states(ids, attention_mask=mask)
    cache = drafter.new_cache(len(samples))
    drafter.extend_cache(cache, features, torch.arange(ids.shape[1], device=device).expand_as(ids), mask.bool())
    text = ids.cpu()
    out: list[tuple[list[int], list[list[int]], list[int]]] = [([], [], []) for _ in samples]
    anchor = [0] * len(samples)
    rows = [b for b, r in enumerate(samples) if len(r.response_ids) > 1]  # one token: nothing was drafted
    cache.select(torch.tensor(rows, dtype=torch.long, device=device))
    while rows:
        positions = [len(samples[b].prompt_ids) + anchor[b] for b in rows]
        drafts, _ = drafter.draft(cache, text[rows, positions].to(device), torch.tensor(positions, device=device))
        for b, draft in zip(rows, drafts.tolist()):
            response, a = samples[b].response_ids, anchor[b]
            r = matching_prefix(draft, response[a + 1 : a + len(draft) + 1])
            for field, value in zip(out[b], (a, draft, r)):
                field.append(value)
            anchor[b] = a + r + 1
        live = [i for i, b in enumerate(rows) if anchor[b] < len(samples[b].response_ids) - 1]
        if len(live) < len(rows):
            cache.select(torch.tensor(live, dtype=torch.long, device=device))
            rows = [rows[i] for i in live]
    return out


def matching_prefix(draft: list[int], committed: list[int]) -> int:
    """How many leading drafted tokens equal the committed ones (stops at the end of `committed`)."""
    n = 0
    while n < len(committed) and draft[n] == committed[n]:
        n += 1
    return n
