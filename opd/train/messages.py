"""The messages that cross process boundaries, in the order a batch meets them.

    prompt batch ─► AnchorBatch (rollout) ─► ScoredBatch ×n inside a ScoredItem (scorer) ─► StepReport (learner)
        ▲                                                                                      │
        └──────────── WeightSnapshot (learner → weight store → rollout) ◄──────────────────────┘

A `Ticket` (opd/train/ticket.py) travels beside every AnchorBatch and ScoredItem through the queues
(opd/train/ledger.py keeps the account of them); the driver folds the StepReports into one `TrainResult` (opd/train/result.py).

Each is a plain dataclass. The ones with
large tensors (`ScoredBatch`, `WeightSnapshot`) pickle zero-copy (`ZeroCopy`). Two live in the stage that makes
them, below train: `SequenceRecord`, the per-sequence payload of an AnchorBatch (opd/decoding/record.py), and
`ScoredBatch`, one micro-batch of teacher replay (opd/distill/scored_batch.py, made by opd/distill/replay.py).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from opd.errors import OpdError
from opd.zero_copy import ZeroCopy

if TYPE_CHECKING:  # annotations only: a process that unpickles one of these does not load the models
    from opd.decoding.record import SequenceRecord
    from opd.distill.scored_batch import ScoredBatch
    from opd.eval.row import EvalRow
    from opd.models.flops import FlopCounter


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
class ScoredItem:
    """Scorer → learner: one rollout batch after teacher replay."""

    batch: AnchorBatch  # records, index, draft version, rollout FLOPs
    micro_batches: list[ScoredBatch]  # the batch cut into `optim.micro_batch_size` sequences or `replay.micro_batch_tokens`
    scorer_flops: float = 0.0  # what the teacher replay cost
    # Eval setting name -> expected acceptance a_k [N, K-1] of the drafted blocks (opd/eval/expected.py)
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
    checkpoint: str | None = None  # the run's newest checkpoint (the family's public format), if any: written now or before a resume
    run_id: str | None = None  # the MLflow run
    # the batch ledger's account of this process's part of the run (opd/train/ledger.py): lost, orphaned, stale,
    # reproduced, restarts, dropped, ...; every count 0 but claimed and trained when nothing was disturbed
    ledger: dict[str, int] | None = None


@dataclass
class WeightSnapshot(ZeroCopy):
    """Learner → weight store → rollout: versioned, checksummed draft weights (see `checksum`)."""

    version: int  # the learner step that produced these weights
    state: dict[str, torch.Tensor]  # CPU copies of the drafter's state dict
    checksum: str  # `checksum(state)`, computed once at publish

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


def checksum(state: dict[str, torch.Tensor]) -> str:
    """CRC-32 over names, shapes, dtypes and bytes, in name order.

    A snapshot carries its version and this checksum, so a rollout actor verifies it received the complete weights of
    the version it expects before it swaps them in: a half-loaded or corrupted drafter must never produce rollouts. A
    Qwen3-4B drafter is ~1 GB in bf16 and is published every `broadcast_every` steps, so it is CRC-32 (zlib, faster than
    blake2b on one core; bench/results/scale.md times the whole publish, CRC-32 and zero-copy against blake2b and torch
    pickling, and no file there times the hashes alone) over the tensors' own memory without a copy, computed once at
    publish and once where the bytes land. It guards against corruption and truncation, not tampering."""
    crc = 0
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        crc = zlib.crc32(f"{name}:{tuple(t.shape)}:{t.dtype}".encode(), crc)
        # an ndarray is a buffer (no copy); numpy's stubs say so only for Python >= 3.12, and mypy checks 3.10
        crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), crc)  # type: ignore[arg-type]
    return f"crc32:{crc:08x}"
