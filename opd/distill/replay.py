"""Packed replay: the target's and the drafter's view of every recorded block, in one forward each.

Teacher: the committed sequence followed by every drafted block, packed into one row. Block m sees the committed
prefix up to and including its anchor and itself causally, so the target's state at slot k predicts d_m,k given
(c_m, d_m,<k) — rejected slots included, which is the whole point of Draft-OPD. One forward replaces M per-anchor
forwards that would each recompute the shared prefix. The attention is block-sparse (a `PackedRows` layout,
`opd/models/packed_attention.py`): no [L, L] mask is formed, L being ~23K at a 2048-token response and τ 1.4.

What the scorer ships is sized for Qwen3's 151,936-token vocabulary: not log-probs ([M, K-1, V] fp32, ~3 GB per
2048-token sequence) but the target's final-norm hidden states at the drafted slots ([N, K-1, H] in the target's
dtype, ~26 MB), from which the learner recomputes the exact teacher log-probs with the frozen LM head the
drafter shares. The target runs without its LM head, so no vocabulary-sized logits are made for the prefix.

Student: one `block_hidden` call of the drafter family over all anchors of a sequence (each block sees context
strictly before its anchor; a chain drafter is fed the block's own drafts, as at inference), giving the drafter's hidden states at the same slots.

In `naive` rollout mode the teacher scores the *committed* continuation instead of the drafts (the paper's
naive target-assisted baseline); those states are already in the committed prefix, so no blocks are appended.

Layout `committed` (`replay_mode`): when the loss reads no slot past the first rejection (`loss.first_rejected_only`),
every slot it reads has a committed context. Accepted slot k < r predicts d_k = the committed token after
c + d_<k = the committed prefix, and the first rejected slot r has context c + d_<r, again committed. So the
teacher is the target's view of the committed text alone, read at position anchor + k, and no block is appended:
the target runs over prompt + response tokens instead of ~3x that (2.3 drafted tokens per response token at τ 6,
K 16). Slots past the first rejection then hold a committed position's state; nothing reads them, so the
expected-acceptance diagnostic, which would, is not made in this layout.
A record with no drafted block (eos first, or max_new_tokens 1) trains nothing and breaks nothing. A final block
whose accepted drafts reach the response end has no rejection inside the sample (`SequenceRecord.clip_to_response`):
its slots from there on lie past the text and nothing verified them, so `position_mask` drops them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.decoding.record import SequenceRecord
from opd.distill.losses import TopKTeacher, topk_teacher
from opd.distill.scored_batch import ScoredBatch
from opd.models.lm_head import teacher_head
from opd.models.packed_attention import CHUNK_ROWS, PackedRow, PackedRows
from opd.models.protocol import Drafter
from opd.models.target import KVPrefix, Target


@dataclass
class PackedSequence:
    """One sequence laid out for the teacher: ids, positions, mask, and where each slot's state is."""

    ids: list[int]
    positions: list[int]
    prefix_len: int
    slot_index: list[list[int]]  # [M][K-1] row index of the state predicting slot k
    anchors: list[int]  # absolute positions
    accepted: list[int]
    slot_exists: list[list[bool]]
    text_len: int  # prompt + response tokens: the committed text the prefix is the start of


def replay_mode(spec) -> str:
    """The teacher's layout: `naive` (naive rollouts), `committed` (a loss that reads nothing past the first
    rejection) or `draft_opd` (every drafted block packed after the committed text)."""
    if spec.rollout.mode == "naive":
        return "naive"
    return "committed" if spec.loss.first_rejected_only else "draft_opd"


def pack(record: SequenceRecord, block_size: int, mode: str) -> PackedSequence:
    """Lay out one record: committed prefix, then (draft_opd) the drafted tokens of each block but the last."""
    prompt_len, k1 = len(record.prompt_ids), block_size - 1
    committed = record.prompt_ids + record.response_ids
    if mode == "naive":
        return _pack_naive(record, committed, prompt_len, k1)
    exists = [[k < r or not record.ends_unrejected(m) for k in range(k1)] for m, r in enumerate(record.accepted)]
    if mode == "committed":
        return _pack_committed(record, committed, prompt_len, k1, exists)
    prefix_len = prompt_len + max(record.anchors, default=-1) + 1
    ids, positions = committed[:prefix_len], list(range(prefix_len))
    slot_index, anchors = [], []
    for anchor, draft in zip(record.anchors, record.drafts):
        start, abs_anchor = len(ids), prompt_len + anchor
        ids += draft[: k1 - 1]  # the last drafted token predicts nothing we score
        positions += [abs_anchor + 1 + j for j in range(k1 - 1)]
        slot_index.append([abs_anchor] + [start + j for j in range(k1 - 1)])
        anchors.append(abs_anchor)
    return PackedSequence(ids, positions, prefix_len, slot_index, anchors, list(record.accepted), exists, len(committed))


