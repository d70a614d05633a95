"""DSpark checkpoints (arXiv 2607.05147) in vLLM's `speculators` layout: `config.json` <-> `DSparkConfig`, and the
`models.drafter` section of kind `dspark`.

DSpark is a DFlash backbone with two heads (speculators' `DSparkDraftModel`, 0.9.0): a low-rank Markov head that
adds `markov_w2(markov_w1[x])` to a slot's logits, x the block token before the slot's prediction, and a confidence
head `proj([h; markov_w1[x]])` (a logit of the slot's acceptance). Its published form samples from the anchor
(`sample_from_anchor: true`, DeepSpec's convention): a block of speculators' `block_size` slots [anchor, MASK...]
drafts that many tokens, slot j's output predicting the token after position anchor + j. This project counts K with
the anchor, as for every family, so a DSpark drafter of K here is speculators' `block_size` K - 1 and vLLM's
`num_speculative_tokens` K - 1: its layers run K - 1 tokens per block, and draft j is slot j - 1's.

The checkpoint is speculators' layout (opd/formats/speculators.py) with the DFlash backbone's tensors and
`markov_head.markov_w1.weight` [V, r], `markov_head.markov_w2.weight` [V, r] and `confidence_head.proj.{weight,
bias}`. Refused, in one line naming the field: an anchor slot that does not draft (`sample_from_anchor: false`),
the `gated` and `rnn` Markov heads, no Markov head (`markov_rank: 0`), and what the DFlash backbone refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from pydantic import Field

from opd.errors import OpdError
from opd.formats.dflash import DFlashConfig, DFlashSpec
from opd.formats.section import drafter_section
from opd.formats.speculators import backbone_public, dflash_speculators, model_type

KIND = "dspark"
ARCHITECTURE = "DSparkDraftModel"
DEFAULT_RANK = 256  # DSparkSpeculatorConfig's markov_rank


def is_dspark(config: dict[str, Any]) -> bool:
    """Whether a drafter's config.json describes a DSpark drafter."""
    return model_type(config) == KIND or ARCHITECTURE in (config.get("architectures") or [])


@drafter_section
class DSparkSpec(DFlashSpec):
    """kind dspark: a DFlash drafter whose Markov head chains the block's drafts (speculators' `DSparkDraftModel`,
    opd/models/dspark.py). A random one takes `markov_rank`; a warm one brings its own."""

    kind: Literal["dspark"] = "dspark"  # type: ignore[assignment]  # the union's tag: each family its own
    markov_rank: int | None = Field(None, ge=1)  # None = speculators' 256 for a random drafter
    confidence_weight: float = Field(0.0, ge=0, description=(
        "Draft-OPD: weight of its confidence head's binary cross-entropy against the rollout's realized acceptance "
        "(1 at the accepted slots, 0 at the first rejected one; later slots were never verified), a mean over the "
        "step's verified slots (opd/distill/confidence_loss.py). 0 = off, the head left as it is."))
    sft_objective: Literal["ce", "dspark"] = Field("ce", description=(
        "What SFT's slots train towards. ce: the cross-entropy every DFlash drafter takes (sft.gamma's weights). "
        "dspark: DSpark's published objective (arXiv 2607.05147, opd/distill/dspark_loss.py), on the same weights: "
        "0.1 x cross-entropy + 0.9 x ||p - q||_1 to the target's distribution + the confidence head's binary "
        "cross-entropy against the slot's acceptance 1 - ||p - q||_1 / 2."))

    # Random-anchor blocks are drafted slot by slot independently (opd/distill/anchors.py), which a Markov chain
    # is not.
    random_anchors: ClassVar[bool] = False

    @classmethod
    def detects(cls, config: dict[str, Any]) -> bool:
        return is_dspark(config)

    def init_issues(self, warm: bool) -> list[str]:
        if warm and self.markov_rank is not None:
            return ["markov_rank: set, but a warm DSpark drafter brings its own (expected it unset)"]
        return []

    def checkpoint_fields(self, config: dict[str, Any], layer_ids: list[int] | None) -> dict[str, tuple[Any, Any]]:
        return super().checkpoint_fields(dspark_public(config, None), layer_ids)


@dataclass
class DSparkConfig(DFlashConfig):
    """A DFlash backbone of K - 1 drafting slots (`block_size` K, the anchor included) and DSpark's heads."""

    markov_rank: int = DEFAULT_RANK
    confidence_head: bool = True  # speculators' enable_confidence_head
    confidence_with_markov: bool = True  # the confidence head also reads markov_w1[x]

    @property
    def confidence_width(self) -> int:
        """The confidence head's input: the slot's hidden, and its Markov embedding when it reads it."""
        return self.hidden_size + (self.markov_rank if self.confidence_with_markov else 0)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], num_target_layers: int | None = None) -> DSparkConfig:
        """Read speculators' DSpark config.json for a target of `num_target_layers` (which it does not record)."""
        backbone = DFlashConfig.from_hf_dict(dspark_public(hf, num_target_layers))
        rank = hf.get("markov_rank", DEFAULT_RANK)
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise OpdError(f"config field 'markov_rank' is {rank!r} (expected a positive integer: a DSpark drafter "
                           "without its Markov head is a DFlash drafter)")
        return cls(**{f.name: getattr(backbone, f.name) for f in fields(DFlashConfig)}, markov_rank=rank,
                   confidence_head=bool(hf.get("enable_confidence_head", True)),
                   confidence_with_markov=bool(hf.get("confidence_head_with_markov", True)))

    def to_speculators_dict(self, verifier: str | None = None,
                            verifier_architectures: list[str] | None = None) -> dict[str, Any]:
        """speculators' DSpark config.json: the backbone's, with its block of K - 1 drafting slots and the
        heads' fields."""
        out = dflash_speculators(self.to_hf_dict(), verifier, verifier_architectures or [], KIND)
        out["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = self.block_size - 1
        return out | {"architectures": [ARCHITECTURE], "block_size": self.block_size - 1, "sample_from_anchor": True,
                      "markov_rank": self.markov_rank, "markov_head_type": "vanilla",
                      "enable_confidence_head": self.confidence_head,
                      "confidence_head_with_markov": self.confidence_with_markov}


def dspark_public(hf: dict[str, Any], num_target_layers: int | None) -> dict[str, Any]:
    """The public DFlash config.json of a DSpark config's backbone, its block counted with the anchor."""
    if model_type(hf) != KIND:
        raise OpdError(f"config field 'speculators_model_type' is {model_type(hf)!r} (expected '{KIND}': DSpark "
                       "drafters are read in speculators' layout)")
    if hf.get("sample_from_anchor") is False:
        raise OpdError("config field 'sample_from_anchor' is false (expected true: DSpark's anchor slot drafts, "
                       "as its published drafters do)")
    if hf.get("markov_head_type", "vanilla") != "vanilla":
        raise OpdError(f"config field 'markov_head_type' is {hf['markov_head_type']!r} (expected 'vanilla', the "
                       "first-order Markov head)")
    block = hf.get("block_size")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise OpdError(f"config field 'block_size' is {block!r} (expected a positive integer)")
    return backbone_public(hf, block + 1, num_target_layers)
