"""Rebuild a speculative rollout's record from its text alone: (prompt, response, drafter) -> `SequenceRecord`.

Rollout drafts are point masses (d = argmax q, or DFlash 2's selector path), so verification accepts d at a slot
exactly when the committed token there equals d (greedy: the target commits argmax p; sampled: a rejection
resamples with d removed). The drafter's block at anchor a depends only on the target's features of the committed
tokens before a and on the anchor token (DFlash 2's path too: its selector starts from the anchor). So the record is recovered by drafting at the candidate anchors, accepting the prefix of each draft
that matches the committed text, and walking a -> a + r + 1 from anchor 0 (the first response token, which
prefill commits). Any lossless sampler of the target can therefore produce the rollouts.

Strategy: walk every sequence's chain, all sequences of a batch in step. One target forward gives the features
of the whole text (decoder only, no [T, V] logits); the drafter's context cache takes them once, and `draft`
drafts one block per sequence per step, seeing only cached positions before its anchor, exactly as in decoding.
The alternative, drafting at every response position in parallel (`forward_blocks`) and walking afterwards,
needs no sequential steps but drafts L(K−1) slots per sequence instead of the walk's M(K−1), through the LM head.
On the shipped tiny models the walk took less drafter time than drafting everywhere with the warm drafter and more with
a random one (τ = 1); that was measured once, on one CPU thread (commit 636178a's message), and no file in bench/results
holds it. At Qwen3-4B shapes (bench/rollout.py: 151,936-token head, 2048 tokens, τ 6) drafting everywhere works out to
23.9 TFLOP of LM head per sequence against the walk's 4.0, more than the target's own forward over the text, while the
walk's ~341 steps are small batched drafter calls. Trained drafters are what Draft-OPD rebuilds with, so the walk is
what is kept.

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
from opd.models.protocol import Drafter
from opd.models.target import Target


@torch.no_grad()
def rebuild_records(target: Target, drafter: Drafter, samples: list[SequenceRecord], *, draft_version: int = 0,
                    batch_size: int = 8, features: list[torch.Tensor] | None = None) -> list[SequenceRecord]:
    """Each sample's record as `drafter` would have decoded it, in order: its text, key and finish reason with the
    blocks rebuilt (any blocks it came with are ignored). `features`: the target's view of each text [T_i, n*H]
    on any device, when the caller has it (offline evaluation caches `text_features`; the committed-layout scorer
    shares its teacher forward, `CommittedView.rows`); else it is computed here, one target forward per batch."""
    for i, rec in enumerate(samples):
        if not rec.prompt_ids or not rec.response_ids:
            raise OpdError(f"rebuild sample {i}: empty {'prompt' if not rec.prompt_ids else 'response'} (expected at "
                           "least one token: a rollout's first response token is committed by prefill)")
    records = []
    for start in range(0, len(samples), batch_size):
        part = samples[start : start + batch_size]
        if features is None:
            view, mask = _features(target, part)
        else:
            view, mask = _padded(features[start : start + batch_size], target.device)
        for rec, (anchors, blocks, accepted) in zip(part, walk_chains(drafter, part, view, mask)):
            records.append(replace(rec, anchors=anchors, drafts=blocks, accepted=accepted,
                                   draft_version=draft_version))
    return records


@torch.no_grad()
def text_features(target: Target, samples: list[SequenceRecord], batch_size: int = 8) -> list[torch.Tensor]:
    """The target's features of each sample's text, [T_i, n*H] on the CPU: all a rebuild needs of the target, and
    the same for every drafter (offline evaluation caches them)."""
    out = []
    for start in range(0, len(samples), batch_size):
        part = samples[start : start + batch_size]
        view, mask = _features(target, part)
        out += [view[i, : int(mask[i].sum())].cpu() for i in range(len(part))]
    return out


def _features(target: Target, samples: list[SequenceRecord]) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = right_pad([r.prompt_ids + r.response_ids for r in samples], pad_id=0, device=target.device)
    _, features = target.hidden_states(ids, attention_mask=mask)
    return features, mask


def _padded(features: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(f.shape[0] for f in features)
    out = features[0].new_zeros(len(features), length, features[0].shape[1])
    mask = torch.zeros(len(features), length, dtype=torch.long)
    for i, f in enumerate(features):
        out[i, : f.shape[0]] = f
        mask[i, : f.shape[0]] = 1
    return out.to(device), mask.to(device)


def walk_chains(drafter: Drafter, samples: list[SequenceRecord], features: torch.Tensor,
                mask: torch.Tensor) -> list[tuple[list[int], list[list[int]], list[int]]]:
    """(anchors, drafts, accepted) per sample: from anchor 0, draft a block, accept the drafts that match the
    response, move to a + r + 1, until the anchor is the response's last token. Rows leave the batch as they end.
    `features` [B, T, n*H] and `mask` [B, T] are the target's view of the right-padded texts."""
    device = features.device
    cache = drafter.new_cache(len(samples))
    text_positions = torch.arange(features.shape[1], device=device).expand(len(samples), -1)
    text = [r.prompt_ids + r.response_ids for r in samples]
    next_ids = torch.zeros(len(text), features.shape[1], dtype=torch.long)
    for b, t in enumerate(text):
        next_ids[b, : len(t) - 1] = torch.tensor(t[1:])
    has_next = mask.bool() & (torch.arange(features.shape[1], device=device) < mask.sum(1, keepdim=True) - 1)
    drafter.extend_cache(cache, features, text_positions, has_next, next_ids.to(device))  # the last token has no next
    out: list[tuple[list[int], list[list[int]], list[int]]] = [([], [], []) for _ in samples]
    anchor = [0] * len(samples)
    rows = [b for b, r in enumerate(samples) if len(r.response_ids) > 1]  # one token: nothing was drafted
    cache.select(torch.tensor(rows, dtype=torch.long, device=device))
    while rows:
        positions = [len(samples[b].prompt_ids) + anchor[b] for b in rows]
        anchor_ids = torch.tensor([text[b][p] for b, p in zip(rows, positions)], device=device)
        drafts, _ = drafter.draft(cache, anchor_ids, torch.tensor(positions, device=device))
        for b, draft in zip(rows, drafts.tolist()):
            response, a = samples[b].response_ids, anchor[b]
            r = matching_prefix(draft, response[a + 1 : a + len(draft) + 1])
            anchors, drafted, accepted = out[b]
            anchors.append(a)
            drafted.append(draft)
            accepted.append(r)
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