def _pack_committed(record: SequenceRecord, committed: list[int], prompt_len: int, k1: int,
                    exists: list[list[bool]]) -> PackedSequence:
    """The committed text only: slot k of block m is read at absolute position anchor + k (see `replay_mode`)."""
    n = len(committed)
    anchors = [prompt_len + a for a in record.anchors]
    slot_index = [[min(a + k, n - 1) for k in range(k1)] for a in anchors]
    return PackedSequence(committed, list(range(n)), n, slot_index, anchors, list(record.accepted), exists, n)


def _pack_naive(record: SequenceRecord, committed: list[int], prompt_len: int, k1: int) -> PackedSequence:
    """Naive rollout: slot k of block m is the committed token at anchor + k, scored inside the prefix itself."""
    n = len(committed)
    anchors = [prompt_len + a for a in record.anchors]
    slot_index = [[min(a + k, n - 1) for k in range(k1)] for a in anchors]
    available = [min(k1, n - 1 - a) for a in anchors]
    exists = [[k < avail for k in range(k1)] for avail in available]
    return PackedSequence(committed, list(range(n)), n, slot_index, anchors, available, exists, n)


def attention_layout(p: PackedSequence, block_size: int, chunk_rows: int = CHUNK_ROWS) -> PackedRow:
    """Where each row of `p` looks: causal over the prefix; block m sees prefix <= its anchor and itself causally."""
    anchors = p.anchors if p.prefix_len < len(p.ids) else []  # naive/committed score inside the prefix: no blocks
    return PackedRow.of(p.prefix_len, anchors, block_size - 2, chunk_rows)


def packed_inputs(records: list[SequenceRecord], block_size: int, mode: str,
                  chunk_rows: int = CHUNK_ROWS) -> tuple[list[PackedSequence], torch.Tensor, torch.Tensor, PackedRows]:
    """The records' layouts and the padded target inputs: ids [B, L], positions [B, L] and the attention layout
    (block-sparse: no [L, L] mask is formed; `chunk_rows` block rows per attention call)."""
    packed = [pack(r, block_size, mode) for r in records]
    return (packed, *_padded_inputs(packed, block_size, chunk_rows))


def _padded_inputs(packed: list[PackedSequence], block_size: int,
                   chunk_rows: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor, PackedRows]:
    """ids and positions [B, L] of laid-out records, right-padded, and their attention layout."""
    length = max(len(p.ids) for p in packed)
    ids = torch.zeros(len(packed), length, dtype=torch.long)
    positions = torch.zeros(len(packed), length, dtype=torch.long)
    for b, p in enumerate(packed):
        ids[b, : len(p.ids)] = torch.tensor(p.ids)
        positions[b, : len(p.ids)] = torch.tensor(p.positions)
    layout = PackedRows(tuple(attention_layout(p, block_size, chunk_rows) for p in packed), length)
    return ids, positions, layout


