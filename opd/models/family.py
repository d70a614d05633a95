"""What a drafter family does besides drafting: build a random drafter, load and check a checkpoint, serve it.

Decoding, replay, the rebuild and the losses only ever call the `Drafter` protocol (opd/models/protocol.py). Everything
that depends on which family a checkpoint or a spec is (a random initialisation's config, the tensors a checkpoint
must hold, the serving engine's speculative config, what a fresh drafter learns from SFT data) is a method of its
`DrafterFamily`, looked up by `kind` in opd/models/registry.py. The builders, the preflight, SFT and serving ask
the family; none of them tests `kind ==` or the drafter's class. The family's spec section and checkpoint format
live beneath, in opd/formats/.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

from opd.errors import OpdError
from opd.formats.checkpoint import TargetShape
from opd.formats.section import DrafterSection
from opd.model_dir import ModelDir
from opd.models.protocol import Drafter
from opd.models.shared_head import SharedHead
from opd.models.target import Target

Shapes = tuple[dict[str, tuple[int, ...]], Callable[[str], bool]]  # (tensor shapes, which names are the target's)
# Whose layout a family's `save_pretrained` writes: z-lab's DFlash layout, SpecForge's EAGLE-3 layout, or vLLM's
# `speculators` layout for a family published only in that.
PublicLayout = Literal["zlab", "specforge", "speculators"]


class DrafterFamily:
    """One drafter family; a subclass registers itself with `@drafter_family` under its section's `kind`
    (opd/models/registry.py finds it)."""

    section: ClassVar[type[DrafterSection]]  # its spec section (opd/formats/)
    public_layout: ClassVar[PublicLayout]  # whose layout `save_pretrained` writes (`opd export` names it)

    @property
    def kind(self) -> str:
        return str(self.section.model_fields["kind"].default)

    def initial(self, section: Any, base: Target | SharedHead, tokenizer: Any) -> Drafter:
        """The drafter a run starts from when it names no drafter checkpoint: freshly initialised for `base` (under
        the caller's seeded RNG) for most families, but the target's own trained head for MTP (`from_target`)."""
        raise NotImplementedError

    def load(self, directory: ModelDir, base: Target | SharedHead, section: Any) -> Drafter:
        """A checkpoint of this family for `base`; a mismatch is a one-line OpdError."""
        raise NotImplementedError

    def target_layer_ids(self, directory: ModelDir, num_target_layers: int) -> list[int]:
        """The target layers a checkpoint of this family reads, from its config.json alone: what its target is
        loaded with where no spec names them (`opd export`)."""
        raise NotImplementedError

    def check_initial(self, section: Any, tokenizer: Any, target: TargetShape) -> None:
        """What the initial drafter of `section` needs from the tokenizer and target, checked before any weights."""

    def expected_shapes(self, directory: ModelDir, target: TargetShape, section: Any) -> Shapes:
        """The tensors a checkpoint of this family for `target` holds, and which of its names are the target's
        (dropped on load), from its config.json alone."""
        raise NotImplementedError

    def served_block_size(self, directory: ModelDir, target: TargetShape | None, section: Any) -> int:
        """K of an exported drafter as a serving engine will run it, after checking that the engine can (and that
        it fits `target`, None when the target's directory is not at hand)."""
        raise NotImplementedError

    def vllm_config(self, directory: ModelDir, block_size: int) -> dict[str, Any]:
        """vLLM's `speculative_config` for an exported drafter: it drafts block_size - 1 tokens per step."""
        raise NotImplementedError

    def save_speculators(self, drafter: Drafter, directory: str | Path, verifier: str | None) -> None:
        """Export `drafter` in vLLM's `speculators` layout (opd/formats/speculators.py), naming the target at
        `verifier` (a path or hub id; None leaves the embedding and LM head for the user to attach), for a family
        whose own layout speculators cannot convert."""
        raise OpdError(f"models.drafter.kind: {self.kind} has no speculators export here (its public layout is "
                       "what speculators' converter reads)")

    def save_into_target(self, drafter: Drafter, target_dir: str | Path, directory: str | Path) -> Path:
        """Write `drafter` into a new `directory` in the target's own checkpoint layout, linking the target's files,
        for a family a target ships with (MTP heads); returns the directory."""
        raise OpdError(f"models.drafter.kind: {self.kind} is not part of a target's own checkpoint, so it has no "
                       "export into the target's layout")

    def unloadable(self, layout: str, target: ModelDir) -> str | None:
        """Why `layout`'s client cannot load this family's drafters for `target`, or None where it can: an export
        is refused, and no command suggests it, where its client would fail (a family whose client covers only
        some targets says so)."""
        return None

    @property
    def writes_speculators(self) -> bool:
        """Whether drafters of this family have a speculators export (`save_speculators`)."""
        return type(self).save_speculators is not DrafterFamily.save_speculators

    @property
    def lives_in_target(self) -> bool:
        """Whether drafters of this family are written into their target's checkpoint (`save_into_target`)."""
        return type(self).save_into_target is not DrafterFamily.save_into_target

    def fit_to_data(self, drafter: Drafter, token_counts: Any) -> None:
        """What a fresh drafter takes from its SFT data's response-token counts before training (nothing, unless
        the family says otherwise)."""


_REGISTERED: dict[str, DrafterFamily] = {}


def drafter_family(cls: type[DrafterFamily]) -> type[DrafterFamily]:
    """Class decorator: the family of its section's `kind`, found by opd/models/registry.py (no list names it)."""
    family = cls()
    _REGISTERED[family.kind] = family
    return cls


def registered_families() -> dict[str, DrafterFamily]:
    """The families registered so far, by kind."""
    return dict(_REGISTERED)
