"""Packed replay: the target's and the drafter's view of every recorded block, in one forward each.

Teacher: the committed sequence followed by every drafted block, packed into one row with a 4-D mask. Block m
sees the committed prefix up to and including its anchor and itself causally, so the logits at slot k are
p(d_m,k | c_m, d_m,<k) — rejected slots included, which is the whole point of Draft-OPD. One forward replaces M
per-anchor forwards that would each recompute the shared prefix.

Student: one DFlash `forward_blocks` over all anchors of a sequence (each block sees context strictly before its
anchor), giving q at the same slots.

In `naive` rollout mode the teacher scores the *committed* continuation instead of the drafts (the paper's
naive target-assisted baseline); those logits are already in the committed prefix, so no blocks are appended.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.decoding.record import SequenceRecord
from opd.losses import TopKTeacher, teacher_distribution
from opd.models.drafter import DFlashDrafter
from opd.models.target import Target


@dataclass
class ScoredBatch:
    """What the learner needs for B sequences with up to M blocks each (padding marked invalid)."""

    features: torch.Tensor  # [B, S, n*H] target features of the committed sequence
    context_valid: torch.Tensor  # [B, S] bool
    anchor_ids: torch.Tensor  # [B, M] the committed token each block starts from
    anchor_positions: torch.Tensor  # [B, M] its absolute position (prompt + response index)
    block_valid: torch.Tensor  # [B, M] bool
    accepted: torch.Tensor  # [B, M]
    position_mask: torch.Tensor  # [B, M, K-1] bool: slots that exist
    teacher: torch.Tensor | TopKTeacher  # log-probs [B, M, K-1, V] (or top-k) at the drafted slots

    def flat_blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | TopKTeacher]:
        """accepted [N], position_mask [N, K-1] and teacher of the N valid blocks, for the loss."""
        v = self.block_valid
        t = self.teacher
        teacher = (TopKTeacher(t.ids[v], t.logprobs[v], None if t.tail_logprob is None else t.tail_logprob[v])
                   if isinstance(t, TopKTeacher) else t[v])
        return self.accepted[v], self.position_mask[v], teacher


@dataclass
class _Packed:
    """One sequence laid out for the teacher: ids, positions, mask, and where each slot's logits are."""

    ids: list[int]
    positions: list[int]
    prefix_len: int
    slot_index: list[list[int]]  # [M][K-1] row index of the logits predicting slot k
    anchors: list[int]  # absolute positions
    accepted: list[int]
    slot_exists: list[list[bool]]


def pack(record: SequenceRecord, block_size: int, mode: str) -> _Packed:
    """Lay out one record: committed prefix, then (draft_opd) the drafted tokens of each block but the last."""
    prompt_len, k1 = len(record.prompt_ids), block_size - 1
    committed = record.prompt_ids + record.response_ids
    if mode == "naive":
        return _pack_naive(record, committed, prompt_len, k1)
    prefix_len = prompt_len + max(record.anchors) + 1
    ids, positions = committed[:prefix_len], list(range(prefix_len))
    slot_index, anchors = [], []
    for anchor, draft in zip(record.anchors, record.drafts):
        start, abs_anchor = len(ids), prompt_len + anchor
        ids += draft[: k1 - 1]  # the last drafted token predicts nothing we score
        positions += [abs_anchor + 1 + j for j in range(k1 - 1)]
        slot_index.append([abs_anchor] + [start + j for j in range(k1 - 1)])
        anchors.append(abs_anchor)
    exists = [[True] * k1 for _ in anchors]
    return _Packed(ids, positions, prefix_len, slot_index, anchors, list(record.accepted), exists)


def _pack_naive(record: SequenceRecord, committed: list[int], prompt_len: int, k1: int) -> _Packed:
    """Naive rollout: slot k of block m is the committed token at anchor + k, scored inside the prefix itself."""
    n = len(committed)
    anchors = [prompt_len + a for a in record.anchors]
    slot_index = [[min(a + k, n - 1) for k in range(k1)] for a in anchors]
    available = [min(k1, n - 1 - a) for a in anchors]
    exists = [[k < avail for k in range(k1)] for avail in available]
    return _Packed(committed, list(range(n)), n, slot_index, anchors, available, exists)