@dataclass(frozen=True)
class CommittedView:
    """The target's view of right-padded committed texts (prompt + response): final-norm hidden states [B, T, H]
    and features [B, T, n*H] on the target's device, `mask` [B, T] (CPU, True at real tokens), and with `kv` the
    keys and values of every layer over them. It is all a rebuild needs of the target (opd/sources/rebuild.py), and the
    teacher's forward in the committed and naive layouts; in the draft_opd layout the blocks run alone over `kv`
    (`PackedRows.cached`), since the packed row's prefix is this text. So a scorer that rebuilds blocks runs the
    target over the text once. It depends on the text alone, so a view taken before a rebuild scores the rebuilt
    records. A hybrid target's linear-attention layers keep no keys (`Target.linear`): its view keeps none, and
    draft_opd runs the text with its blocks in one packed forward (each block from its anchor's state), the text
    a second time."""

    hidden: torch.Tensor
    features: torch.Tensor
    mask: torch.Tensor
    kv: KVPrefix | None = None

    @classmethod
    def of(cls, target: Target, records: list[SequenceRecord], block_size: int, *,
           keep_kv: bool = False) -> CommittedView:
        """One target forward over the records' texts, laid out as `score` lays them out in the committed mode;
        `keep_kv` for a draft_opd teacher."""
        packed, ids, positions, layout = packed_inputs(records, block_size, "committed")
        device = target.device
        layout, positions = layout.to(device), positions.to(device)
        if keep_kv and not target.linear:
            hidden, features, kv = target.text_states(ids.to(device), attention_mask=layout, position_ids=positions)
        else:
            (hidden, features), kv = target.hidden_states(ids.to(device), attention_mask=layout,
                                                          position_ids=positions), None
        lengths = torch.tensor([len(p.ids) for p in packed])
        return cls(hidden, features, torch.arange(ids.shape[1])[None, :] < lengths[:, None], kv)

    def rows(self) -> list[torch.Tensor]:
        """Each text's features [T_i, n*H] (slices, not copies): what `rebuild_records` takes as `features`."""
        return [f[:n] for f, n in zip(self.features, self.mask.sum(1).tolist())]

    def states(self, target: Target, packed: list[PackedSequence], mode: str,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, features) for records laid out as `packed`, which must be these texts. The committed and naive
        layouts read the view itself. draft_opd runs the block rows over `kv`; its hidden is [B, T + Lb, H],
        the text's states then the blocks', which `packed_slots` indexes. A view without keys (a hybrid target)
        runs the whole packed rows instead, whose hidden is laid out as `packed`."""
        lengths = self.mask.sum(1).tolist()
        texts = [p.text_len for p in packed]
        if lengths != texts:
            raise ValueError(f"score: the view's text lengths {lengths} are not the records' {texts}")
        if mode != "draft_opd":
            return self.hidden, self.features
        if self.kv is None and target.linear:
            ids, positions, layout = _padded_inputs(packed, block_size)
            device = target.device
            return target.hidden_states(ids.to(device), attention_mask=layout.to(device),
                                        position_ids=positions.to(device))[0], self.features
        if self.kv is None:
            raise ValueError("score: a draft_opd teacher from a view needs its keys and values (keep_kv=True)")
        ids, positions, layout = block_inputs(packed, block_size, self.hidden.shape[1])
        if not ids.shape[1]:
            return self.hidden, self.features
        device = target.device
        blocks, _ = target.hidden_states(ids.to(device), attention_mask=layout.to(device),
                                         position_ids=positions.to(device), prefix=self.kv)
        return torch.cat([self.hidden, blocks], dim=1), self.features


def block_inputs(packed: list[PackedSequence], block_size: int,
                 cached: int) -> tuple[torch.Tensor, torch.Tensor, PackedRows]:
    """The block rows alone of draft_opd layouts (ids, positions [B, Lb]) and their layout over `cached` text
    positions already in the target's KV cache."""
    rows = [p.ids[p.prefix_len :] for p in packed]
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(packed), length, dtype=torch.long)
    positions = torch.zeros(len(packed), length, dtype=torch.long)
    for b, (p, r) in enumerate(zip(packed, rows)):
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        positions[b, : len(r)] = torch.tensor(p.positions[p.prefix_len :], dtype=torch.long)
    layout = PackedRows(tuple(attention_layout(p, block_size) for p in packed), length, cached)
    return ids, positions, layout


def packed_slots(slot_index: torch.Tensor, packed: list[PackedSequence], cached: int) -> torch.Tensor:
    """`slot_index` (packed row positions) as indices into [text states (`cached` long); block rows]."""
    prefix = torch.tensor([p.prefix_len for p in packed])[:, None, None]
    return torch.where(slot_index < prefix, slot_index, slot_index - prefix + cached)


