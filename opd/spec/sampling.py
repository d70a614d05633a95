"""How the target is sampled: the settings that rollout (`rollout.mix`), evaluation (`eval.sampling`) and serving
(`serving`) name. The same rule applies in rollout and evaluation, so τ means the same thing in both."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from opd.formats.section import Section, spec_issues

Temperature = Annotated[float, Field(ge=0)]  # 0 = greedy
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = Annotated[int, Field(ge=0)]  # 0 = off


class RolloutSampling(Section):
    """A further target sampling setting for `rollout.mix`."""

    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0


class SamplingSpec(Section):
    """One named evaluation setting."""

    name: str
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    draft: Literal["argmax", "sample"] = Field("argmax", description=(
        "argmax: point-mass drafts, as DFlash's reference code and the serving engines draft; sample: drafts "
        "sampled from the drafter's q with this setting's processing, verified with the full min(1, p/q) rule "
        "(lossless too)."))

    @model_validator(mode="after")
    def _check(self) -> SamplingSpec:
        if self.draft == "sample" and self.temperature == 0:
            spec_issues(["draft: sample at temperature 0 (expected argmax; greedy verification takes the argmax)"])
        return self


class ServingSpec(Section):
    """The setting the drafter will be served in, part of the recipe: rollouts decode in it (rollout.temperature,
    top_p and top_k follow it), replay.teacher: served verifies as it does, and the acceptance objectives score it."""

    draft: Literal["argmax", "sample"] = Field("argmax", description=(
        "argmax: point-mass drafts, as the serving engines draft by default; sample: drafts sampled from the "
        "drafter's realized q and verified with min(1, p/q) (vLLM's probabilistic draft sampling, z-lab's "
        "dflash_generate at T>0)"))
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0

    @model_validator(mode="after")
    def _check(self) -> ServingSpec:
        if self.draft == "sample" and self.temperature == 0:
            spec_issues(["draft: sample at temperature 0 (expected argmax; greedy verification takes the argmax)"])
        return self