def teacher_mask(p: _Packed, block_size: int, length: int) -> torch.Tensor:
    """[length, length] bool: causal over the prefix; block m sees prefix ≤ its anchor and itself causally."""
    mask = torch.zeros(length, length, dtype=torch.bool)
    mask[: p.prefix_len, : p.prefix_len] = torch.ones(p.prefix_len, p.prefix_len, dtype=torch.bool).tril()
    span = block_size - 2
    for m, anchor in enumerate(p.anchors if p.prefix_len < len(p.ids) else []):
        start = p.prefix_len + m * span
        rows = slice(start, start + span)
        mask[rows, : anchor + 1] = True
        mask[rows, start : start + span] = torch.ones(span, span, dtype=torch.bool).tril()
    for i in range(len(p.ids), length):  # padding rows attend to themselves so no row is all-masked
        mask[i, i] = True
    return mask


@torch.no_grad()
def score(target: Target, records: list[SequenceRecord], *, block_size: int, mode: str = "draft_opd",
          teacher_temperature: float = 1.0, teacher_topk: int | None = None) -> ScoredBatch:
    """Teacher replay for a batch of records: one packed target forward for all their blocks."""
    packed = [pack(r, block_size, mode) for r in records]
    length = max(len(p.ids) for p in packed)
    device = target.device
    ids = torch.zeros(len(packed), length, dtype=torch.long)
    positions = torch.zeros(len(packed), length, dtype=torch.long)
    for b, p in enumerate(packed):
        ids[b, : len(p.ids)] = torch.tensor(p.ids)
        positions[b, : len(p.ids)] = torch.tensor(p.positions)
    mask = torch.stack([teacher_mask(p, block_size, length) for p in packed])[:, None]
    out = target(ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device))
    return _gather(out.logits, out.features, packed, records, block_size, teacher_temperature, teacher_topk)


def _gather(logits, features, packed, records, block_size, temperature, topk) -> ScoredBatch:
    b, m, k1 = len(packed), max(len(p.anchors) for p in packed), block_size - 1
    device = logits.device
    slot_index = torch.zeros(b, m, k1, dtype=torch.long)
    anchor_pos = torch.zeros(b, m, dtype=torch.long)
    accepted = torch.zeros(b, m, dtype=torch.long)
    block_valid = torch.zeros(b, m, dtype=torch.bool)
    exists = torch.zeros(b, m, k1, dtype=torch.bool)
    prefix = max(p.prefix_len for p in packed)
    context_valid = torch.zeros(b, prefix, dtype=torch.bool)
    for i, p in enumerate(packed):
        n = len(p.anchors)
        slot_index[i, :n] = torch.tensor(p.slot_index)
        anchor_pos[i, :n] = torch.tensor(p.anchors)
        accepted[i, :n] = torch.tensor(p.accepted)
        block_valid[i, :n] = True
        exists[i, :n] = torch.tensor(p.slot_exists)
        context_valid[i, : p.prefix_len] = True
    slot_index = slot_index.to(device)
    rows = torch.arange(b, device=device)[:, None, None]
    slot_logits = logits[rows, slot_index]  # [B, M, K-1, V]
    committed = torch.zeros(b, prefix, dtype=torch.long)
    for i, r in enumerate(records):
        seq = (r.prompt_ids + r.response_ids)[:prefix]
        committed[i, : len(seq)] = torch.tensor(seq)
    anchor_ids = committed.to(device).gather(1, anchor_pos.to(device))
    return ScoredBatch(
        features=features[:, :prefix], context_valid=context_valid.to(device), anchor_ids=anchor_ids,
        anchor_positions=anchor_pos.to(device), block_valid=block_valid.to(device), accepted=accepted.to(device),
        position_mask=(exists & block_valid[..., None]).to(device),
        teacher=teacher_distribution(slot_logits, temperature=temperature, topk=topk))


def student_logits(drafter: DFlashDrafter, batch: ScoredBatch) -> torch.Tensor:
    """Drafter logits [N, K-1, V] at the drafted slots of the N valid blocks, in one block-masked forward."""
    k = drafter.block_size
    block_ids = torch.full((*batch.anchor_ids.shape, k), drafter.mask_token_id, dtype=torch.long,
                           device=batch.anchor_ids.device)
    block_ids[..., 0] = batch.anchor_ids
    context = drafter.project_context(batch.features.to(drafter.fc.weight.dtype))
    hidden = drafter.forward_blocks(context, batch.context_valid, block_ids, batch.anchor_positions)
    return drafter.logits(hidden[batch.block_valid][:, 1:])


def score_micro_batches(target: Target, batch, spec) -> list[ScoredBatch]:
    """An AnchorBatch scored in chunks of `optim.micro_batch_size` records, as the learner consumes them."""
    micro, r = spec.optim.micro_batch_size, spec.replay
    records = batch.records
    return [score(target, records[i : i + micro], block_size=spec.models.drafter.block_size, mode=spec.rollout.mode,
                  teacher_temperature=r.teacher_temperature, teacher_topk=r.teacher_topk)
            for i in range(0, len(records), micro)]
