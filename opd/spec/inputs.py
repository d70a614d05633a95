"""What a run reads: the target, tokenizer and drafter (`models`) and the prompt pools (`data`).

Validation here reads no file: what the files say (the target's depth, the prompt pool's size, the warm drafter)
is filled in or checked once, in the driver, by `opd.spec.resolve`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from opd.formats import KINDS, DrafterSpec
from opd.formats.dflash import DFlashSpec
from opd.formats.section import Section, spec_issues

DEFAULT_SECTION = DFlashSpec  # the drafter section a spec without `models.drafter.kind` describes

class ModelsSpec(Section):
    """Where the target, tokenizer and warm drafter live, and how to load them."""

    target_path: str
    drafter_path: str | None = Field(None, description="warm drafter in its family's public format; None = random init")
    tokenizer_path: str | None = Field(None, description="None = target_path")
    target_num_layers: int | None = Field(None, ge=1, description="filled from target_path/config.json when it exists")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = Field(None, description=(
        "None = what transformers picks for the model (sdpa where the model has it; gpt-oss: eager); a choice the "
        "model does not support is refused in one line when the target loads"))
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "auto: the GPU Ray gave this actor, else the CPU"))
    drafter: DrafterSpec = Field(default_factory=DEFAULT_SECTION, description=(
        f"The drafter's family (`kind`: {', '.join(KINDS)}; unset: the warm drafter's, else dflash) and its options"))

    @property
    def tokenizer(self) -> str:
        """The tokenizer directory actually used."""
        return self.tokenizer_path or self.target_path

    @property
    def warm(self) -> bool:
        """Whether the drafter is loaded from a checkpoint (not randomly initialised)."""
        return self.warm_path is not None

    @property
    def warm_path(self) -> str | None:
        """The warm drafter's checkpoint; None when the drafter is randomly initialised (`drafter_path` None or
        random), so a caller that checks it holds the path typed."""
        return None if self.drafter_path in (None, "random") else self.drafter_path

    @property
    def layer_ids(self) -> list[int] | None:
        """The target layers whose hidden states feed the drafter: `drafter.target_layer_ids`, else the family's
        default for the target; None while the target's depth is unknown."""
        if self.drafter.target_layer_ids is not None:
            return list(self.drafter.target_layer_ids)
        if self.target_num_layers is None:
            return None
        return self.drafter.default_layer_ids(self.target_num_layers)

    @model_validator(mode="before")
    @classmethod
    def _default_kind(cls, data: Any) -> Any:
        """A drafter section without `kind` is the default family's (resolution first fills a warm drafter's own)."""
        drafter = data.get("drafter") if isinstance(data, dict) else None
        if isinstance(drafter, dict) and "kind" not in drafter:
            data = {**data, "drafter": {**drafter, "kind": DEFAULT_SECTION.model_fields["kind"].default}}
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelsSpec:
        issues = [f"drafter.{issue}" for issue in self.drafter.init_issues(self.warm)]
        spec_issues(issues + self._check_layer_ids())
        return self

    def _check_layer_ids(self) -> list[str]:
        ids, depth = self.layer_ids, self.target_num_layers
        if ids is None:
            return []
        origin = "" if self.drafter.target_layer_ids else f" (the default for a {depth}-layer target)"
        issues = self.drafter.layer_id_issues(ids, origin)
        if not issues and depth is not None and max(ids) >= depth:
            issues = [f"target_layer_ids: layer {max(ids)}{origin} is outside the target (expected ids in "
                      f"[0, {depth}), target_num_layers = {depth})"]
        return [f"drafter.{issue}" for issue in issues]


class DataSpec(Section):
    """Prompt pools (jsonl, one `prompt` or chat `messages` per line) and how a row becomes the target's ids."""

    train_prompts: str
    eval_prompts: str
    max_prompt_tokens: int = Field(1024, ge=1, description="checked on the rendered prompt, template included")
    skip_bad_lines: bool = Field(False, description="True = count and skip malformed jsonl lines instead of failing")
    render: Literal["raw", "chat"] = Field("raw", description=(
        "raw = the prompt text as is (the tiny target, trained without a template); chat = the target tokenizer's "
        "apply_chat_template(messages, add_generation_prompt=True), what a served chat model always sees."))
    enable_thinking: bool | None = Field(None, description=(
        "Passed to the chat template (Qwen3's thinking switch): false adds an empty think block to the generation "
        "prompt, true thinks; null = the template's default (Qwen3 thinks). Responses keep the thinking whole."))
    reasoning_effort: Literal["low", "medium", "high", "xhigh"] | None = Field(None, description=(
        "The reasoning level of templates that take one instead of on/off (gpt-oss's `reasoning_effort`, or "
        "`reasoning_strength` where the template reads that; opd/data/render.py); null = the template's default."))
    train_pool_size: int | None = Field(None, ge=1, description=(
        "Prompts in train_prompts (its non-blank lines), which a run length in `epochs` is counted over: read from "
        "the file when it exists, else as written (so `opd validate --no-path-check` can size a cluster run); a "
        "written value must agree with the file, or the epochs would silently mean another number of rollout "
        "batches."))

    @model_validator(mode="after")
    def _check(self) -> DataSpec:
        issues = []
        if self.render == "raw" and self.enable_thinking is not None:
            issues.append(f"enable_thinking: {str(self.enable_thinking).lower()} but render is raw, which has no "
                          "template to pass it to (expected render: chat, or enable_thinking: null)")
        if self.render == "raw" and self.reasoning_effort is not None:
            issues.append(f"reasoning_effort: {self.reasoning_effort} but render is raw, which has no template to "
                          "pass it to (expected render: chat, or reasoning_effort: null)")
        spec_issues(issues)
        return self
