"""A drafter family's own training terms, beside the objectives every family shares.

The paper's loss (opd/distill/losses.py), the acceptance objectives (acceptance_loss.py) and SFT's cross-entropy
train any drafter through the `Drafter` protocol. Some families have parts those objectives cannot reach or
objectives of their own: DFlash 2's candidate selector (opd/distill/selector_loss.py), DSpark's confidence head and
published SFT objective (opd/distill/confidence_loss.py). Such a family registers a `FamilyTerms` under its kind,
in its own term module (`@terms_for`); the learner and SFT ask `terms_of(drafter)` and never which family it is.
Term modules are found by importing every module of this package once, as target layer kinds are found.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

from opd.decoding.sampling import Sampling
from opd.distill.losses import StepNorm
from opd.formats.section import DrafterSection
from opd.models.protocol import Drafter
from opd.spec import LossSpec


@dataclass(frozen=True)
class OpdSlots:
    """One micro-batch of Draft-OPD as a family term reads it (opd/train/learner.py)."""

    hidden: torch.Tensor  # [N, K-1, H] the drafter's rows at the drafted slots, with grad
    teacher: object  # the target's view: [N, K-1, H] final-norm hidden, or a TopKTeacher
    predecessors: torch.Tensor  # [N, K-1] the token each slot was drafted after (the anchor first)
    accepted: torch.Tensor  # [N] drafts accepted per block
    position_mask: torch.Tensor  # [N, K-1] slots the loss may weigh
    loss: LossSpec
    norm: StepNorm
    teacher_processing: Sampling
    chunk_size: int
    section: DrafterSection  # models.drafter: where a family's own options live


@dataclass(frozen=True)
class SftSlots:
    """One SFT micro-batch as a family term reads it (opd/train/sft.py)."""

    hidden: torch.Tensor  # [N, K-1, H] the drafter's rows at the drafted slots, with grad
    view: Callable[[], torch.Tensor]  # -> [N, K-1, H] the target's final-norm hidden there, formed if asked
    labels: torch.Tensor  # [N, K-1] the data tokens
    predecessors: torch.Tensor  # [N, K-1] the token fed before each slot (teacher forcing)
    position_mask: torch.Tensor  # [N, K-1]
    gamma: float
    log_weight_sum: float
    chunk_size: int


class FamilyTerms:
    """What a family adds to the shared objectives: nothing, unless its term module says otherwise."""

    def prepare(self, drafter: Drafter, wanted: bool) -> bool:
        """Before the optimizer is built: whether a part of the drafter only this family's terms train (a
        selector) trains in this run (`wanted`: a term or objective reads it); a part that does not is frozen, so
        no optimizer holds it and it is saved as loaded."""
        return False

    def opd(self, drafter: Drafter, slots: OpdSlots, trains: bool) -> torch.Tensor | float:
        """This micro-batch's share of the family's Draft-OPD terms, weighted (`trains`: what `prepare` said)."""
        return 0.0

    def sft_objective(self, drafter: Drafter, slots: SftSlots, section: DrafterSection | None) -> torch.Tensor | None:
        """The family's own SFT objective in place of the cross-entropy, when its `section` asks for it (else
        None)."""
        return None

    def sft(self, drafter: Drafter, slots: SftSlots, selector_weight: float) -> torch.Tensor | float:
        """This micro-batch's share of the family's SFT terms, weighted."""
        return 0.0

    def sft_reads_target(self, section: DrafterSection | None) -> bool:
        """Whether the family's SFT objective, as its `section` chooses it, reads the target's distribution (its LM
        head's FLOPs count)."""
        return False


_TERMS: dict[str, FamilyTerms] = {}
_NONE = FamilyTerms()
_found: list[bool] = []  # set once every term module has been imported


def terms_for(kind: str) -> Callable[[type[FamilyTerms]], type[FamilyTerms]]:
    """Register a family's terms under its `models.drafter.kind`, in the family's term module."""

    def register(cls: type[FamilyTerms]) -> type[FamilyTerms]:
        _TERMS[kind] = cls()
        return cls

    return register


def terms_of(drafter: Drafter) -> FamilyTerms:
    """The terms of `drafter`'s family (none registered: the shared objectives alone)."""
    if not _found:
        _discover()
        _found.append(True)
    return _TERMS.get(drafter.kind, _NONE)


def _discover() -> None:
    """Import every module of this package, so each family's term module has registered itself."""
    import opd.distill as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