@torch.no_grad()
def score(target: Target, records: list[SequenceRecord], *, block_size: int, mode: str = "draft_opd",
          teacher_temperature: float = 1.0, teacher_topk: int | None = None,
          view: CommittedView | None = None) -> ScoredBatch:
    """Teacher replay for a batch of records: one packed target forward (no LM head) for all their blocks.
    `teacher_temperature` applies only with `teacher_topk` (top-k is taken here); the learner applies it
    to the full-vocabulary teacher. `view`: the forward over these records' texts already run (`CommittedView.of`),
    so the target runs over the drafted blocks alone (draft_opd) or not at all."""
    device = target.device
    if view is None:
        packed, ids, positions, layout = packed_inputs(records, block_size, mode)
        hidden, features = target.hidden_states(ids.to(device), attention_mask=layout.to(device),
                                                position_ids=positions.to(device))
    else:
        packed = [pack(r, block_size, mode) for r in records]
        hidden, features = view.states(target, packed, mode, block_size)
    batch = _layout(packed, records, block_size, mode)
    slot_index = batch.pop("slot_index")
    if view is not None and view.kv is not None and mode == "draft_opd":
        slot_index = packed_slots(slot_index, packed, view.hidden.shape[1])
    rows = torch.arange(len(packed), device=device)[:, None, None]
    slots = hidden[rows, slot_index.to(device)][batch["block_valid"].to(device)]  # [N, K-1, H]
    teacher = (slots.cpu().contiguous() if teacher_topk is None else
               _to_cpu(topk_teacher(teacher_head(target), slots, temperature=teacher_temperature, topk=teacher_topk)))
    prefix = batch["context_valid"].shape[1]
    return ScoredBatch(features=features[:, :prefix].cpu().contiguous(), teacher=teacher, **batch)


def _layout(packed: list[PackedSequence], records: list[SequenceRecord], block_size: int,
            mode: str) -> dict[str, torch.Tensor]:
    """The small index tensors of a scored batch (CPU), and where each block's slot states are."""
    b, m, k1 = len(packed), max(len(p.anchors) for p in packed), block_size - 1
    slot_index = torch.zeros(b, m, k1, dtype=torch.long)
    anchor_pos = torch.zeros(b, m, dtype=torch.long)
    block_ids = torch.zeros(b, m, k1, dtype=torch.long)
    accepted = torch.zeros(b, m, dtype=torch.long)
    block_valid = torch.zeros(b, m, dtype=torch.bool)
    exists = torch.zeros(b, m, k1, dtype=torch.bool)
    prefix = max(p.prefix_len for p in packed)
    context_valid = torch.zeros(b, prefix, dtype=torch.bool)
    committed = torch.zeros(b, prefix, dtype=torch.long)
    for i, (p, r) in enumerate(zip(packed, records)):
        n = len(p.anchors)
        seq = r.prompt_ids + r.response_ids
        if n:
            slot_index[i, :n] = torch.tensor(p.slot_index)
            anchor_pos[i, :n] = torch.tensor(p.anchors)
            block_ids[i, :n] = torch.tensor([_block_inputs(seq, a, d, k1, mode) for a, d in zip(p.anchors, r.drafts)])
            accepted[i, :n] = torch.tensor(p.accepted)
            exists[i, :n] = torch.tensor(p.slot_exists)
        block_valid[i, :n] = True
        context_valid[i, : p.prefix_len] = True
        committed[i, : min(len(seq), prefix)] = torch.tensor(seq[:prefix])
    return {"slot_index": slot_index, "context_valid": context_valid, "context_ids": committed,
            "block_ids": block_ids, "anchor_positions": anchor_pos, "block_valid": block_valid,
            "accepted": accepted[block_valid], "position_mask": exists[block_valid]}


def _block_inputs(seq: list[int], anchor: int, draft: list[int], k1: int, mode: str) -> list[int]:
    """The tokens a block feeds its drafter at offsets 0..K-2: the anchor, then the drafts it drafted (a chain
    drafter reads them, as it did at inference), or the committed tokens in naive mode (whose slots score them)."""
    fed = seq[anchor : anchor + k1] if mode == "naive" else [seq[anchor], *draft[: k1 - 1]]
    return fed + [0] * (k1 - len(fed))


def _to_cpu(teacher: TopKTeacher) -> TopKTeacher:
    tail = None if teacher.tail_logprob is None else teacher.tail_logprob.cpu().contiguous()
    return TopKTeacher(teacher.ids.cpu().contiguous(), teacher.logprobs.cpu().contiguous(), tail)


def student_hidden(drafter: Drafter, batch: ScoredBatch) -> torch.Tensor:
    """Drafter final hidden states [N, K-1, H] at the drafted slots of the N valid blocks, in one forward of the
    drafter family's training call (logits come chunk by chunk in the loss, through its student head)."""
    hidden = drafter.block_hidden(batch.features, batch.context_ids, batch.context_valid, batch.anchor_positions,
                                  batch.block_ids)
    return hidden[batch.block_valid]
