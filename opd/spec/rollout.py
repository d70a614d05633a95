"""The rollout section: how the training data is decoded, or where its target samples come from. The section is a
sampling setting itself (its temperature, top_p and top_k), the first of the settings its batches take in turn."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from opd.formats.section import spec_issues
from opd.spec.sampling import RolloutSampling, TargetSampling


class RolloutSpec(TargetSampling):
    """Target-assisted speculative decoding that produces the training data."""

    mode: Literal["draft_opd", "naive"] = Field("draft_opd", description=(
        "naive = train on committed tokens only (ablation)"))
    batch_size: int = Field(8, ge=1, description="prompts per rollout batch")
    max_new_tokens: int = Field(2048, ge=1)
    static_cache: bool = Field(False, description=(
        "Fixed-shape decoding (HF StaticCache, preallocated drafter cache, finished rows kept, each row's kept "
        "slots packed in place): the shapes a compiled decoding step needs (`SpeculativeDecoder(compiled=True)`, "
        "bench/decode_vs_zlab.py). Same tokens; caches of prompt + max_new_tokens + 2K columns per row. Held-out "
        "eval uses it too."))
    compile: bool = Field(False, description=(
        "torch.compile the decoding step (the draft and verify forwards, on the static cache; inductor): same "
        "tokens, fewer kernel launches per step, which decide a batch-1 step on a GPU. Needs static_cache; held-out "
        "eval too."))
    mix: list[RolloutSampling] = Field(default_factory=list, description=(
        "Rollout batch i decodes with setting i mod (1 + len(mix)): 0 is temperature/top_p/top_k above, then these. "
        "E.g. one greedy and one T=0.6 batch per step, so training sees the states both serving settings visit."))
    source: Literal["speculative", "target", "samples"] = Field("speculative", description=(
        "Where the target samples come from (docs/concepts.md, rollout sources). speculative: the paper's path, "
        "rollout actors decode with a drafter copy that adopts every broadcast and record its blocks. target: "
        "rollout actors only sample the target (`sampler`) and the scorer rebuilds the blocks with the newest "
        "drafter (opd/sources/rebuild.py), exact because drafts are point masses and decoding is lossless. samples: "
        "the same, from a file of stored target samples."))
    sampler: Literal["speculative", "autoregressive", "vllm"] = Field("speculative", description=(
        "source target: speculative = the speculative decoder with the warm drafter, never updated (lossless, the "
        "fastest on a CPU); autoregressive = plain batched decoding; vllm = vLLM's sampling (a GPU, the [gpu] "
        "extra)."))
    samples_path: str | None = Field(None, description=(
        "source samples: the file of `opd gen-samples` rows to read. source target: a cache, drawn into where it "
        "lacks a sample and shared by every run that names it (opd reproduce's arms of one seed), under a file "
        "lock."))

    @model_validator(mode="after")
    def _check(self) -> RolloutSpec:
        if self.source == "samples" and self.samples_path is None:
            spec_issues(["samples_path: none with source samples (expected the jsonl file `opd gen-samples` wrote)"])
        if self.compile and not self.static_cache:
            spec_issues(["compile: true without static_cache (a compiled step needs one shape per batch; expected "
                         "static_cache: true)"])
        if self.source == "speculative" and self.sampler != "speculative":
            spec_issues([f"sampler: {self.sampler} but source is speculative, which decodes with the drafter it "
                         "trains and samples with nothing else (expected source: target to sample the target with "
                         f"{self.sampler}, or no sampler)"])
        if self.source == "speculative" and self.samples_path is not None:
            spec_issues([f"samples_path: {self.samples_path} but source is speculative, which decodes its own "
                         "(expected source: samples or target, or no samples_path)"])
        return self

    @property
    def holds_target(self) -> bool:
        """Whether a rollout replica loads the target (and a drafter): not for stored samples or vLLM's own engine."""
        return self.source == "speculative" or (self.source == "target" and self.sampler != "vllm")

    @property
    def rebuilt(self) -> bool:
        """Whether the scorer rebuilds the blocks from target samples (any source but the speculative decoder)."""
        return self.source != "speculative"

    @property
    def settings(self) -> list[RolloutSampling]:
        """The batches' sampling settings in turn: this one, then `mix` (batch i uses i mod their count)."""
        own = RolloutSampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        return [own, *self.mix]
