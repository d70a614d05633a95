"""The expected-acceptance diagnostic on a setting's states: given records (decoded, or rebuilt offline), the exact
expected acceptance of every point-mass setting at their drafted slots, from one packed target replay per batch
(opd/eval/expected.py has the rule). `opd eval` prints it beside the realised τ."""

from __future__ import annotations

import torch

from opd.decoding.sampling import Sampling
from opd.distill.replay import score
from opd.eval.expected import ExpectedAcceptance, record_drafts, teacher_acceptance
from opd.models.build import Models
from opd.models.lm_head import teacher_head


class Diagnosis:
    """Expected acceptance of each point-mass setting on the states of one setting's records, batch by batch
    (one packed target replay per batch, so memory stays that of a batch)."""

    def __init__(self, models: Models, settings: dict[str, Sampling]) -> None:
        self.models, self.settings = models, settings
        self.acceptance: dict[str, list] = {name: [] for name in settings}
        self.rooms: list[list[int]] = []

    def add(self, records) -> None:
        drafts, _ = record_drafts(records)
        if not self.settings or not len(drafts):
            return
        target = self.models.target
        teacher = score(target, records, block_size=self.models.drafter.block_size).teacher
        for name, a in teacher_acceptance(drafts, teacher, teacher_head(target), self.settings).items():
            self.acceptance[name].append(a)
        self.rooms += [rec.rooms for rec in records]

    def result(self) -> dict[str, ExpectedAcceptance]:
        return {name: ExpectedAcceptance.of(torch.cat(parts), self.rooms)
                for name, parts in self.acceptance.items() if parts}
