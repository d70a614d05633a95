"""`ScoredBatch`, the scorer's message to the learner: one micro-batch of teacher replay (`opd/distill/replay.py`
`score` makes them). A file of its own, importing only torch and the loss's teacher type, so that whatever only
moves or unpickles one (a queue, a test's reader actor) does not load the models to do it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.distill.losses import TopKTeacher
from opd.zero_copy import ZeroCopy


@dataclass
class ScoredBatch(ZeroCopy):
    """What the learner needs for B sequences with up to M blocks each, N of them real (padding excluded): one
    micro-batch of teacher replay (`score` below makes them).

    Born on the CPU and contiguous, and pickled as numpy buffers (`ZeroCopy`), so the object store moves it
    without torch's slow storage pickling; the learner moves one micro-batch at a time to its device.
    """

    features: torch.Tensor  # [B, S, n*H] target features of the committed prefix
    context_valid: torch.Tensor  # [B, S] bool
    context_ids: torch.Tensor  # [B, S] the committed tokens of the prefix
    block_ids: torch.Tensor  # [B, M, K-1] each block's anchor, then the drafts its drafter was fed (EAGLE-3 reads them)
    anchor_positions: torch.Tensor  # [B, M] its absolute position (prompt + response index)
    block_valid: torch.Tensor  # [B, M] bool; the N True entries, row-major, are the blocks below
    accepted: torch.Tensor  # [N] drafted tokens the target accepted
    position_mask: torch.Tensor  # [N, K-1] bool: slots that exist
    teacher: torch.Tensor | TopKTeacher  # [N, K-1, H] final-norm target hidden states, or top-k log-probs

    @property
    def num_blocks(self) -> int:
        return int(self.accepted.shape[0])

    def to(self, device: torch.device | str) -> ScoredBatch:
        t = self.teacher
        teacher = (TopKTeacher(t.ids.to(device), t.logprobs.to(device),
                               None if t.tail_logprob is None else t.tail_logprob.to(device))  # None: derived
                   if isinstance(t, TopKTeacher) else t.to(device))
        return ScoredBatch(self.features.to(device), self.context_valid.to(device), self.context_ids.to(device),
                           self.block_ids.to(device), self.anchor_positions.to(device), self.block_valid.to(device), self.accepted.to(device),
                           self.position_mask.to(device), teacher)
