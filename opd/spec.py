"""Experiment specs: one validated pydantic tree for everything a run needs.

A bad spec must fail in `opd validate` (or the first second of `opd train`), never hours into a cluster job,
so every field is typed and bounded, unknown keys are rejected, and the cross-field rules that would otherwise
surface late (layer ids beyond the target, roles that can never be scheduled, batches that do not divide) are
checked up front. Defaults are the Draft-OPD paper's settings (16-token blocks, 5 drafter layers, mixed KL with
γ = 0.8, lr 3e-4 with cosine decay).

Loading (`load_spec`):
- YAML in; a file may name `base: other.yaml` (relative to that file). Mappings deep-merge, the child wins,
  lists and scalars are replaced; chains are allowed and cycles are reported. `base: [a.yaml, b.yaml]` merges
  them in order, so a preset (configs/presets/) can be layered on any experiment.
- `--set a.b=c` overrides are applied after inheritance; the value is parsed as YAML, so `optim.lr=1e-4`,
  `loss.rejected_decay=false` and `resources.rollout.replicas=2` arrive typed.
- Relative model and data paths are kept as written and resolved against the current working directory when
  used; the shipped configs use paths relative to the repository root, so run `opd` from there.
- Every problem becomes one line `field.path: what is wrong (what is expected)` inside a `SpecError`.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from opd.errors import OpdError


class SpecError(OpdError):
    """A spec that cannot be used; carries one line per problem so the CLI can print them all at once."""

    def __init__(self, messages: Sequence[str]):
        self.messages = list(messages)
        super().__init__("\n".join(self.messages))


def _issues(issues: list[str]) -> None:
    """Raise all cross-field problems of one model together, so a user fixes them in one pass."""
    if issues:
        raise PydanticCustomError("spec_issues", "{summary}", {"summary": "; ".join(issues), "issues": issues})


def _num(x: float) -> str:
    """Format a resource amount without a spurious `.0`."""
    return f"{x:g}"


def _whole_updates(updates: float) -> int:
    """A run length in (fractional) updates, rounded up to whole ones and never below one: a tiny `epochs` still
    trains, and the resolved `steps` it fills in loads again. Rounded to 9 places first, so float noise such as
    7 x 16,000 / 210 computed inexactly does not add an update."""
    return max(1, math.ceil(round(updates, 9)))


class _Section(BaseModel):
    """Base of every spec model: unknown keys are errors, because a typo must not silently fall back to a default;
    so are infinite and NaN floats (`.inf` is valid YAML), since no temperature, rate or weight means them."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# ---------------------------------------------------------------------------------------------------- models


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default feature layers: spread from layer 1 to L-3 (n = 1: the middle), as public drafters use.

    Python's round (half to even) on purpose: the public code does the same, so ids match bit for bit.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def default_eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """The engines' EAGLE-3 capture, the states entering layers 2, L//2 and L-3, as this project's ids (output of
    decoder layer i = entering i+1): [1, L//2-1, L-4], SpecForge's numbers. They may repeat on a shallow target."""
    return [1, num_target_layers // 2 - 1, num_target_layers - 4]


DFLASH2_SPEC_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


class DrafterSpec(_Section):
    """Architecture of the drafter; must match a warm drafter checkpoint when one is given.

    kind dflash: a block of K-1 drafts per forward (DFlash). kind eagle3: one layer drafting a chain of K-1
    argmax steps over its own draft vocabulary (EAGLE-3, the public SpecForge format)."""

    kind: Literal["dflash", "eagle3"] = "dflash"
    num_layers: int | None = Field(None, ge=1)  # decoder layers; None = 5 for DFlash, EAGLE-3's one
    block_size: int = Field(16, ge=2)  # K tokens per block, anchor included; K-1 are drafted
    target_layer_ids: list[Annotated[int, Field(ge=0)]] | None = None  # None = the family's default for the target
    mask_token_id: int | None = Field(None, ge=0)  # DFlash: None = the tokenizer's mask token
    draft_vocab_size: int | None = Field(None, ge=1)  # EAGLE-3: None = min(32000, the target's vocabulary)
    # EAGLE-3 draft tree width (SGLang's --speculative-eagle-topk). Only 1, a chain, drafts point masses, which
    # lossless rebuild and replay need.
    tree_topk: int = Field(1, ge=1)
    # A random DFlash 2 drafter (dflash_config's names, opd/models/dflash2.py): all four, or none for DFlash 1. A warm
    # drafter brings its own; these must then be unset.
    conv_kernel_size: int | None = Field(None, ge=1)
    conv_group_size: int | None = Field(None, ge=1)
    selector_rank: int | None = Field(None, ge=1)
    selector_top_k: int | None = Field(None, ge=1)

    @property
    def dflash2(self) -> dict[str, int] | None:
        """The DFlash 2 fields of a random drafter, or None."""
        fields = {name: getattr(self, name) for name in DFLASH2_SPEC_FIELDS}
        return fields if self.selector_rank is not None else None

    @model_validator(mode="after")
    def _check(self) -> DrafterSpec:
        """Options of the other family are refused by value (a resolved spec is re-validated in every actor)."""
        if self.kind == "eagle3":
            wrong = [] if self.mask_token_id is None else [
                f"mask_token_id: {self.mask_token_id} on an eagle3 drafter (a DFlash-only option; expected null)"]
            if self.num_layers not in (None, 1):
                wrong.append(f"num_layers: {self.num_layers} on an eagle3 drafter (EAGLE-3 drafts with one layer; "
                             "expected 1 or unset)")
            if self.tree_topk > 1:
                wrong.append(f"tree_topk: {self.tree_topk} is a draft tree (expected 1: only chains draft point "
                             "masses, which rebuild and replay need)")
        else:
            wrong = [f"{name}: {value} on a dflash drafter (an EAGLE-3-only option; expected kind: eagle3)"
                     for name, value in (("draft_vocab_size", self.draft_vocab_size), ("tree_topk", self.tree_topk))
                     if value not in (None, 1)]
        given = [name for name in DFLASH2_SPEC_FIELDS if getattr(self, name) is not None]
        if self.kind == "eagle3" and given:
            wrong.append(f"{given[0]}: on an eagle3 drafter (a DFlash 2 option; expected kind: dflash)")
        elif given and len(given) < len(DFLASH2_SPEC_FIELDS):
            missing = next(name for name in DFLASH2_SPEC_FIELDS if name not in given)
            wrong.append(f"{missing}: missing (a DFlash 2 drafter takes all of {', '.join(DFLASH2_SPEC_FIELDS)})")
        _issues([f"drafter.{w}" for w in wrong])
        if self.num_layers is None:
            self.num_layers = 1 if self.kind == "eagle3" else 5
        return self

    def resolved_layer_ids(self, target_num_layers: int | None) -> list[int] | None:
        """The target layers whose hidden states feed the drafter; None while the target depth is unknown."""
        if self.target_layer_ids is not None:
            return list(self.target_layer_ids)
        if target_num_layers is None:
            return None
        if self.kind == "eagle3":
            return default_eagle3_layer_ids(target_num_layers)
        return default_target_layer_ids(target_num_layers, self.num_layers)


def _read_json(path: Path) -> dict[str, Any] | None:
    """A checkpoint's config.json, or None when absent or unreadable (check_paths reports missing dirs).

    Read once per process while the file is unchanged (keyed by resolved path, inode, mtime and size): a spec is
    validated several times per actor, and the file may sit on a slow shared filesystem.
    """
    try:
        resolved = path.resolve()
        stat = resolved.stat()
    except (OSError, RuntimeError):
        return None
    data = _read_json_once(resolved, stat.st_ino, stat.st_mtime_ns, stat.st_size)
    return copy.deepcopy(data)  # callers get their own copy; the cached one stays as read


@functools.lru_cache(maxsize=64)
def _read_json_once(path: Path, inode: int, mtime_ns: int, size: int) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class ModelsSpec(_Section):
    """Where the target, tokenizer and warm drafter live, and how to load them."""

    target_path: str
    drafter_path: str | None = None  # warm drafter in DFlash format; None = random init
    tokenizer_path: str | None = None  # None = target_path
    target_num_layers: int | None = Field(None, ge=1)  # read from target_path/config.json when it exists
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: the GPU Ray gave this actor, else the CPU
    drafter: DrafterSpec = Field(default_factory=DrafterSpec)

    @property
    def tokenizer(self) -> str:
        """The tokenizer directory actually used."""
        return self.tokenizer_path or self.target_path

    @property
    def layer_ids(self) -> list[int] | None:
        """Resolved `drafter.target_layer_ids`."""
        return self.drafter.resolved_layer_ids(self.target_num_layers)

    @model_validator(mode="after")
    def _check(self) -> ModelsSpec:
        issues = self._take_target_depth()
        issues += self._check_layer_ids()
        issues += self._check_warm_drafter()
        _issues(issues)
        return self

    def _take_target_depth(self) -> list[str]:
        """Fill or cross-check the target depth from the checkpoint, so layer ids are checked against the truth."""
        config = _read_json(Path(self.target_path) / "config.json")
        depth = (config or {}).get("num_hidden_layers")
        if not isinstance(depth, int):
            return []
        if self.target_num_layers is None:
            self.target_num_layers = depth
        elif self.target_num_layers != depth:
            return [f"target_num_layers: {self.target_num_layers} disagrees with num_hidden_layers {depth} in "
                    f"{self.target_path}/config.json (expected {depth} or unset)"]
        return []

    def _check_layer_ids(self) -> list[str]:
        ids, depth = self.layer_ids, self.target_num_layers
        path = "drafter.target_layer_ids"
        if ids is None:
            return []
        origin = "" if self.drafter.target_layer_ids else f" (the default for a {depth}-layer target)"
        if self.drafter.kind == "eagle3":
            if len(ids) != 3:
                return [f"{path}: {ids} (expected 3 ids: EAGLE-3's fc fuses three target layers)"]
        elif not ids:
            return [f"{path}: empty (expected at least one target layer id)"]
        elif any(b <= a for a, b in zip(ids, ids[1:])):
            return [f"{path}: {ids}{origin} is not strictly increasing (expected distinct ids in ascending order)"]
        if depth is not None and max(ids) >= depth:
            return [f"{path}: layer {max(ids)}{origin} is outside the target (expected ids in [0, {depth}), "
                    f"target_num_layers = {depth})"]
        return []

    def _check_warm_drafter(self) -> list[str]:
        """A warm drafter's checkpoint fixes its architecture; the spec must describe the same drafter."""
        if self.drafter_path is None:
            return []
        if self.drafter_path != "random" and self.drafter.dflash2:
            return [f"drafter.selector_rank: set for a random DFlash 2 drafter, but drafter_path is "
                    f"{self.drafter_path}, which brings its own (expected the four DFlash 2 fields unset)"]
        config = _read_json(Path(self.drafter_path) / "config.json")
        if config is None:
            return []
        kind = "eagle3" if "eagle3" in " ".join(config.get("architectures") or []).lower() else "dflash"
        if kind != self.drafter.kind:
            return [f"drafter.kind: {self.drafter.kind} but {self.drafter_path}/config.json is a {kind} drafter "
                    f"(expected kind: {kind})"]
        if kind == "eagle3":
            found = {"block_size": config.get("block_size"), "draft_vocab_size": config.get("draft_vocab_size")}
            ours = {"block_size": self.drafter.block_size, "draft_vocab_size": self.drafter.draft_vocab_size}
        else:
            dflash = config.get("dflash_config") or {}  # read first, then the top level, as z-lab's code does
            found = {"block_size": dflash.get("block_size", config.get("block_size")),
                     "num_layers": config.get("num_hidden_layers"),
                     "target_layer_ids": dflash.get("target_layer_ids", config.get("target_layer_ids")),
                     "mask_token_id": dflash.get("mask_token_id", config.get("mask_token_id"))}
            ours = {"block_size": self.drafter.block_size, "num_layers": self.drafter.num_layers,
                    "target_layer_ids": self.layer_ids, "mask_token_id": self.drafter.mask_token_id}
        return [f"drafter.{key}: {ours[key]} disagrees with the warm drafter's {found[key]} in "
                f"{self.drafter_path}/config.json (expected {found[key]})"
                for key in found if found[key] is not None and ours[key] is not None and found[key] != ours[key]]


# ------------------------------------------------------------------------------------------ data and decoding


class DataSpec(_Section):
    """Prompt pools (jsonl, one `prompt` or chat `messages` per line) and how a row becomes the target's ids."""

    train_prompts: str
    eval_prompts: str
    max_prompt_tokens: int = Field(1024, ge=1)  # checked on the rendered prompt, template included
    skip_bad_lines: bool = False  # True = count and skip malformed jsonl lines instead of failing
    # raw = the prompt text as is (the tiny target, trained without a template); chat = the target tokenizer's
    # apply_chat_template(messages, add_generation_prompt=True), what a served chat model always sees.
    render: Literal["raw", "chat"] = "raw"
    # Passed to the chat template (Qwen3's thinking switch): false adds an empty think block to the generation
    # prompt, true thinks; null = the template's default (Qwen3 thinks). Responses keep the thinking whole.
    enable_thinking: bool | None = None
    # The reasoning level of templates that take one instead of on/off (gpt-oss's `reasoning_effort`, or
    # `reasoning_strength` where the template reads that; opd/data/render.py); null = the template's default.
    reasoning_effort: Literal["low", "medium", "high", "xhigh"] | None = None
    # Prompts in train_prompts (its non-blank lines), which a run length in `epochs` is counted over: read from the
    # file when it exists, else as written (so `opd validate --no-path-check` can size a cluster run); a written
    # value must agree with the file, or the epochs would silently mean another number of rollout batches.
    train_pool_size: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> DataSpec:
        issues = []
        if self.render == "raw" and self.enable_thinking is not None:
            issues.append(f"enable_thinking: {str(self.enable_thinking).lower()} but render is raw, which has no "
                          "template to pass it to (expected render: chat, or enable_thinking: null)")
        if self.render == "raw" and self.reasoning_effort is not None:
            issues.append(f"reasoning_effort: {self.reasoning_effort} but render is raw, which has no template to "
                          "pass it to (expected render: chat, or reasoning_effort: null)")
        lines = _count_lines(Path(self.train_prompts))
        if lines is not None and self.train_pool_size is None:
            self.train_pool_size = lines
        elif lines is not None and self.train_pool_size != lines:
            issues.append(f"train_pool_size: {self.train_pool_size} disagrees with the {lines} prompts in "
                          f"{self.train_prompts} (expected {lines} or unset)")
        _issues(issues)
        return self


def _count_lines(path: Path) -> int | None:
    """Non-blank lines of a prompt file, or None when it cannot be read; once per unchanged file, like `_read_json`."""
    try:
        stat = path.resolve().stat()
    except (OSError, RuntimeError):
        return None
    return _count_lines_once(path.resolve(), stat.st_ino, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _count_lines_once(path: Path, inode: int, mtime_ns: int, size: int) -> int | None:
    try:
        return sum(1 for line in path.read_bytes().splitlines() if line.strip())
    except OSError:
        return None


# Target sampling; the same rule applies in rollout and evaluation so τ means the same thing in both.
Temperature = Annotated[float, Field(ge=0)]  # 0 = greedy
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = Annotated[int, Field(ge=0)]  # 0 = off


class RolloutSampling(_Section):
    """A further target sampling setting for `rollout.mix`."""

    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0


class RolloutSpec(_Section):
    """Target-assisted speculative decoding that produces the training data."""

    mode: Literal["draft_opd", "naive"] = "draft_opd"  # naive = train on committed tokens only (ablation)
    batch_size: int = Field(8, ge=1)  # prompts per rollout batch
    max_new_tokens: int = Field(2048, ge=1)
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    # Fixed-shape decoding (HF StaticCache, preallocated drafter cache, finished rows kept, each row's kept slots
    # packed in place): the shapes a compiled decoding step needs (`SpeculativeDecoder(compiled=True)`,
    # bench/decode_vs_zlab.py). Same tokens; caches of prompt + max_new_tokens + 2K columns per row. Held-out eval
    # uses it too.
    static_cache: bool = False
    # Rollout batch i decodes with setting i mod (1 + len(mix)): 0 is temperature/top_p/top_k above, then these.
    # E.g. one greedy and one T=0.6 batch per step, so training sees the states both serving settings visit.
    mix: list[RolloutSampling] = Field(default_factory=list)
    # Where the target samples come from (DESIGN.md §6). speculative: the paper's path, rollout actors decode with
    # a drafter copy that adopts every broadcast and record its blocks. target: rollout actors only sample the
    # target (`sampler`) and the scorer rebuilds the blocks with the newest drafter (opd/sources/rebuild.py), exact because
    # drafts are point masses and decoding is lossless. samples: the same, from a file of stored target samples.
    source: Literal["speculative", "target", "samples"] = "speculative"
    # source target: speculative = the speculative decoder with the warm drafter, never updated (lossless, the
    # fastest on a CPU); autoregressive = plain batched decoding; vllm = vLLM's sampling (a GPU, the [gpu] extra).
    sampler: Literal["speculative", "autoregressive", "vllm"] = "speculative"
    # source samples: the file of `opd gen-samples` rows to read. source target: a cache, drawn into where it lacks
    # a sample and shared by every run that names it (opd reproduce's arms of one seed), under a file lock.
    samples_path: str | None = None

    @model_validator(mode="after")
    def _check(self) -> RolloutSpec:
        if self.source == "samples" and self.samples_path is None:
            _issues(["samples_path: none with source samples (expected the jsonl file `opd gen-samples` wrote)"])
        if self.source == "speculative" and self.samples_path is not None:
            _issues([f"samples_path: {self.samples_path} but source is speculative, which decodes its own (expected "
                     "source: samples or target, or no samples_path)"])
        return self

    @property
    def rebuilt(self) -> bool:
        """Whether the scorer rebuilds the blocks from target samples (any source but the speculative decoder)."""
        return self.source != "speculative"

    @property
    def settings(self) -> list[RolloutSampling]:
        """The batches' sampling settings in turn: this one, then `mix` (batch i uses i mod their count)."""
        own = RolloutSampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        return [own, *self.mix]


class ReplaySpec(_Section):
    """Which blocks are replayed and how the teacher is scored."""

    anchors: Literal["error", "random"] = "error"
    random_anchors_per_seq: int | None = Field(None, ge=1)  # None = as many as the rollout's error anchors
    teacher_temperature: float = Field(1.0, gt=0)
    # Whose view of the drafted slots the losses read. target: the target at teacher_temperature (the paper's).
    # served: the target processed exactly as the server verifies (serving.temperature, top_k and top_p), the p̃
    # whose Σ min(p̃, q) is the acceptance a q-sampled draft gets; teacher_temperature is then unused.
    teacher: Literal["target", "served"] = "target"
    teacher_topk: int | None = Field(None, gt=0)  # None = full vocabulary; k = top-k log-probs + tail bucket
    # The scorer's micro-batch as a token budget: each micro-batch's padded teacher rows (sequences x the longest
    # packed row: text plus K-2 slots per drafted block) stay within it, and a sequence over it alone is scored in
    # parts cut at block boundaries (exact: a block sees only the text up to its anchor and itself). None = cut
    # rollout batches into optim.micro_batch_size sequences. With a rebuilt rollout source the groups are formed on
    # the text, before the blocks exist; the blocks then run over each group's cached text.
    micro_batch_tokens: int | None = Field(None, ge=1)


class LossSpec(_Section):
    """The acceptance-aware loss (eq. 10-13) and its ablation switches."""

    kl_mode: Literal["mixed", "all_forward", "all_reverse"] = "mixed"
    gamma: float = Field(0.8, gt=0, le=1)  # rejected weight gamma^(k-1)
    lambda_acc: float = Field(1.0, ge=0)
    lambda_rej: float = Field(1.0, ge=0)
    rejected_decay: bool = True
    first_rejected_only: bool = False
    accepted_decay: bool = False
    # Weight of an expected-acceptance term added on the same slots: coef x -log sum_x q(x) p(x), the log of the
    # probability that the target (at replay.teacher_temperature) accepts a token drafted from q. 0 = off.
    acceptance_weight: float = Field(0.0, ge=0)
    # DFlash 2 only: weight of its selector term on the same slots, KL from the teacher restricted to the slot's
    # candidates to the selector's q (opd/distill/selector_loss.py). 0 = off, and the selector is then frozen.
    selector_weight: float = Field(1.0, ge=0)
    # What the drafted slots train towards (opd/distill/acceptance_loss.py). kl: the paper's Eqs. 10-13 (with the
    # switches above). For drafts sampled from a realized q (serving.draft: sample), the acceptance the server
    # realizes, α_k = Σ_v min(p̃_k(v), q_k(v)) at each slot given the drafts sampled before it: neg_log_alpha
    # (-log α) and one_minus_alpha (1 - α) on the paper's slot weights; lk, the LK hybrid λ KL(p̃ || q) + (1 - λ)(1 - α)
    # with λ = exp(-lk_eta sg[α]); expected_length, the block's 1 + Σ_k Π_{j<=k} α_j, per block.
    objective: Literal["kl", "neg_log_alpha", "one_minus_alpha", "lk", "expected_length"] = "kl"
    lk_eta: float = Field(3.0, ge=0)
    # How the gradient treats the drafts sampled before a slot, which depend on the drafter too. pathwise: as data
    # (the gradient flows through each slot's q only). score: plus the score-function term of the sampled prefix,
    # sg[f_k - b_k] ∇ Σ_{j<k} log q_j(d_j), b_k the mean of f_k over the chunk's other blocks (unbiased).
    prefix_gradient: Literal["pathwise", "score"] = "pathwise"

    @property
    def on_acceptance(self) -> bool:
        """Whether the objective is the acceptance of drafts sampled from q (not the paper's KL)."""
        return self.objective != "kl"

    @model_validator(mode="after")
    def _check(self) -> LossSpec:
        if self.lambda_acc + self.lambda_rej <= 0:
            _issues(["lambda_rej: lambda_acc + lambda_rej is 0 (expected a positive sum; the loss divides by it)"])
        return self


class SftSpec(_Section):
    """DFlash-style SFT: the warm start and the matched-compute baseline."""

    gamma: float = Field(7.0, gt=0)  # position weight exp(-(k-1)/gamma)
    anchors_per_seq: int = Field(512, ge=1)
    max_length: int = Field(3072, ge=2)
    lr: float = Field(6e-4, gt=0)
    epochs: int = Field(6, ge=1)
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    schedule: Literal["cosine", "constant"] = "cosine"
    batch_size: int = Field(16, ge=1)
    # Sequences per forward; their gradients accumulate into one step (the same gradient at any size), so memory
    # is set by this, not batch_size: at Qwen3 shapes one 2048-token sequence with 512 anchors is ~8K block tokens.
    micro_batch_size: int = Field(1, ge=1)
    # Or a token budget: each micro-batch's padded rows (sequences x (the longest sequence + anchors x K block
    # rows)) stay within it, so long and short responses share one memory bound; at least one sequence at max_length
    # with every anchor, so no sequence is ever over it (checked here, before any compute). None: micro_batch_size.
    micro_batch_tokens: int | None = Field(None, ge=1)
    response_max_new_tokens: int = Field(2048, ge=1)
    # The SFT data: a sample file (`opd gen-samples --sft` writes it) read, and filled where it lacks a prompt's
    # response. None: RUN_DIR/sft_data.jsonl.
    samples_path: str | None = None
    # Regenerated responses are sampled from the target at this temperature (None: the rollout's sampling).
    # Sampled regeneration covers T>0 decoding but teaches the drafter the target's marginals, not its mode.
    response_temperature: Temperature | None = None
    max_flops: float | None = Field(None, gt=0)  # matched-compute continued-SFT budget
    # Weight of loss.objective's acceptance term (drafts sampled from q at the serving setting) added on SFT's slots,
    # each slot's prefix the data (teacher forcing) and p̃ the target's view of it, so a warm start is trained for
    # the serving mode too. 0 = off (cross-entropy only).
    acceptance_weight: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> SftSpec:
        if self.batch_size % self.micro_batch_size:
            _issues([f"micro_batch_size: {self.micro_batch_size} does not divide batch_size {self.batch_size} "
                     "(expected a divisor)"])
        return self

    def longest_sequence_tokens(self, block_size: int) -> int:
        """One SFT sequence's rows at most: max_length tokens for the target, anchors_per_seq blocks of K rows."""
        return self.max_length + self.anchors_per_seq * block_size


Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimSpec(_Section):
    """AdamW for the drafter (plain torch, or DeepSpeed ZeRO)."""

    backend: Literal["torch", "deepspeed"] = "torch"
    zero_stage: int = Field(0, ge=0, le=3)
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0)  # 0 = off
    # Sequences per optimizer update (a step): whole rollout batches, batch_size / rollout.batch_size of them, whose
    # loss is normalised over the whole update (the authors' trainer.update_accumulation_steps x train_batch_size).
    batch_size: int = Field(24, ge=1)
    micro_batch_size: int = Field(1, ge=1)
    # The learner's micro-batch as a token budget instead of micro_batch_size sequences: the update's sequences are
    # packed, longest first, into micro-batches whose padded rows (sequences x (longest context + K x most blocks))
    # stay within it; a sequence over it alone is cut at block boundaries (exact: DFlash blocks never see each
    # other), so memory is bounded by the budget, not by the longest response times a count. The step's loss is
    # still normalised over the whole update, so the budget never changes the gradient. None: micro_batch_size.
    micro_batch_tokens: int | None = Field(None, ge=1)
    # Drafted slots whose [slots, vocabulary] logits the loss holds at once: the loss's transient memory is about
    # 8 x this x V x 4 bytes (2 GB at 400 slots and Qwen3's 151,936 tokens; bench/scale.py), whatever the length.
    loss_chunk_size: int = Field(400, ge=1)
    max_nonfinite_steps: int = Field(10, ge=0)  # abort after this many skipped non-finite steps

    @model_validator(mode="after")
    def _check(self) -> OptimSpec:
        if self.zero_stage > 0 and self.backend != "deepspeed":
            _issues([f"zero_stage: {self.zero_stage} needs backend deepspeed (expected 0 with backend torch)"])
        return self


# ------------------------------------------------------------------------------------------------- resources


class ClusterSpec(_Section):
    """What the declared cluster offers; roles are checked against it so none waits forever for placement."""

    num_gpus: int = Field(0, ge=0)
    num_cpus: int | None = Field(None, ge=1)  # None = do not check CPUs
    gpus_per_node: int | None = Field(None, ge=1)  # None = do not check that a sharded replica fits one node


class RoleSpec(_Section):
    """Replicas of one actor role and the Ray resources each replica requests."""

    replicas: int = Field(1, ge=1)
    num_gpus: float = Field(0, ge=0)
    num_cpus: float = Field(1, ge=0)
    # Ranks one replica spans (rollout, scorer, evaluator): the target is sharded over them by tensor (and, for
    # MoE, expert) parallelism, one placement group packed on one node; each rank takes num_gpus and num_cpus
    # (num_gpus 1 on GPUs; 0 on CPU, where the ranks are gloo processes). opd/models/sharding.py.
    gpus_per_replica: int = Field(1, ge=1)

    @property
    def ranks(self) -> int:
        """Processes the role runs: replicas x gpus_per_replica."""
        return self.replicas * self.gpus_per_replica


_ROLES = ("rollout", "scorer", "learner", "evaluator")


class ResourcesSpec(_Section):
    """Actor placement and the asynchronous pipeline's bounds.

    `evaluator` is the one actor (a target and a drafter copy, like a rollout replica) that decodes the held-out
    prompts on published weights, off the learner's critical path. It is a role of its own because it must not
    take a rollout replica's or the scorer's GPU from under them, and its resources are fit-checked like the
    others'. By default it reserves nothing and time-shares the machine (the tiny CPU runs); on a GPU cluster whose
    rollout decodes on GPUs it must have one (the Qwen3 configs give it a whole GPU)."""

    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    rollout: RoleSpec = Field(default_factory=RoleSpec)
    scorer: RoleSpec = Field(default_factory=RoleSpec)
    learner: RoleSpec = Field(default_factory=RoleSpec)
    evaluator: RoleSpec = Field(default_factory=lambda: RoleSpec(num_cpus=0))
    queue_size: int = Field(4, ge=1)  # bounded queues: producers block, nothing is dropped
    # In optimizer updates: update s trains only on rollout batches drafted with weights of version >= s - lag,
    # every one of its batches_per_step batches alike (older ones are counted and discarded). 0 is the authors'
    # synchronous trainer: all batches of an update come from the weights of the update before.
    max_policy_lag: int = Field(1, ge=0)
    broadcast_every: int = Field(1, ge=1)  # learner steps between weight publications

    @model_validator(mode="after")
    def _check(self) -> ResourcesSpec:
        roles = {name: getattr(self, name) for name in _ROLES}
        issues = [f"{name}.num_gpus: {_num(role.num_gpus)} (expected at most 1 or a whole number; Ray cannot "
                  "place a fraction above 1)"
                  for name, role in roles.items() if role.num_gpus > 1 and role.num_gpus % 1]
        issues += _shard_layout_issues(roles, self.cluster.gpus_per_node)
        issues += _fit(roles, "num_gpus", self.cluster.num_gpus)
        if self.evaluator.replicas != 1:
            issues.append(f"evaluator.replicas: {self.evaluator.replicas} (expected 1; one actor evaluates)")
        if self.rollout.num_gpus and not self.evaluator.num_gpus:
            issues.append("evaluator.num_gpus: 0 while rollout decodes on GPUs, so held-out eval would decode on a "
                          f"CPU (expected a GPU, e.g. {_num(self.rollout.num_gpus)} like a rollout replica)")
        if self.max_policy_lag < self.broadcast_every - 1:
            issues.append(f"max_policy_lag: {self.max_policy_lag} with broadcast_every {self.broadcast_every} would "
                          f"discard every batch between broadcasts (expected at least {self.broadcast_every - 1})")
        if self.cluster.num_cpus is not None:
            issues += _fit(roles, "num_cpus", self.cluster.num_cpus)
        _issues(issues)
        return self


def _shard_layout_issues(roles: dict[str, RoleSpec], gpus_per_node: int | None) -> list[str]:
    """A sharded replica is one rank per device, all on one node (its placement group is STRICT_PACK); the
    learner's ranks are its replicas."""
    issues = [f"learner.gpus_per_replica: {roles['learner'].gpus_per_replica} (expected 1: the learner's ranks are "
              "its replicas, each a whole drafter)"] * (roles["learner"].gpus_per_replica != 1)
    issues += [f"evaluator.gpus_per_replica: {roles['evaluator'].gpus_per_replica} (expected 1: the evaluator holds "
               "the target whole; sharded are rollout and scorer)"] * (roles["evaluator"].gpus_per_replica != 1)
    for name, role in roles.items():
        if role.gpus_per_replica > 1 and role.num_gpus not in (0, 1):
            issues.append(f"{name}.num_gpus: {_num(role.num_gpus)} with gpus_per_replica {role.gpus_per_replica} "
                          "(expected 1, a GPU per rank, or 0 for CPU ranks)")
        elif gpus_per_node is not None and role.gpus_per_replica * role.num_gpus > gpus_per_node:
            issues.append(f"{name}.gpus_per_replica: {role.gpus_per_replica} GPUs, but a node has "
                          f"cluster.gpus_per_node {gpus_per_node} (a replica's ranks are packed on one node)")
    return issues


def shard_degree_issues(resources: ResourcesSpec, target_config: dict[str, Any] | None) -> list[str]:
    """A role's ranks split the target's heads, key/value heads (and linear-attention heads) by tensor parallelism
    and its experts by expert parallelism: each count must divide by the degree."""
    text = (target_config or {}).get("text_config") or target_config or {}
    counts = {key: text[key] for key in _SPLIT_COUNTS if isinstance(text.get(key), int)}
    issues = []
    for name in _ROLES:
        degree = getattr(resources, name).gpus_per_replica
        uneven = [f"{key} {count}" for key, count in counts.items() if count % degree]
        if degree > 1 and uneven:
            issues.append(f"resources.{name}.gpus_per_replica: {degree} does not divide the target's "
                          f"{', '.join(uneven)} (expected a common divisor of {', '.join(map(str, counts.values()))})")
    return issues


_SPLIT_COUNTS = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
                 "num_experts", "num_local_experts")


def _fit(roles: dict[str, RoleSpec], attr: str, available: float) -> list[str]:
    """Each role alone, then all roles together, must fit the cluster, or the run would hang unplaced."""
    unit = {"num_gpus": "GPUs", "num_cpus": "CPUs"}[attr]
    each = {name: getattr(role, attr) * role.gpus_per_replica for name, role in roles.items()}
    need = {name: role.replicas * each[name] for name, role in roles.items()}
    issues = [f"{name}: {role.replicas} replicas x {_num(each[name])} {unit} = {_num(need[name])} {unit}, "
              f"but the cluster declares {_num(available)} (a role that can never be placed)"
              for name, role in roles.items() if need[name] > available]
    if not issues and sum(need.values()) > available:
        parts = " + ".join(f"{name} {_num(n)}" for name, n in need.items() if n)
        issues.append(f"cluster.{attr}: the roles need {parts} = {_num(sum(need.values()))} {unit}, but the cluster "
                      f"declares {_num(available)} (expected the sum to fit; all roles run at once)")
    return issues


# ------------------------------------------------------------------------------------------ tracking and eval


class TrackingSpec(_Section):
    """MLflow run and run-directory layout."""

    uri: str | None = None  # None = $OPD_TRACKING_URI, else sqlite:///<run_dir>/mlflow.db
    experiment: str = "draft-opd"
    # {name} = the spec's name. A relative path is resolved in the driver's working directory and handed to every
    # actor as that absolute path; on a multi-node cluster it must be absolute, on storage every node mounts.
    run_dir: str = "runs/{name}"
    checkpoint_every: int = Field(100, ge=1)
    keep_last: int | None = Field(None, ge=1)  # keep the newest N checkpoints (None: all); GBs each at Qwen3 sizes
    log_every: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> TrackingSpec:
        try:
            self.run_dir.format(name="x")
        except (KeyError, IndexError, ValueError):
            _issues([f"run_dir: {self.run_dir!r} has a bad placeholder (expected only {{name}})"])
        return self


class SamplingSpec(_Section):
    """One named evaluation setting."""

    name: str
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    # argmax: point-mass drafts, as DFlash's reference code and the serving engines draft; sample: drafts sampled
    # from the drafter's q with this setting's processing, verified with the full min(1, p/q) rule (lossless too).
    draft: Literal["argmax", "sample"] = "argmax"

    @model_validator(mode="after")
    def _check(self) -> SamplingSpec:
        if self.draft == "sample" and self.temperature == 0:
            _issues(["draft: sample at temperature 0 (expected argmax; greedy verification takes the argmax)"])
        return self


class ServingSpec(_Section):
    """The setting the drafter will be served in, part of the recipe: rollouts decode in it (rollout.temperature,
    top_p and top_k follow it), replay.teacher: served verifies as it does, and the acceptance objectives score it."""

    # argmax: point-mass drafts, as the serving engines draft by default; sample: drafts sampled from the drafter's
    # realized q and verified with min(1, p/q) (vLLM's probabilistic draft sampling, z-lab's dflash_generate at T>0)
    draft: Literal["argmax", "sample"] = "argmax"
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0

    @model_validator(mode="after")
    def _check(self) -> ServingSpec:
        if self.draft == "sample" and self.temperature == 0:
            _issues(["draft: sample at temperature 0 (expected argmax; greedy verification takes the argmax)"])
        return self


class EvalSpec(_Section):
    """Periodic held-out τ measurement (speculative decoding against the target)."""

    every: int = Field(100, ge=0)  # optimizer steps between evals; 0 = only before and after training
    num_prompts: int = Field(32, ge=1)
    max_new_tokens: int = Field(128, ge=1)
    batch_size: int = Field(8, ge=1)
    # τ-collapse alarm: held-out τ (first sampling setting) below collapse_ratio x the best so far is logged as
    # `tau_collapse` and, with stop_on_collapse, stops the run (a bad weight sync must not go unnoticed).
    collapse_ratio: float | None = Field(None, gt=0, le=1)
    stop_on_collapse: bool = False
    # Stored target samples of the held-out prompts (`opd gen-samples --eval`): periodic and before/after evals
    # then rebuild each point-mass setting's blocks on them instead of decoding (opd/eval/offline.py), the same τ
    # in distribution at a fraction of the cost; `draft: sample` settings and the speedup still decode.
    samples_path: str | None = None
    # opd train / opd run without samples_path: first store the warm drafter's decodes of the held-out prompts in
    # RUN_DIR/eval_samples.jsonl (once; its τ is then exact) and evaluate offline on them. false: always decode.
    offline: bool = True
    speedup_prompts: int = Field(32, ge=1)  # offline: prompts still decoded for the before/after speedup column
    # The periodic eval's expected-acceptance diagnostic (every rule on every setting's states, `eval_expected_*`
    # in MLflow): a packed target replay per batch, ~7x the offline τ itself on a CPU. `opd eval` always gives it.
    diagnostic: bool = True
    # A built benchmark suite (the directory `opd suite build --out DIR` wrote): `opd run` ends with its table in
    # the paper's layout, the warm and the trained drafter beside the ceiling at every point-mass setting, with
    # max new tokens per benchmark and thinking mode from the suite's card (opd/eval/suite.py). None: no suite.
    suite: str | None = None
    sampling: list[SamplingSpec] = Field(
        default_factory=lambda: [SamplingSpec(name="greedy", temperature=0.0),
                                 SamplingSpec(name="sampled", temperature=0.6, top_p=0.95, top_k=20)],
        min_length=1)

    @model_validator(mode="after")
    def _check(self) -> EvalSpec:
        names = [s.name for s in self.sampling]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            _issues([f"sampling: name {dupes[0]!r} is used twice (expected unique names; they key the metrics)"])
        return self


# ---------------------------------------------------------------------------------------------- the whole spec


class ExperimentSpec(_Section):
    """Everything one Draft-OPD experiment needs; the single source of truth passed to every actor.

    A step is one optimizer update, everywhere: the progress bar, checkpoint names (step-0000050), MLflow's step
    axis, `eval.every`, `tracking.checkpoint_every` and the learning-rate schedule count updates. An update trains
    on `batches_per_step` whole rollout batches (the paper's "~5.3K steps" are the authors' rollout batches:
    533 updates of 10). The run's length is given once, as `steps` (updates), `rollout_batches` or `epochs` over
    the prompt pool, and the other two are rounded up to whole updates; `steps` is then filled in, so a resolved
    spec that states both agrees with itself."""

    name: str = "experiment"
    seed: int = 0
    engine: Literal["local", "ray"] = "ray"
    steps: int | None = Field(None, gt=0)  # optimizer updates
    rollout_batches: int | None = Field(None, gt=0)  # or rollout batches, rounded up to whole updates
    epochs: float | None = Field(None, gt=0)  # or passes over data.train_pool_size prompts, rounded up likewise
    models: ModelsSpec
    data: DataSpec
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    replay: ReplaySpec = Field(default_factory=ReplaySpec)
    loss: LossSpec = Field(default_factory=LossSpec)
    sft: SftSpec = Field(default_factory=SftSpec)
    optim: OptimSpec = Field(default_factory=OptimSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    # The setting the drafter will be served in (None: no serving mode named, the paper's recipe).
    serving: ServingSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> ExperimentSpec:
        issues = self._accumulation_issues() + self._budget_issues() + self._serving_issues()
        issues += shard_degree_issues(self.resources, _read_json(Path(self.models.target_path) / "config.json"))
        if not issues:
            issues += self._take_run_length()
        if self.models.drafter.kind == "eagle3":
            issues += [f"{field}: {value} with an eagle3 drafter (a DFlash-only option; expected {fix})"
                       for field, value, fix in (("replay.anchors", self.replay.anchors, "error"),
                                                 ("replay.teacher_topk", self.replay.teacher_topk, "null"))
                       if value not in ("error", None)]
        if self.rollout.rebuilt and self.replay.anchors == "random":
            issues.append(f"replay.anchors: random with rollout.source {self.rollout.source} (expected error anchors: "
                          "random anchors are redrafted by a speculative rollout's drafter)")
        _issues(issues)
        return self

    def _serving_issues(self) -> list[str]:
        """The serving mode against what can train for it; rollouts take its setting (filled in here)."""
        serving, loss, replay = self.serving, self.loss, self.replay
        if serving is None:
            return ([f"sft.acceptance_weight: {self.sft.acceptance_weight:g} without a serving section (expected "
                     "serving: {draft: sample, temperature: ...})"] * bool(self.sft.acceptance_weight) +
                    [f"loss.objective: {loss.objective} without a serving section (expected serving: {{draft: "
                     "sample, temperature: ...}: the acceptance is that of a served setting)"] * loss.on_acceptance +
                    ["replay.teacher: served without a serving section (expected serving: {draft, temperature, top_p, "
                     "top_k}, or teacher: target)"] * (replay.teacher == "served"))
        issues = self._take_serving_setting(serving)
        if self.sft.acceptance_weight and not loss.on_acceptance:
            issues.append(f"sft.acceptance_weight: {self.sft.acceptance_weight:g} with loss.objective kl (the term is "
                          "an acceptance objective's; expected loss.objective: one of neg_log_alpha, one_minus_alpha, "
                          "lk, expected_length)")
        if loss.on_acceptance and serving.draft != "sample":
            issues.append(f"loss.objective: {loss.objective} with serving.draft argmax (α = Σ min(p̃, q) is the "
                          "acceptance of drafts sampled from q; expected serving.draft: sample, or objective: kl)")
        if loss.on_acceptance and replay.teacher_topk is not None:
            issues.append(f"replay.teacher_topk: {replay.teacher_topk} with loss.objective {loss.objective} (α needs "
                          "the teacher over the whole vocabulary; expected null)")
        if serving.draft == "sample" and self.models.drafter.kind == "eagle3":
            issues.append("serving.draft: sample with an eagle3 drafter (its chain is fed its argmax, so its sampled "
                          "drafts have no realized q to train; expected argmax)")
        if serving.draft == "sample" and self.rollout.rebuilt:
            issues.append(f"rollout.source: {self.rollout.source} with serving.draft sample (the rebuild recovers "
                          "point-mass blocks from the text; drafts sampled from q need source: speculative)")
        truncated = serving.temperature == 0 or serving.top_k > 0 or serving.top_p < 1
        if replay.teacher == "served" and truncated and loss.kl_mode != "all_forward" and not loss.on_acceptance:
            issues.append(f"replay.teacher: served with loss.kl_mode {loss.kl_mode} (the served target gives tokens "
                          "probability 0, so a reverse KL is infinite; expected kl_mode: all_forward)")
        return issues

    def _take_serving_setting(self, serving: ServingSpec) -> list[str]:
        """Rollouts decode in the serving setting: rollout.temperature/top_p/top_k follow it, and one set otherwise
        is refused rather than silently replaced."""
        issues = []
        for name in ("temperature", "top_p", "top_k"):
            mine, served = getattr(self.rollout, name), getattr(serving, name)
            if name in self.rollout.model_fields_set and mine != served:
                issues.append(f"rollout.{name}: {mine:g} differs from serving.{name} {served:g} (expected it unset: "
                              "rollouts decode in the serving setting, rollout.mix adds others)")
            setattr(self.rollout, name, served)
        return issues

    def _accumulation_issues(self) -> list[str]:
        """An update is whole rollout batches, and its sequences must split over the learner ranks."""
        o, replicas = self.optim, self.resources.learner.replicas
        issues = []
        if o.batch_size % self.rollout.batch_size:
            issues.append(f"optim.batch_size: {o.batch_size} is not a multiple of rollout.batch_size "
                          f"{self.rollout.batch_size} (a step trains on whole rollout batches)")
        if o.micro_batch_tokens is None and o.batch_size % (o.micro_batch_size * replicas):
            per_step = o.micro_batch_size * replicas
            issues.append(f"optim.batch_size: {o.batch_size} is not divisible by optim.micro_batch_size "
                          f"{o.micro_batch_size} x resources.learner.replicas {replicas} = {per_step} (expected a "
                          f"multiple of {per_step})")
        if o.micro_batch_tokens is not None and o.batch_size % replicas:
            issues.append(f"optim.batch_size: {o.batch_size} sequences per update do not split over "
                          f"resources.learner.replicas {replicas} (expected a multiple of {replicas})")
        if o.micro_batch_tokens is not None and o.backend == "deepspeed" and replicas > 1:
            issues.append(f"optim.micro_batch_tokens: with backend deepspeed and {replicas} learner replicas "
                          "(ranks would take different numbers of micro-batches, which DeepSpeed's accumulation "
                          "cannot; expected backend torch, one replica, or micro_batch_size)")
        return issues

    def _budget_issues(self) -> list[str]:
        """Token budgets must hold one block, and the longest sequence's unsplittable part: refused here, before
        any compute, rather than on the first long response hours into a run."""
        k, text = self.models.drafter.block_size, self.data.max_prompt_tokens + self.rollout.max_new_tokens
        wanted = [("optim.micro_batch_tokens", self.optim.micro_batch_tokens, text + k,
                   f"the longest context, data.max_prompt_tokens + rollout.max_new_tokens = {text}, plus one block"),
                  ("replay.micro_batch_tokens", self.replay.micro_batch_tokens, text + k - 2,
                   f"the longest text, data.max_prompt_tokens + rollout.max_new_tokens = {text}, plus one block's "
                   f"{k - 2} packed slots"),
                  ("sft.micro_batch_tokens", self.sft.micro_batch_tokens, self.sft.longest_sequence_tokens(k),
                   f"one sequence of sft.max_length {self.sft.max_length} plus sft.anchors_per_seq "
                   f"{self.sft.anchors_per_seq} blocks of {k}")]
        issues = []
        for field, budget, least, what in wanted:
            if budget is not None and budget < k:
                issues.append(f"{field}: {budget} tokens is smaller than one block of {k} (expected at least {least})")
            elif budget is not None and budget < least:
                issues.append(f"{field}: {budget} tokens is below {what} (expected at least {least})")
        return issues

    def _take_run_length(self) -> list[str]:
        """Fill `steps` from `rollout_batches` or `epochs` (rounded up to whole updates), or cross-check them."""
        derived = {}
        if self.rollout_batches is not None:
            derived["rollout_batches"] = -(-self.rollout_batches // self.batches_per_step)
        if self.epochs is not None:
            pool = self.data.train_pool_size
            if pool is None:
                return [f"epochs: {self.epochs:g} but the prompt pool's size is unknown (expected "
                        "data.train_pool_size, or a readable data.train_prompts)"]
            derived["epochs"] = _whole_updates(self.epochs * pool / self.optim.batch_size)
        if self.steps is None and not derived:
            return ["steps: missing (expected the run's length as steps, rollout_batches or epochs)"]
        values = {self.steps, *derived.values()} - {None}
        if len(values) > 1:
            said = ", ".join([f"steps {self.steps}"] * (self.steps is not None) +
                             [f"{k} {getattr(self, k):g} = {v} updates" for k, v in derived.items()])
            return [f"steps: the run's length is given twice and disagrees ({said}; expected one of them)"]
        self.steps = values.pop()
        return []

    @property
    def batches_per_step(self) -> int:
        """Rollout batches per optimizer step (the validator keeps `optim.batch_size` a multiple of
        `rollout.batch_size`): step s trains on batch indices s * batches_per_step .. (s + 1) * batches_per_step - 1."""
        return self.optim.batch_size // self.rollout.batch_size

    @property
    def run_dir(self) -> Path:
        """This run's directory (checkpoints, MLflow store, resolved spec)."""
        return Path(self.tracking.run_dir.format(name=self.name))

    @property
    def tracking_uri(self) -> str:
        """MLflow tracking URI: the spec's, else OPD_TRACKING_URI (a cluster's pods name its server there), else a
        sqlite store inside the run directory. Not MLflow's own MLFLOW_TRACKING_URI: `mlflow.set_tracking_uri`
        rewrites that one for the whole process, which would silently move every later spec's store."""
        return (self.tracking.uri or os.environ.get("OPD_TRACKING_URI")
                or f"sqlite:///{(self.run_dir / 'mlflow.db').resolve()}")

    def to_yaml(self) -> str:
        """The fully resolved spec as YAML; loading it back gives an equal spec."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def with_eval_samples(spec: ExperimentSpec, path: str | Path) -> ExperimentSpec:
    """`spec` evaluating offline on the held-out target samples in `path` (opd/eval/offline.py)."""
    return spec.model_copy(update={"eval": spec.eval.model_copy(update={"samples_path": str(path)})})


# ------------------------------------------------------------------------------------------------ paths


def check_paths(spec: ExperimentSpec) -> list[str]:
    """One message per required path that is missing or of the wrong kind; empty when all are usable."""
    m, d = spec.models, spec.data
    wanted = [("models.target_path", m.target_path, "model"),
              ("models.tokenizer_path", m.tokenizer_path if m.tokenizer_path != m.target_path else None, "dir"),
              ("models.drafter_path", m.drafter_path, "model"),
              ("data.train_prompts", d.train_prompts, "file"), ("data.eval_prompts", d.eval_prompts, "file"),
              ("rollout.samples_path", spec.rollout.samples_path if spec.rollout.source == "samples" else None,
               "file"), ("eval.samples_path", spec.eval.samples_path, "file"),
              ("eval.suite", spec.eval.suite, "suite")]
    return [msg for field, path, kind in wanted
            if path is not None and (msg := _path_problem(field, Path(path), kind))]


_path_problems = check_paths  # load_spec's keyword `check_paths` shadows the function inside it


def _path_problem(field: str, path: Path, kind: str) -> str | None:
    expected = {"model": "a model directory with config.json", "dir": "a directory", "file": "a jsonl file",
                "suite": "the directory `opd suite build --suite NAME --out DIR` wrote"}[kind]
    if not path.exists():
        problem = "does not exist"
    elif kind == "file" and not path.is_file():
        problem = "is not a file"
    elif kind != "file" and not path.is_dir():
        problem = "is not a directory"
    elif kind == "model" and not (path / "config.json").is_file():
        problem = "has no config.json"
    else:
        return None
    where = "" if path.is_absolute() else f", relative to {os.getcwd()}"
    return f"{field}: {path} {problem} (expected {expected}{where})"


# ------------------------------------------------------------------------------------------------ loading


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, which PyYAML would otherwise resolve silently (last one wins)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line for a YAML error, with its 1-based line and column when PyYAML knows them."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
    return f"invalid YAML{where}: {problem}"


def _read_yaml(path: Path) -> dict[str, Any]:
    """One config file as a mapping, or a SpecError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([f"{path}: file not found (expected a YAML spec)"]) from None
    except IsADirectoryError:
        raise SpecError([f"{path}: is a directory (expected a YAML spec file)"]) from None
    except UnicodeDecodeError:
        raise SpecError([f"{path}: not UTF-8 text (expected a YAML spec file)"]) from None
    except OSError as exc:
        raise SpecError([f"{path}: cannot read ({exc.strerror})"]) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        raise SpecError([f"{path}: {_yaml_problem(exc)}"]) from None
    if data is None:
        raise SpecError([f"{path}: file is empty (expected a YAML mapping of spec sections)"])
    if not isinstance(data, dict):
        raise SpecError([f"{path}: top level is a {type(data).__name__} (expected a mapping of spec sections)"])
    return data


def _deep_merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """Child wins; mappings merge recursively so a child states only its difference."""
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _resolve_file(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config with its `base:` chain merged in; `chain` holds the files above it, to detect cycles."""
    real = path.resolve()
    if real in chain:
        cycle = " -> ".join(str(p) for p in (*chain, real))
        raise SpecError([f"{path}: base cycle {cycle} (expected a chain that ends)"])
    data = _read_yaml(path)
    base = data.pop("base", None)
    bases = [base] if isinstance(base, str) else base or []
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise SpecError([f"{path}: base: got {base!r} (expected the path of another YAML spec, or a list of them)"])
    merged: dict[str, Any] = {}
    for name in bases:
        base_path = Path(os.path.normpath(path.parent / name))
        if not base_path.exists():
            raise SpecError([f"{path}: base: {base_path} not found (expected a YAML spec, relative to this file)"])
        merged = _deep_merge(merged, _resolve_file(base_path, (*chain, real)))
    return _deep_merge(merged, data)


def _apply_override(data: dict[str, Any], item: str) -> str | None:
    """Apply one `a.b=c` in place; return a problem line instead when it is malformed.

    A numeric segment indexes a list (`eval.sampling.0.temperature=0.6`); a list the config does not set is
    first filled with the spec's default, so its items can be addressed as they will be validated."""
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        return f"--set {item!r}: malformed (expected KEY=VALUE with a dotted key, e.g. optim.lr=1e-4)"
    try:
        value = yaml.load(raw, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        return f"--set {item!r}: {_yaml_problem(exc)}"
    node: dict[str, Any] | list[Any] = data
    try:
        for depth in range(len(parts) - 1):
            node = _child(node, parts[: depth + 1], indexed=parts[depth + 1].isdigit())
        node[_slot(node, parts)] = value
    except ValueError as exc:
        return f"--set {item!r}: {exc}"
    return None


def _child(node: dict[str, Any] | list[Any], path: list[str], indexed: bool) -> dict[str, Any] | list[Any]:
    """The section or list at `path` (its last segment read from `node`); a missing one is created: the spec's
    default list when the next segment is an index, else an empty section."""
    if isinstance(node, dict) and path[-1] not in node and not path[-1].isdigit():
        default = _default_list(path)
        if indexed and default is None:
            raise ValueError(f"{'.'.join(path)} is not a list (an index needs a list field; set the whole value "
                             f"instead, e.g. --set {'.'.join(path)}=[...])")
        node[path[-1]] = {} if default is None else default
    child = node[_slot(node, path)]
    if not isinstance(child, (dict, list)):
        raise ValueError(f"{'.'.join(path)} is a {type(child).__name__}, not a section (expected a mapping or "
                         "a list)")
    return child


def _slot(node: dict[str, Any] | list[Any], path: list[str]) -> str | int:
    """The key or list index that the last segment of `path` names in `node`."""
    where, part = ".".join(path[:-1]) or "the spec", path[-1]
    if isinstance(node, dict):
        if part.isdigit():
            raise ValueError(f"{where} is a mapping, not a list (index {part} needs a list field)")
        return part
    indices = f"0..{len(node) - 1}" if node else "none: the list is empty"
    if not part.isdigit():
        raise ValueError(f"{where} is a list (expected an item index, {indices}; got {part!r})")
    if int(part) >= len(node):
        raise ValueError(f"{where}.{part}: index out of range ({where} has {len(node)} items; indices {indices})")
    return int(part)


def _default_list(path: list[str]) -> list[Any] | None:
    """The spec's default for the list field at `path` (as plain data), None for anything else."""
    model: type[BaseModel] = ExperimentSpec
    for depth, part in enumerate(path):
        field = model.model_fields.get(part)
        if field is None:
            return None
        if depth == len(path) - 1:
            default = field.get_default(call_default_factory=True)
            if not isinstance(default, (list, tuple)):  # a tuple default (optim.betas) is a list in YAML
                return None
            return [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in default]
        nested = [t for t in (field.annotation, *getattr(field.annotation, "__args__", ()))
                  if isinstance(t, type) and issubclass(t, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    return None


def _error_path(loc: tuple[int | str, ...]) -> str:
    """Pydantic location as `eval.sampling[1].top_p`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _fields_at(loc: tuple[int | str, ...]) -> list[str]:
    """Field names of the spec model at `loc`, to suggest the intended key for an unknown one."""
    model: type[BaseModel] = ExperimentSpec
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        nested = [t for t in (field.annotation, *getattr(field.annotation, "__args__", ()))
                  if isinstance(t, type) and issubclass(t, BaseModel)] if field else []
        if not nested:
            return []
        model = nested[0]
    return list(model.model_fields)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _format_error(err: dict[str, Any]) -> list[str]:
    """Pydantic error -> `field.path: what is wrong (what is expected)` lines."""
    loc, kind = tuple(err["loc"]), err["type"]
    path = _error_path(loc)
    if kind == "spec_issues":
        prefix = f"{path}." if path else ""
        return [prefix + issue for issue in err["ctx"]["issues"]]
    if kind == "extra_forbidden":
        fields = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), fields, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"expected one of: {', '.join(fields)}"
        return [f"{path}: unknown key ({hint})"]
    if kind == "missing":
        return [f"{path}: missing (a value is required)"]
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return [f"{path or 'spec'}: got a {type(err['input']).__name__} (expected a mapping of fields)"]
    msg = err["msg"].removeprefix("Input ")
    return [f"{path}: got {_short(err['input'])} ({msg[0].lower() + msg[1:]})"]


def validate_spec(data: dict[str, Any], *, check_paths: bool = True) -> ExperimentSpec:
    """A raw mapping as an ExperimentSpec, or a SpecError listing every problem."""
    try:
        spec = ExperimentSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError([line for err in exc.errors() for line in _format_error(err)]) from None
    problems = _path_problems(spec) if check_paths else []
    if problems:
        raise SpecError(problems)
    return spec


def load_spec(path: str | Path, overrides: Sequence[str] = (), *, check_paths: bool = True) -> ExperimentSpec:
    """Load a YAML spec with its `base:` chain and `--set` overrides, validated; raises SpecError."""
    data = _resolve_file(Path(path))
    problems = [p for item in overrides if (p := _apply_override(data, item))]
    if problems:
        raise SpecError(problems)
    return validate_spec(data, check_paths=check_paths)


# ------------------------------------------------------------------------------------------------ export


def field_default(dotted: str) -> str | None:
    """The schema default of a `flatten` key, in `flatten`'s form; None where the path has none (a required field,
    an item of a list, or no such field)."""
    model: Any = ExperimentSpec
    *sections, name = dotted.split(".")
    for part in sections:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        model = field.annotation if field is not None else None
    if not (isinstance(model, type) and issubclass(model, BaseModel)) or name not in model.model_fields:
        return None
    field = model.model_fields[name]
    if field.is_required():
        return None
    value = TypeAdapter(field.annotation).dump_python(field.get_default(call_default_factory=True), mode="json")
    return value if isinstance(value, str) else json.dumps(value)


def flatten(spec: ExperimentSpec) -> dict[str, str]:
    """Dotted key -> string value, for MLflow params (`optim.lr` -> "0.0003"; lists of sections by index)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else key, sub)
        elif isinstance(value, list) and any(isinstance(v, dict) for v in value):
            for i, sub in enumerate(value):
                walk(f"{prefix}.{i}", sub)
        else:
            out[prefix] = value if isinstance(value, str) else json.dumps(value)

    walk("", spec.model_dump(mode="json"))
    return out
