"""The scorer: teacher replay of whole rollout batches (`AnchorBatch` in, `ScoredItem` out).

The local trainer calls one in-process; each `ReplayScorerActor` (actors/scorer.py) owns one.
"""

from __future__ import annotations

from opd.replay import score_micro_batches
from opd.spec import ExperimentSpec
from opd.train.flops import target_matmul_params
from opd.train.messages import AnchorBatch, ScoredItem


class Scorer:
    """Teacher replay of whole rollout batches, with the FLOPs it cost."""

    def __init__(self, spec: ExperimentSpec, target) -> None:
        self.spec, self.target = spec, target
        self.params = target_matmul_params(target.model)

    def __call__(self, batch: AnchorBatch) -> ScoredItem:
        micro = score_micro_batches(self.target, batch, self.spec)
        tokens = sum(int(m.context_valid.shape[0] * m.features.shape[1]) for m in micro)
        return ScoredItem(batch, micro, scorer_flops=2.0 * self.params * tokens)
