"""What every spec section is, and what every drafter family's section answers.

A drafter family's section (`models.drafter`, told apart by `kind`) lives with the family's checkpoint format in
`opd/formats/`, beside the config.json it describes: its fields and defaults, how a config.json of the family is
recognised, which of its fields a warm checkpoint fixes, and which of the experiment's options the family cannot
train with. The schema puts the sections together as one discriminated union (`opd.formats.DrafterSpec`), so a
family's options are refused on another family by pydantic itself, and the experiment's rules ask the section,
never `kind ==`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError


class Section(BaseModel):
    """Base of every spec model: unknown keys are errors, because a typo must not silently fall back to a default;
    so are infinite and NaN floats (`.inf` is valid YAML), since no temperature, rate or weight means them."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def spec_issues(issues: list[str]) -> None:
    """Raise all cross-field problems of one model together, so a user fixes them in one pass."""
    if issues:
        raise PydanticCustomError("spec_issues", "{summary}", {"summary": "; ".join(issues), "issues": issues})


class DrafterSection(Section):
    """The fields every drafter family has; a family's section adds its own and says what it can train with."""

    kind: str
    num_layers: int | None = Field(None, ge=1, description="decoder layers; None = the family's default")
    block_size: int = Field(16, ge=2, description="K tokens per block, anchor included; K-1 are drafted")
    target_layer_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, description=(
        "None = the family's default for the target"))
    rope_theta: float | None = Field(None, gt=0, description=(
        "A fresh drafter's RoPE base where the target's config carries none (an attention without RoPE, as Kimi "
        "Linear's MLA layers); None = the target's. Public drafters use their target's (10000 for Llama 2, "
        "1000000 for Qwen3); a warm drafter brings its own."))
    max_position_embeddings: int | None = Field(None, ge=1, description=(
        "A fresh drafter's context length where the target's config states none (Kimi Linear); None = the "
        "target's."))
    intermediate_size: int | None = Field(None, ge=1, description=(
        "A fresh drafter's MLP width where the target's config states none (an MoE target such as Qwen3.5-122B, "
        "whose experts have their own); None = the target's."))

    # What the experiment's rules ask (opd/spec/rules.py): whether its drafts have a realized q to sample at T>0
    # (`serving.draft: sample`), whether its training takes random anchors and a top-k teacher, and whether it has
    # a candidate selector with a loss term of its own (`loss.selector_weight`). Options only one family has are
    # fields of its own section (DSpark's confidence_weight and sft_objective), refused on another by pydantic.
    # How a directory of this family in its own public layout (not speculators') is named when it is given where a
    # target belongs (`opd.model_dir.ModelDir.kind`): "DFlash" (z-lab's layout), "EAGLE" (SpecForge's).
    style: ClassVar[str]
    samples_from_q: ClassVar[bool] = True
    random_anchors: ClassVar[bool] = True
    topk_teacher: ClassVar[bool] = True
    has_selector: ClassVar[bool] = False

    @classmethod
    def detects(cls, config: dict[str, Any]) -> bool:
        """Whether a drafter's config.json is of this family."""
        raise NotImplementedError

    def default_layer_ids(self, target_num_layers: int) -> list[int]:
        """The target layers the family's public drafters read, for a target of this depth."""
        raise NotImplementedError

    def layer_id_issues(self, ids: list[int], origin: str) -> list[str]:
        """What is wrong with these resolved layer ids for this family (`origin` says where they came from)."""
        if not ids:
            return ["target_layer_ids: empty (expected at least one target layer id)"]
        if any(b <= a for a, b in zip(ids, ids[1:])):
            return [f"target_layer_ids: {ids}{origin} is not strictly increasing (expected distinct ids in "
                    "ascending order)"]
        return []

    def init_issues(self, warm: bool) -> list[str]:
        """What is wrong with this section for a warm (`warm`) or a random drafter."""
        return []

    def checkpoint_fields(self, config: dict[str, Any], layer_ids: list[int] | None) -> dict[str, tuple[Any, Any]]:
        """{field: (the spec's value, the warm checkpoint's)} for the fields a checkpoint fixes."""
        return {"block_size": (self.block_size, config.get("block_size"))}


_SECTIONS: list[type[DrafterSection]] = []


def drafter_section(cls: type[DrafterSection]) -> type[DrafterSection]:
    """Class decorator: a drafter family's spec section, and so its `kind`, made known to the spec's union and to
    checkpoint detection (opd/formats/__init__.py finds the format modules; no list names them)."""
    _SECTIONS.append(cls)
    return cls


def registered_sections() -> tuple[type[DrafterSection], ...]:
    """The sections registered so far, in the order their modules were imported."""
    return tuple(_SECTIONS)
