"""The scorer: teacher replay of whole rollout batches (`AnchorBatch` in, `ScoredItem` out).

With a rebuilt rollout source (`rollout.source: target | samples`) the batch arrives as target samples only, and
the scorer first rebuilds its blocks (opd/sources/rebuild.py) with the drafter it owns, which adopts every published
version: the batch's `draft_version` is then the scorer's, so its policy lag is measured where the blocks are
made and rollout never waits for weights. The rebuild's cost is counted with the batch's production FLOPs.
The rebuild and the teacher read the target over the same text (prompt + response), so one forward per
micro-batch (`CommittedView`) serves both and is charged once, with the rebuild: the committed layout's teacher is
that view, and the packed (draft_opd) layout's runs the drafted blocks alone over the view's keys and values.

The local trainer calls one in-process; each `ReplayScorerActor` (actors/scorer.py) owns one. Besides the
teacher it ships the expected-acceptance diagnostic of the rollout's drafts under every point-mass eval
setting (opd/eval/expected.py): the LM head over the drafted slots, ~5% of the replay forward's FLOPs at
Qwen3-8B shapes (2048-token response, τ 6). It is monitoring, so `scorer_flops` leaves it out.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from opd.decoding.record import UNDRAFTED, SequenceRecord
from opd.distill.micro_batches import replay_groups
from opd.distill.replay import CommittedView, pack, replay_mode, score
from opd.distill.scored_batch import ScoredBatch
from opd.eval.expected import point_mass_settings, record_drafts, teacher_acceptance
from opd.models.flops import DrafterParams, TargetParams, rebuild_flops
from opd.models.lm_head import teacher_head
from opd.models.protocol import Drafter
from opd.sources.rebuild import rebuild_records
from opd.spec import ExperimentSpec
from opd.train.messages import AnchorBatch, ScoredItem


class Scorer:
    """Teacher replay of whole rollout batches, with the FLOPs it cost. `drafter` (rebuilt sources only) is the
    scorer's own copy: `load_drafter` swaps in published weights."""

    def __init__(self, spec: ExperimentSpec, target, drafter: Drafter | None = None) -> None:
        self.spec, self.target, self.drafter = spec, target, drafter
        self.params = TargetParams.of(target.model)
        self.draft_version = UNDRAFTED
        if spec.rollout.rebuilt and drafter is None:
            raise ValueError(f"rollout.source {spec.rollout.source} needs the scorer's drafter")

    def load_drafter(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Adopt published weights (every tensor copied before the version changes)."""
        assert self.drafter is not None  # rebuilt sources only, for which __init__ requires one
        self.drafter.load_state_dict(state_dict)
        self.draft_version = version

    @property
    def shares_forward(self) -> bool:
        """Rebuilt blocks: the rebuild's target forward over the text is the teacher's too."""
        return self.spec.rollout.rebuilt

    def __call__(self, batch: AnchorBatch) -> ScoredItem:
        if self.shares_forward:
            groups = self.groups(batch.records, "committed")  # on the text: the blocks do not exist yet
            views = [self.committed_view(group) for group in groups]
            batch = self.rebuild(batch, features=[row for view in views for row in view.rows()])
            groups = _regroup(batch.records, [len(g) for g in groups])
            micro = [self.score(group, view) for group, view in zip(groups, views)]
        else:
            if self.spec.rollout.rebuilt:
                batch = self.rebuild(batch)
            groups = self.groups(batch.records, replay_mode(self.spec))
            micro = [self.score(group) for group in groups]
        scored = [r for group in groups for r in group]
        return ScoredItem(batch, micro, scorer_flops=self.replay_flops(scored, micro),
                          acceptance=self.expected_acceptance(scored, micro))

    def groups(self, records: list[SequenceRecord], mode: str) -> list[list[SequenceRecord]]:
        """The micro-batches, in record order: `optim.micro_batch_size` records each, or under
        `replay.micro_batch_tokens` (a record over it cut into parts at block boundaries; opd/distill/micro_batches.py),
        measured as `mode` lays the teacher's rows out."""
        budget, block_size = self.spec.replay.micro_batch_tokens, self.spec.models.drafter.block_size
        if budget is None:
            size = self.spec.optim.micro_batch_size
            return [records[i : i + size] for i in range(0, len(records), size)]
        return replay_groups(records, budget, block_size, mode)

    def committed_view(self, records: list[SequenceRecord]) -> CommittedView:
        """The target's view of one micro-batch's text, one forward. The whole batch's views live until it is
        scored: about the rebuild's own feature tensors, plus 1/n for the hidden states (n target layers feed the
        drafter), plus in the draft_opd layout every layer's keys and values over the text (at Qwen3-8B, 147 KB a
        token in bf16: 4.8 GB for 8 sequences of 4K tokens)."""
        keep_kv = replay_mode(self.spec) == "draft_opd"
        return CommittedView.of(self.target, records, self.spec.models.drafter.block_size, keep_kv=keep_kv)

    def score(self, records: list[SequenceRecord], view: CommittedView | None = None) -> ScoredBatch:
        """One micro-batch's teacher replay; with `view`, reading the text's forward taken before the rebuild, which
        holds for the rebuilt records, whose text is unchanged."""
        r = self.spec.replay
        return score(self.target, records, block_size=self.spec.models.drafter.block_size, mode=replay_mode(self.spec),
                     teacher_temperature=r.teacher_temperature, teacher_topk=r.teacher_topk, view=view)

    def rebuild(self, batch: AnchorBatch, features: list[torch.Tensor] | None = None) -> AnchorBatch:
        """The batch's blocks as the current drafter would have drafted them, stamped with its version; the cost
        (`rebuild_flops`, the target's forward over the text included) added to the batch's production FLOPs.
        `features`: the target's view of each text when the caller already has it (`committed_views`)."""
        assert self.drafter is not None  # rebuilt sources only, for which __init__ requires one
        records = rebuild_records(self.target, self.drafter, batch.records, draft_version=self.draft_version,
                                  batch_size=self.spec.rollout.batch_size, features=features)
        cost = rebuild_flops(records, self.params, DrafterParams.of(self.drafter))
        flops = replace(batch.flops, target_forward=batch.flops.target_forward + cost.target_forward,
                        drafter_forward=batch.flops.drafter_forward + cost.drafter_forward)
        return AnchorBatch(batch.index, self.draft_version, records, flops)

    def replay_flops(self, records: list[SequenceRecord], micro: list[ScoredBatch]) -> float:
        """The teacher's FLOPs (opd/models/flops.py): every packed token (the committed prefix and every drafted
        block) through the decoder, and the LM head at every scored slot (here for top-k, else in the learner).
        With a shared forward (`shares_forward`) the decoder ran over the text once, charged by `rebuild_flops` to
        the batch's production FLOPs, so only the drafted blocks' rows and the LM head are counted here, except
        where a hybrid target's drafted blocks run with their text again (`CommittedView.states`)."""
        block_size, mode = self.spec.models.drafter.block_size, replay_mode(self.spec)
        packed = [pack(r, block_size, mode) for r in records]
        text_counted = self.shares_forward and not (self.target.linear and mode == "draft_opd")
        tokens = sum(len(p.ids) - (p.prefix_len if text_counted else 0) for p in packed)
        blocks = sum(len(p.anchors) for p in packed if p.prefix_len < len(p.ids))
        return self.params.replay(tokens, blocks, logits=sum(int(m.position_mask.sum()) for m in micro))

    def expected_acceptance(self, records: list[SequenceRecord], micro: list[ScoredBatch]) -> dict[str, torch.Tensor]:
        """a_k [N, K-1] of the scored records' drafted blocks per eval setting (parts of a record follow each other,
        so this is the batch's block order). Only the packed layout has the target's view of every drafted slot
        (naive and committed teachers read committed positions), so the others have none."""
        settings = point_mass_settings(self.spec.eval.sampling)
        drafts, _ = record_drafts(records)  # every block in replay's order: micro-batch by micro-batch
        if replay_mode(self.spec) != "draft_opd" or not settings or not len(drafts):
            return {}
        parts = [teacher_acceptance(d, mb.teacher, teacher_head(self.target), settings,
                                    teacher_temperature=self.spec.replay.teacher_temperature)
                 for d, mb in zip(drafts.split([mb.num_blocks for mb in micro]), micro)]
        return {name: torch.cat([part[name] for part in parts]) for name in settings}


def _regroup(records: list[SequenceRecord], sizes: list[int]) -> list[list[SequenceRecord]]:
    """`records` cut into consecutive groups of `sizes` (the groups their texts were viewed in)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [records[start : start + size] for start, size in zip(starts, sizes)]
