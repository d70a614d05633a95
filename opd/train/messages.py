"""The messages that cross process boundaries, in the order a batch meets them.

    prompt batch ─► AnchorBatch (rollout) ─► ScoredBatch ×n inside a ScoredItem (scorer) ─► StepReport (learner)
        ▲                                                                                      │
        └──────────── WeightSnapshot (learner → weight store → rollout) ◄──────────────────────┘

A `Ticket` travels beside every AnchorBatch and ScoredItem through the queues (opd/train/ledger.py keeps the
account of them); the driver folds the StepReports into one `TrainResult` (opd/train/result.py).

Each is a plain dataclass (`Ticket` a NamedTuple: it is a heap key and a dict key in the ledger). The ones with
large tensors (`ScoredBatch`, `WeightSnapshot`) pickle zero-copy (`ZeroCopy`). `SequenceRecord`, the
per-sequence payload of an AnchorBatch, stays in opd/decoding/record.py: decoding produces it and sits below
train, so it must not import from here. This module imports only from below train (decoding, losses, eval_row,
zero_copy, weights) and train/flops.py, so replay.py can take `ScoredBatch` from it without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from opd.decoding.record import SequenceRecord
from opd.errors import OpdError
from opd.eval_row import EvalRow
from opd.losses import TopKTeacher
from opd.train.flops import FlopCounter
from opd.weights import checksum
from opd.zero_copy import ZeroCopy


class Ticket(NamedTuple):
    """One production attempt of batch `index`; it travels through the queues beside the payload."""

    index: int  # the rollout batch number (the data cursor)
    attempt: int  # 0 for the first production, +1 for every re-production of a given-up attempt


@dataclass
class AnchorBatch:
    """Rollout → scorer: token ids and small integers only, cheap to move between nodes."""

    index: int  # rollout batch number (the data cursor)
    draft_version: int  # the published weight version that drafted it (policy lag = learner step - this)
    records: list[SequenceRecord]  # one per sequence: committed text, anchors, drafts, acceptance
    flops: FlopCounter  # what producing it cost (target and drafter forwards)

    @property
    def tokens(self) -> int:
        return sum(len(r.response_ids) for r in self.records)


@dataclass
class ScoredBatch(ZeroCopy):
    """What the learner needs for B sequences with up to M blocks each, N of them real (padding excluded): one
    micro-batch of teacher replay (opd/replay.py makes them).

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
        teacher = (TopKTeacher(t.ids.to(device), t.logprobs.to(device), t.tail_logprob.to(device))
                   if isinstance(t, TopKTeacher) else t.to(device))
        return ScoredBatch(self.features.to(device), self.context_valid.to(device), self.context_ids.to(device),
                           self.block_ids.to(device), self.anchor_positions.to(device), self.block_valid.to(device), self.accepted.to(device),
                           self.position_mask.to(device), teacher)


@dataclass
class ScoredItem:
    """Scorer → learner: one rollout batch after teacher replay."""

    batch: AnchorBatch  # records, index, draft version, rollout FLOPs
    micro_batches: list[ScoredBatch]  # the batch cut into `optim.micro_batch_size` sequences each
    scorer_flops: float = 0.0  # what the teacher replay cost
    # Eval setting name -> expected acceptance a_k [N, K-1] of the drafted blocks (opd/expected_acceptance.py)
    acceptance: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class StepReport:
    """Learner → driver: one optimizer step."""

    step: int  # the step just taken (1-based: the learner's step count after it)
    metrics: dict[str, float]  # losses, grad norm, lr, rollout τ and acceptance, policy lag, FLOPs, ...
    # held-out rows that came back from the evaluator during this step, by the step whose weights they evaluated
    evals: dict[int, list[EvalRow]] = field(default_factory=dict)
    checkpoint: str | None = None  # the checkpoint directory, when this step wrote one


@dataclass
class TrainResult:
    """Driver → `opd train` / `opd run`: what a training command did, on either engine."""

    steps: int  # the learner's step when the command stopped
    losses: list[float] = field(default_factory=list)  # per step taken in this process
    evals: dict[int, list[EvalRow]] = field(default_factory=dict)  # step -> held-out rows
    checkpoint: str | None = None  # the run's newest checkpoint (DFlash format), if any: written now or before a resume
    run_id: str | None = None  # the MLflow run


@dataclass
class WeightSnapshot(ZeroCopy):
    """Learner → weight store → rollout: versioned, checksummed draft weights (see opd/weights.py)."""

    version: int  # the learner step that produced these weights
    state: dict[str, torch.Tensor]  # CPU copies of the drafter's state dict
    checksum: str  # `opd.weights.checksum(state)`, computed once at publish

    @classmethod
    def of(cls, state: dict[str, torch.Tensor], version: int) -> WeightSnapshot:
        """A CPU copy (the optimizer keeps updating the live weights) and its checksum."""
        cpu = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        return cls(version, cpu, checksum(cpu))

    def verified(self, expected_version: int | None = None) -> WeightSnapshot:
        """Self, after checking the version and that every tensor still hashes to the checksum."""
        if expected_version is not None and self.version != expected_version:
            raise OpdError(f"weight broadcast: got version {self.version}, expected {expected_version}")
        if checksum(self.state) != self.checksum:
            raise OpdError(f"weight broadcast v{self.version}: checksum mismatch (corrupted or incomplete weights)")
        return self
