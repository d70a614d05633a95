"""The ceiling: τ of the argmax oracle, a drafter that always drafts the target's own argmax, on stored samples.

Distillation aims at argmax p, so the oracle's τ is what a drafter could reach on the same text, and a table that
shows it beside each drafter shows how much of the reachable τ the drafter takes. Its accepted drafts are the
committed tokens, so its blocks follow from the text and the target's argmax alone: from anchor a, accept while
the committed token equals argmax p at that position, up to K−1, then move to a + r + 1. The argmax comes from
the same decoder forward that gives the drafter its context features, so the ceiling costs one LM head pass.

At greedy every committed token is the argmax, so the oracle accepts K−1 on every block but a sequence's last:
an exact upper bound. Its records are counted as every drafter's (opd/eval/acceptance.py): a final block counts
only the tokens it wrote, so at greedy an n-token response takes ⌈(n − 1) / K⌉ verifications, the fewest that
n − 1 written tokens allow, and its τ is (n − 1) over that. At T>0 it bounds each slot's acceptance probability
given its state (p_T(d) ≤ max p_T), but over a block a less likely draft leading to a more predictable
continuation can accept more, so there it is a reference; `beats_oracle` counts how often a drafter's block does.

Sampled drafts verified with min(1, p/q) have another ceiling: q = p accepts every draft, so a drafter served that
way can reach K per block (fewer at a response's end) on any text; `full_acceptance` gives it on the same text.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from opd.decoding.batch import right_pad
from opd.decoding.record import SequenceRecord
from opd.models.lm_head import SLOTS_PER_CHUNK, argmax
from opd.models.target import Target


@torch.no_grad()
def text_states(target: Target, samples: list[SequenceRecord],
                batch_size: int = 8) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample, from one decoder forward per batch over its text: the features a drafter reads [T_i, n*H] and
    the final-norm hidden states that predict each response token [n_i, H] (row j predicts response token j)."""
    for start in range(0, len(samples), batch_size):
        part = samples[start : start + batch_size]
        ids, mask = right_pad([r.prompt_ids + r.response_ids for r in part], pad_id=0, device=target.device)
        hidden, view = target.hidden_states(ids, attention_mask=mask)
        for i, rec in enumerate(part):
            length, prompt = int(mask[i].sum()), len(rec.prompt_ids)
            yield view[i, :length], hidden[i, prompt - 1 : length - 1]


def text_view(target: Target, samples: list[SequenceRecord],
              batch_size: int = 8) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sample: the features a drafter reads [T_i, n*H] (as `opd.sources.rebuild.text_features` gives them)
    and the target's argmax at each response position [n_i] (entry j is what the target's argmax would commit as
    response token j), both on the CPU."""
    features, predicted = [], []
    for view, hidden in text_states(target, samples, batch_size):
        features.append(view.cpu())
        predicted.append(argmax(target.lm_head, hidden, SLOTS_PER_CHUNK).cpu())
    return features, predicted


def oracle_run(matches: list[bool], anchor: int, block_size: int) -> int:
    """Drafts the oracle accepts from `anchor`: committed tokens after it that equal the argmax, in a row, up to
    K−1 and the response's end (`matches[j]`: response token j is the argmax)."""
    r = 0
    while r < block_size - 1 and anchor + r + 1 < len(matches) and matches[anchor + r + 1]:
        r += 1
    return r


def oracle_records(samples: list[SequenceRecord], predicted: list[torch.Tensor],
                   block_size: int) -> list[SequenceRecord]:
    """Each sample's record as the argmax oracle would have decoded it: anchors and accepted counts (its drafts
    past a rejection are not defined by the text, so `drafts` is left empty)."""
    out = []
    for rec, argmax_ids in zip(samples, predicted):
        matches = (torch.tensor(rec.response_ids) == argmax_ids).tolist()
        anchors, accepted, anchor = [], [], 0
        while anchor < len(matches) - 1:
            r = oracle_run(matches, anchor, block_size)
            anchors.append(anchor)
            accepted.append(r)
            anchor += r + 1
        out.append(replace(rec, anchors=anchors, drafts=[], accepted=accepted))
    return out


def full_acceptance(samples: list[SequenceRecord], block_size: int) -> list[SequenceRecord]:
    """Each sample's record as a drafter with q = p, served with sampled drafts, would have decoded it: every draft
    accepted, K−1 per block up to the response's end (the sampled-draft rule's ceiling)."""
    return oracle_records(samples, [torch.tensor(rec.response_ids) for rec in samples], block_size)


def beats_oracle(records: list[SequenceRecord], predicted: list[torch.Tensor], block_size: int) -> float:
    """Share of a drafter's blocks that accepted more than the oracle would have from the same anchor (never at
    greedy; at T>0 the oracle is a reference, not a bound)."""
    blocks = wins = 0
    for rec, argmax_ids in zip(records, predicted):
        matches = (torch.tensor(rec.response_ids) == argmax_ids).tolist()
        for anchor, r in zip(rec.anchors, rec.accepted):
            blocks += 1
            wins += r > oracle_run(matches, anchor, block_size)
    return wins / max(1, blocks)
