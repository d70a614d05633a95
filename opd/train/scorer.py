"""The scorer: teacher replay of whole rollout batches (`AnchorBatch` in, `ScoredItem` out).

The local trainer calls one in-process; each `ReplayScorerActor` (actors/scorer.py) owns one. Besides the
teacher it ships the expected-acceptance diagnostic of the rollout's drafts under every point-mass eval
setting (opd/expected_acceptance.py): the LM head over the drafted slots, ~5% of the replay forward's FLOPs at
Qwen3-8B shapes (2048-token response, τ 6). It is monitoring, so `scorer_flops` leaves it out.
"""

from __future__ import annotations

import torch

from opd.expected_acceptance import point_mass_settings, record_drafts, teacher_acceptance
from opd.decoding.record import SequenceRecord
from opd.replay import pack, replay_mode, score_micro_batches
from opd.spec import ExperimentSpec
from opd.train.flops import TargetParams
from opd.train.messages import AnchorBatch, ScoredBatch, ScoredItem


class Scorer:
    """Teacher replay of whole rollout batches, with the FLOPs it cost."""

    def __init__(self, spec: ExperimentSpec, target) -> None:
        self.spec, self.target = spec, target
        self.params = TargetParams.of(target.model)

    def __call__(self, batch: AnchorBatch) -> ScoredItem:
        micro = score_micro_batches(self.target, batch, self.spec)
        return ScoredItem(batch, micro, scorer_flops=self.replay_flops(batch.records, micro),
                          acceptance=self.expected_acceptance(batch, micro))

    def replay_flops(self, records: list[SequenceRecord], micro: list[ScoredBatch]) -> float:
        """The teacher's FLOPs (opd/train/flops.py): every packed token (the committed prefix and every drafted
        block) through the decoder, and the LM head at every scored slot (here for top-k, else in the learner)."""
        block_size, mode = self.spec.models.drafter.block_size, replay_mode(self.spec)
        tokens = sum(len(pack(r, block_size, mode).ids) for r in records)
        return self.params.forward(tokens, logits=sum(int(m.position_mask.sum()) for m in micro))

    def expected_acceptance(self, batch: AnchorBatch, micro: list[ScoredBatch]) -> dict[str, torch.Tensor]:
        """a_k [N, K-1] of the batch's drafted blocks per eval setting. Only the packed layout has the target's
        view of every drafted slot (naive and committed teachers read committed positions), so the others have none."""
        settings = point_mass_settings(self.spec.eval.sampling)
        drafts, _ = record_drafts(batch.records)  # every block in replay's order: micro-batch by micro-batch
        if replay_mode(self.spec) != "draft_opd" or not settings or not len(drafts):
            return {}
        parts = [teacher_acceptance(d, mb.teacher, self.target.lm_head, settings,
                                    teacher_temperature=self.spec.replay.teacher_temperature)
                 for d, mb in zip(drafts.split([mb.num_blocks for mb in micro]), micro)]
        return {name: torch.cat([part[name] for part in parts]) for name in settings}
