"""The expected-acceptance diagnostic on a setting's states: given records (decoded, or rebuilt offline), the exact
expected acceptance of every point-mass setting at their drafted slots, from one packed target replay per batch
(opd/eval/expected.py has the rule), and for a setting whose drafts were sampled from q, its own rule on its own
states (α_k = Σ min(p_T, q) and the expected length given the sampled drafts; q from the drafter on the replayed
blocks). `opd eval` prints it beside the realised τ."""

from __future__ import annotations

import torch

from opd.decoding.sampling import Sampling
from opd.distill.acceptance_loss import realized_q
from opd.distill.losses import processed_logprobs
from opd.distill.replay import score, student_hidden
from opd.distill.scored_batch import ScoredBatch
from opd.eval.expected import ExpectedAcceptance, record_drafts, sampled_acceptance, teacher_acceptance
from opd.models.build import Models
from opd.models.lm_head import SLOTS_PER_CHUNK, apply_head, chunks, teacher_head


class Diagnosis:
    """Expected acceptance of each point-mass setting on the states of one setting's records, batch by batch
    (one packed target replay per batch, so memory stays that of a batch)."""

    def __init__(self, models: Models, settings: dict[str, Sampling]) -> None:
        self.models, self.settings = models, settings
        self.acceptance: dict[str, list] = {name: [] for name in settings}
        self.survival: dict[str, list] = {name: [] for name in settings}  # q-sampled settings only
        self.rooms: list[list[int]] = []

    def add(self, records) -> None:
        drafts, _ = record_drafts(records)
        if not self.settings or not len(drafts):
            return
        target = self.models.target
        batch = score(target, records, block_size=self.models.drafter.block_size)
        point_mass = {name: s for name, s in self.settings.items() if not s.sample_drafts}
        for name, a in teacher_acceptance(drafts, batch.teacher, teacher_head(target), point_mass).items():
            self.acceptance[name].append(a)
        for name, sampling in self.settings.items():
            if sampling.sample_drafts and (sampled := self._sampled(batch, drafts, sampling)) is not None:
                self.acceptance[name].append(sampled[0])
                self.survival[name].append(sampled[1])
        self.rooms += [rec.rooms for rec in records]

    @torch.no_grad()
    def _sampled(self, batch: ScoredBatch, drafts: torch.Tensor, sampling: Sampling
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """α_k and P(accepted >= k) of drafts sampled from the drafter's q, SLOTS_PER_CHUNK slots at a time; None
        for a drafter whose q lives on a draft vocabulary of its own (EAGLE-3's), which this exact expectation
        does not map onto the target's: its sampled τ is decoding's, measured."""
        drafter, head = self.models.drafter, teacher_head(self.models.target)
        assert isinstance(batch.teacher, torch.Tensor)  # `add` scores without teacher_topk: final-norm hidden states
        hidden, predecessors = student_hidden(drafter, batch), batch.block_ids[batch.block_valid]
        out = []
        for part in chunks(len(drafts), max(1, SLOTS_PER_CHUNK // max(1, drafts.shape[1]))):
            logits = apply_head(drafter.student_head, hidden[part])
            p_log = processed_logprobs(apply_head(head, batch.teacher[part]), sampling)
            if logits.shape[-1] != p_log.shape[-1]:
                return None
            q = realized_q(drafter, hidden[part], logits, predecessors[part], sampling)
            out.append(sampled_acceptance(drafts[part].to(p_log.device), p_log, q))
        return torch.cat([a for a, _ in out]).float().cpu(), torch.cat([s for _, s in out]).float().cpu()

    def result(self) -> dict[str, ExpectedAcceptance]:
        return {name: ExpectedAcceptance.of(torch.cat(parts), self.rooms,
                                            torch.cat(self.survival[name]) if self.survival[name] else None)
                for name, parts in self.acceptance.items() if parts}
