"""Rebuild a speculative rollout's record from its text alone: (prompt, response, drafter) -> `SequenceRecord`.

Rollout drafts are point masses (d = argmax q), so verification accepts d at a slot exactly when the committed
token there equals d (greedy: the target commits argmax p; sampled: a rejection resamples with d removed). The
drafter's block at anchor a depends only on the target's features of the committed tokens before a and on the
anchor token. So the record is recovered by drafting at the candidate anchors, accepting the prefix of each draft
that matches the committed text, and walking a -> a + r + 1 from anchor 0 (the first response token, which
prefill commits). Any lossless sampler of the target can therefore produce the rollouts.

Strategy: draft at every response position, then walk on the CPU. One target forward per batch of sequences
gives the features (decoder only, no [T, V] logits); `forward_blocks` drafts `anchors_per_chunk` anchors of every
sequence per call, and the drafts are argmax'd through the chunked LM head (`opd/lm_head.py`), so no [slots, V]
tensor is formed whole. This costs L(K−1) drafted slots per sequence instead of the M(K−1) the walked anchors
need, but it is fully parallel: walking chains instead takes M dependent drafter calls per batch. Measured on the
shipped tiny models on one CPU thread (48 sequences, 128 tokens, batches of 8, target features 1.0 s in both):
drafting everywhere took 3.4 s of drafter time whatever the drafter; walking chains took 1.5 s with the warm
drafter (τ≈4, 133 steps) and 5.7 s with a random one (τ=1, 461 steps). The work of a walk shrinks with τ, so
it wins on a CPU once a drafter is trained; the choice on a GPU, where the walk's M launches dominate, is open.

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
from opd.lm_head import SLOTS_PER_CHUNK, argmax
from opd.models.drafter import DFlashDrafter
from opd.models.target import Target

# Anchors per sequence drafted in one `forward_blocks` call: bounds its [B, anchors, K, H] activations.
ANCHORS_PER_CHUNK = 256


@torch.no_grad()
def rebuild_records(target: Target, drafter: DFlashDrafter, samples: list[SequenceRecord], *, draft_version: int = 0,
                    batch_size: int = 8, anchors_per_chunk: int = ANCHORS_PER_CHUNK) -> list[SequenceRecord]:
    """Each sample's record as `drafter` would have decoded it, in order: its text, key and finish reason with the
    blocks rebuilt (any blocks it came with are ignored)."""
    for i, rec in enumerate(samples):
        if not rec.prompt_ids or not rec.response_ids:
            raise OpdError(f"rebuild sample {i}: empty {'prompt' if not rec.prompt_ids else 'response'} (expected at "
                           "least one token: a rollout's first response token is committed by prefill)")
    records = []
    for start in range(0, len(samples), batch_size):
        part = samples[start : start + batch_size]
        drafts = draft_everywhere(target, drafter, [(r.prompt_ids, r.response_ids) for r in part], anchors_per_chunk)
        for rec, at in zip(part, drafts):
            anchors, blocks, accepted = walk(rec.response_ids, at)
            records.append(replace(rec, anchors=anchors, drafts=blocks, accepted=accepted,
                                   draft_version=draft_version))
    return records


def draft_everywhere(target: Target, drafter: DFlashDrafter, samples: list[tuple[list[int], list[int]]],
                     anchors_per_chunk: int) -> list[list[list[int]]]:
    """Per sample, the K−1 argmax drafts at every candidate anchor 0 .. n−2 (n = response length)."""
    sequences = [list(p) + list(r) for p, r in samples]
    ids, mask = right_pad(sequences, pad_id=0, device=target.device)
    _, features = target.hidden_states(ids, attention_mask=mask)
    context = drafter.project_context(features.to(drafter.fc.weight.dtype))
    valid = mask.bool()
    counts = [max(0, len(r) - 1) for _, r in samples]
    out: list[list[list[int]]] = [[] for _ in samples]
    for first in range(0, max(counts, default=0), anchors_per_chunk):
        width = min(anchors_per_chunk, max(counts) - first)
        # Rows with fewer anchors repeat their last one (any real anchor would do); those drafts are dropped.
        anchor = torch.tensor([[min(first + j, max(c - 1, 0)) for j in range(width)] for c in counts])
        prompt_len = torch.tensor([len(p) for p, _ in samples])[:, None]
        block_ids = torch.full((len(samples), width, drafter.block_size), drafter.mask_token_id, dtype=torch.long)
        block_ids[:, :, 0] = ids.cpu().gather(1, prompt_len + anchor)
        hidden = drafter.forward_blocks(context, valid, block_ids.to(target.device),
                                        (prompt_len + anchor).to(target.device))
        drafts = argmax(drafter.lm_head, hidden[:, :, 1:], SLOTS_PER_CHUNK).tolist()
        for row, count in enumerate(counts):
            out[row].extend(drafts[row][: max(0, count - first)])
    return out


def walk(response: list[int], drafts_at: list[list[int]]) -> tuple[list[int], list[list[int]], list[int]]:
    """(anchors, drafts, accepted) of the chain from anchor 0, given the drafts at every anchor 0 .. n−2."""
    anchors, blocks, accepted = [], [], []
    a = 0
    while a < len(response) - 1:
        draft = drafts_at[a]
        r = matching_prefix(draft, response[a + 1 : a + 1 + len(draft)])
        anchors.append(a)
        blocks.append(draft)
        accepted.append(r)
        a += r + 1
    return anchors, blocks, accepted


def matching_prefix(draft: list[int], committed: list[int]) -> int:
    """How many leading drafted tokens equal the committed ones (stops at the end of `committed`)."""
    n = 0
    while n < len(committed) and draft[n] == committed[n]:
        n += 1
    return n

