"""The drafter interface: what decoding, the rebuild, replay, the learner and SFT call on any drafter.

Every registered family implements it (opd/models/registry.py), in one file of its own: DFlash's block of K-1
drafts in one forward (opd/models/dflash.py) and its chained variants (DFlash 2's selector, DSpark's Markov head),
EAGLE-3's chain of argmax steps and P-EAGLE's parallel one. All draft point masses, so the rebuild
(opd/sources/rebuild.py) and replay hold for each. A drafter whose q at a slot depends on the draft before it
(`chains_q`) is a `ChainedDrafter` too: its sampled drafts and the law they are sampled from come through that
protocol, asked with `chains`, never by family. What differs by family outside drafting (building, checkpoints,
serving) is its `DrafterFamily` (opd/models/family.py), and what it adds to training its `FamilyTerms`
(opd/distill/family_terms.py), both looked up by kind.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeGuard

import torch
from torch import nn

from opd.models.drafter_cache import DrafterCache


class Drafter(Protocol):
    """A drafter on the target's frozen embedding (and, for DFlash, its LM head)."""

    kind: str  # its family's `models.drafter.kind`: what its family's own training terms are registered under

    sft_target: str  # what SFT teaches: "data" tokens, or the "target"'s distribution at the same slots
    # Whether q at a slot depends on the draft sampled at the slot before (DFlash 2's selector): its sampled drafts
    # (`draft: sample`) then come from `draft_path` (a `ChainedDrafter`), not from the logits `draft` returns.
    chains_q: bool
    # Whether `extend_cache` reads the token after each position (EAGLE-3's columns pair them with the features);
    # the decoder forms them only then.
    reads_next_ids: bool

    @property
    def config(self) -> object:
        """The family's config (what `save_pretrained` writes as config.json)."""

    @property
    def block_size(self) -> int:
        """K: the anchor and K-1 drafts."""

    @property
    def tokens_per_block(self) -> int:
        """Tokens a block runs through the drafter's layers (FLOP counting)."""

    @property
    def student_head(self) -> nn.Module:
        """Hidden -> the drafter's logits over its vocabulary (the loss applies it chunk by chunk)."""

    @property
    def teacher_head(self) -> nn.Module:
        """The target's final-norm hidden -> its logits over the drafter's vocabulary."""

    def trainable_slots(self, teacher: torch.Tensor) -> torch.Tensor | None:
        """Bool [N, K-1] of the slots the drafter can learn (None: all)."""

    def modules_by_role(self) -> tuple[list[nn.Module], list[nn.Module], nn.Linear]:
        """(per context position, per block token, the head per slot), for FLOP counting."""

    def extra_flops(self) -> tuple[int, int]:
        """(FLOPs per block token, per drafted slot) that no weight a token passes through accounts for (DFlash 2's
        convolution taps and candidate selector)."""

    def new_cache(self, batch_size: int, capacity: int | None = None) -> DrafterCache: ...

    def extend_cache(self, cache: DrafterCache, target_features: torch.Tensor, positions: torch.Tensor,
                     valid: torch.Tensor, next_ids: torch.Tensor | None = None) -> None:
        """Add verified context: features [B,T,n*H] at positions [B,T], and the token after each."""

    def defer_context(self, cache: DrafterCache, target_features: torch.Tensor, positions: torch.Tensor,
                      valid: torch.Tensor, next_ids: torch.Tensor | None = None) -> None:
        """`extend_cache` as the decoder calls it after each step: a family may leave the work to the next draft
        (`DrafterCache.defer`; DFlash's families fold it into the block's forward) or do it now (EAGLE-3)."""

    def commit_context(self, cache: DrafterCache) -> None:
        """Do now whatever `defer_context` left for the next draft (before rows leave the batch)."""

    def draft(self, cache: DrafterCache, anchor_ids: torch.Tensor,
              anchor_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Point-mass drafts [B,K-1] (target ids: the argmax, or DFlash 2's selector path) and logits [B,K-1,V]
        over the target vocabulary."""

    def block_hidden(self, features: torch.Tensor, context_ids: torch.Tensor, context_valid: torch.Tensor,
                     anchor_positions: torch.Tensor, block_inputs: torch.Tensor) -> torch.Tensor:
        """Training: final hidden [B,M,K-1,H] at the drafted slots; block_inputs [B,M,K-1] are the anchor and the
        tokens a chain is fed."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def save_pretrained(self, directory: str | Path) -> None: ...

    def parameters(self): ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def train(self, mode: bool = True) -> object:
        """Training mode (`mode`) or evaluation mode: every family is an nn.Module."""

    def eval(self) -> object: ...


class ChainedDrafter(Drafter, Protocol):
    """A drafter whose q at a slot depends on the draft chosen at the slot before (`chains_q`: DFlash 2, DSpark)."""

    @property
    def selector(self) -> nn.Module:
        """What chains the slots: DFlash 2's candidate selector (its own loss term, opd/distill/selector_loss.py)."""

    def draft_law(self, hidden: torch.Tensor, logits: torch.Tensor, predecessors: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The law the serving decoder samples each slot's draft from, differentiably, given the token sampled
        before it: (probabilities [..., k], the k token ids they are over, or None when over the whole vocabulary
        in order). hidden [..., H] and logits [..., V] of the slots, predecessors [...]."""

    def draft_path(self, cache: DrafterCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor,
                   pick: Callable[[int, torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(drafts [B,K-1], candidates [B,K-1,k]) of one block per sequence, slot k's candidate chosen by
        `pick(k, scores [B,k])` given the draft before it; candidates None when every slot scores the whole
        vocabulary in order (DSpark's Markov head), so `pick` returns token ids."""


def chains(drafter: Drafter) -> TypeGuard[ChainedDrafter]:
    """Whether `drafter` chains its slots, so that its sampled drafts come from `draft_path`."""
    return drafter.chains_q


def clone_drafter(drafter: Drafter) -> Drafter:
    """A separate drafter with the same weights on the same shared target modules (a rollout's or an
    evaluator's copy): both families keep those as `_shared`, outside their parameters."""
    module: Any = drafter  # an nn.Module of its family's class, constructed as (config, *shared)
    clone = type(module)(module.config, *module._shared).to(next(module.parameters()).device)
    clone.load_state_dict(module.state_dict())
    return clone
