"""Token-budget micro-batches: long and short responses share one memory bound.

A fixed count of sequences per micro-batch sizes memory by the longest response times the count, so thinking runs
(4,096-token training responses beside 100-token ones) either pad or run out. Here a micro-batch is whatever fits
a budget of padded rows: sequences x the longest of each padded dimension, the measure the tensors are actually
allocated at. Sequences are taken in order and a micro-batch closes when the next one would not fit (sorted
longest first by the learner, so padding stays small; in record order by the scorer, whose outputs follow it).

A sequence over the budget alone is cut at block boundaries. That is exact for both models: a DFlash block sees
only the text before its anchor and itself (the teacher's packed row likewise sees the prefix up to its anchor),
never another block, and the step's loss coefficients are fixed by `StepNorm` before any forward. What cannot be
cut is one sequence's text plus one block; the spec refuses a budget below that (opd/spec/rules.py), before any compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from opd.decoding.record import SequenceRecord
from opd.distill.losses import TopKTeacher
from opd.distill.replay import pack
from opd.distill.scored_batch import ScoredBatch


def padded_tokens(sizes: Sequence[tuple[int, ...]]) -> int:
    """Rows a micro-batch of items allocates: items x the sum over dimensions of the longest item there."""
    return len(sizes) * sum(max(dim) for dim in zip(*sizes)) if sizes else 0


def group_by_budget(sizes: Sequence[tuple[int, ...]], budget: int) -> list[list[int]]:
    """Indices of consecutive items grouped so that each group's `padded_tokens` is at most `budget` (an item over
    it alone forms its own group: callers cut those first)."""
    groups: list[list[int]] = []
    for i, size in enumerate(sizes):
        if groups and padded_tokens([sizes[j] for j in groups[-1]] + [size]) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


# ------------------------------------------------------------------------------------------------ the learner


def learner_size(row: ScoredBatch, block_size: int) -> tuple[int, int]:
    """(context tokens, block rows) of a one-sequence ScoredBatch: what the drafter's training forward runs."""
    return row.context_valid.shape[1], row.block_valid.shape[1] * block_size


def sequence_rows(batch: ScoredBatch) -> list[ScoredBatch]:
    """Each sequence of `batch` as its own ScoredBatch, padding trimmed (slices, not copies)."""
    rows, start = [], 0
    for b in range(batch.block_valid.shape[0]):
        context, blocks = int(batch.context_valid[b].sum()), int(batch.block_valid[b].sum())
        rows.append(_row(batch, b, context, slice(0, blocks), start))
        start += blocks
    return rows


def _row(batch: ScoredBatch, b: int, context: int, cols: slice, start: int) -> ScoredBatch:
    """Sequence `b` of `batch` with its first `context` positions and blocks `cols`, whose flat (per-block) rows
    begin at `start`."""
    flat = slice(start, start + cols.stop - cols.start)
    return ScoredBatch(batch.features[b : b + 1, :context], batch.context_valid[b : b + 1, :context],
                       batch.context_ids[b : b + 1, :context], batch.block_ids[b : b + 1, cols],
                       batch.anchor_positions[b : b + 1, cols], batch.block_valid[b : b + 1, cols],
                       batch.accepted[flat], batch.position_mask[flat], _teacher_rows(batch.teacher, flat))


def _merged_teacher(teachers: list[torch.Tensor | TopKTeacher]) -> torch.Tensor | TopKTeacher:
    """The micro-batches' teachers, one after another (all of one kind: the scorer's replay mode makes them). A
    top-k tail that one of them derives (None) is derived here for that one, so the others keep their exact tails."""
    tops = [t for t in teachers if isinstance(t, TopKTeacher)]
    if not tops:
        return torch.cat([t for t in teachers if isinstance(t, torch.Tensor)])
    tails = [t.tail_logprob for t in tops]
    tail = None if all(x is None for x in tails) else torch.cat([t.tail() for t in tops])
    return TopKTeacher(torch.cat([t.ids for t in tops]), torch.cat([t.logprobs for t in tops]), tail)


def _teacher_rows(teacher: torch.Tensor | TopKTeacher, rows: slice) -> torch.Tensor | TopKTeacher:
    if isinstance(teacher, TopKTeacher):
        tail = None if teacher.tail_logprob is None else teacher.tail_logprob[rows]  # None: derived where used
        return TopKTeacher(teacher.ids[rows], teacher.logprobs[rows], tail)
    return teacher[rows]


