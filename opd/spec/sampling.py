"""How the target is sampled: one type for the setting that rollout, evaluation and serving each name.

A setting is temperature, top_p and top_k, declared once here, so that the rule which applies them is the same in
rollout and evaluation and τ means the same thing in both; `opd.decoding.sampling.Sampling.of` turns any of them
into the decoder's. The settings that also say how drafts are made (an eval setting, the serving mode) check
that choice once, in `DraftedSampling`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from opd.formats.section import Section, spec_issues

Temperature = Annotated[float, Field(ge=0)]  # 0 = greedy
Draft = Literal["argmax", "sample"]


class TargetSampling(Section):
    """How the target's distribution is shaped: what every sampling setting of the spec holds."""

    temperature: Temperature = 0.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # 0 = off


class RolloutSampling(TargetSampling):
    """A further target sampling setting for `rollout.mix`."""


class DraftedSampling(TargetSampling):
    """A target sampling setting that also says how drafts are made: point masses (argmax), or samples from the
    drafter's q, which need a sampling target (greedy verification takes the argmax)."""

    draft: Draft = "argmax"

    @model_validator(mode="after")
    def _sampled_drafts_need_a_temperature(self) -> DraftedSampling:
        if self.draft == "sample" and self.temperature == 0:
            spec_issues(["draft: sample at temperature 0 (expected argmax; greedy verification takes the argmax)"])
        return self


class SamplingSpec(DraftedSampling):
    """One named evaluation setting."""

    name: str
    draft: Draft = Field("argmax", description=(
        "argmax: point-mass drafts, as DFlash's reference code and the serving engines draft; sample: drafts "
        "sampled from the drafter's q with this setting's processing, verified with the full min(1, p/q) rule "
        "(lossless too)."))


class ServingSpec(DraftedSampling):
    """The setting the drafter will be served in, part of the recipe: rollouts decode in it (rollout.temperature,
    top_p and top_k follow it), replay.teacher: served verifies as it does, and the acceptance objectives score it."""

    draft: Draft = Field("argmax", description=(
        "argmax: point-mass drafts, as the serving engines draft by default; sample: drafts sampled from the "
        "drafter's realized q and verified with min(1, p/q) (vLLM's probabilistic draft sampling, z-lab's "
        "dflash_generate at T>0)"))