def cut_blocks(row: ScoredBatch, budget: int, block_size: int) -> list[ScoredBatch]:
    """A one-sequence batch over `budget` as parts of consecutive blocks, each with the whole context (which the
    spec keeps, with one block, within the budget)."""
    context, blocks = learner_size(row, block_size)
    if context + blocks <= budget:
        return [row]
    per_part, count = max(1, (budget - context) // block_size), row.block_valid.shape[1]
    return [_row(row, 0, context, slice(i, min(i + per_part, count)), i) for i in range(0, count, per_part)]


def merge(rows: Sequence[ScoredBatch]) -> ScoredBatch:
    """One ScoredBatch of one-sequence batches, right-padded to the longest context and block count."""
    if len(rows) == 1:
        return rows[0]
    context = max(r.context_valid.shape[1] for r in rows)
    blocks = max(r.block_valid.shape[1] for r in rows)

    def stack(name: str, width: int) -> torch.Tensor:
        parts = [getattr(r, name) for r in rows]
        return torch.cat([torch.nn.functional.pad(p, _right(p, width)) for p in parts])

    teacher = _merged_teacher([r.teacher for r in rows])
    return ScoredBatch(stack("features", context), stack("context_valid", context), stack("context_ids", context),
                       stack("block_ids", blocks), stack("anchor_positions", blocks), stack("block_valid", blocks),
                       torch.cat([r.accepted for r in rows]), torch.cat([r.position_mask for r in rows]), teacher)


def _right(t: torch.Tensor, width: int) -> tuple[int, ...]:
    """F.pad widths that right-pad dim 1 of `t` to `width` (its trailing dims untouched)."""
    return (0, 0) * (t.dim() - 2) + (0, width - t.shape[1])


def learner_plan(micro_batches: Sequence[ScoredBatch], budget: int, block_size: int) -> list[list[ScoredBatch]]:
    """The update's sequences (this rank's share) as groups under `budget`, longest first: each group is merged
    into one micro-batch only when the learner reaches it, so the plan costs slices, not copies."""
    rows = [part for mb in micro_batches for row in sequence_rows(mb) for part in cut_blocks(row, budget, block_size)]
    rows.sort(key=lambda r: sum(learner_size(r, block_size)), reverse=True)
    groups = group_by_budget([learner_size(r, block_size) for r in rows], budget)
    return [[rows[i] for i in group] for group in groups]


# ------------------------------------------------------------------------------------------------ the scorer


def replay_length(record: SequenceRecord, block_size: int, mode: str) -> int:
    """The teacher's packed row for `record` (its text alone when it has no blocks yet)."""
    return len(pack(record, block_size, mode).ids)


def record_parts(record: SequenceRecord, budget: int, block_size: int, mode: str) -> list[SequenceRecord]:
    """`record` as records of consecutive blocks whose packed rows fit `budget`; the whole record when it fits
    (and always outside the draft_opd layout, whose row is the text alone)."""
    if mode != "draft_opd" or replay_length(record, block_size, mode) <= budget:
        return [record]
    parts, start = [], 0
    prompt, extra = len(record.prompt_ids), block_size - 2
    for m, anchor in enumerate(record.anchors):
        if m > start and prompt + anchor + 1 + (m + 1 - start) * extra > budget:
            parts.append(_blocks(record, start, m))
            start = m
    return parts + [_blocks(record, start, len(record.anchors))]


def _blocks(record: SequenceRecord, start: int, stop: int) -> SequenceRecord:
    return replace(record, anchors=record.anchors[start:stop], drafts=record.drafts[start:stop],
                   accepted=record.accepted[start:stop])


def replay_groups(records: Sequence[SequenceRecord], budget: int, block_size: int,
                  mode: str) -> list[list[SequenceRecord]]:
    """A rollout batch's records (cut into parts where one is over `budget`) grouped under it, in record order,
    so the blocks stay in replay's order (record by record) for whatever reads them in that order."""
    parts = [p for r in records for p in record_parts(r, budget, block_size, mode)]
    groups = group_by_budget([(replay_length(p, block_size, mode),) for p in parts], budget)
    return [[parts[i] for i in group] for group in groups]
