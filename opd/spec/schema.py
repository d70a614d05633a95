"""The experiment spec's schema: one validated pydantic tree for everything a run needs.

A bad spec must fail in `opd validate` (or the first second of `opd train`), never hours into a cluster job,
so every field is typed and bounded, unknown keys are rejected, and the cross-field rules that would otherwise
surface late (layer ids beyond the target, roles that can never be scheduled, batches that do not divide) are
checked up front. Defaults are the Draft-OPD paper's settings (16-token blocks, 5 drafter layers, mixed KL with
γ = 0.8, lr 3e-4 with cosine decay).

Validation here reads no file: what the files say (the target's depth, the prompt pool's size, the warm drafter)
is filled in or checked once, in the driver, by `opd.spec.resolve`, so an actor validates the resolved spec it is
handed without touching the filesystem. Loading YAML is `opd.spec.load`; flattening for MLflow `opd.spec.export`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, model_validator

from opd.errors import OpdError
from opd.formats import DrafterSpec
from opd.formats.dflash import DFlashSpec
from opd.formats.section import Section, spec_issues


class SpecError(OpdError):
    """A spec that cannot be used; carries one line per problem so the CLI can print them all at once."""

    def __init__(self, messages: Sequence[str]):
        self.messages = list(messages)
        super().__init__("\n".join(self.messages))


def _a(word: str) -> str:
    """`word` with its article: a dflash drafter, an eagle3 drafter."""
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def _num(x: float) -> str:
    """Format a resource amount without a spurious `.0`."""
    return f"{x:g}"


def _whole_updates(updates: float) -> int:
    """A run length in (fractional) updates, rounded up to whole ones and never below one: a tiny `epochs` still
    trains, and the resolved `steps` it fills in loads again. Rounded to 9 places first, so float noise such as
    7 x 16,000 / 210 computed inexactly does not add an update."""
    return max(1, math.ceil(round(updates, 9)))


# ---------------------------------------------------------------------------------------------------- models


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
    drafter: DrafterSpec = Field(default_factory=DFlashSpec, description=(
        "The drafter's family (`kind`: dflash, dflash2, dspark, eagle3, peagle; unset: the warm drafter's, else dflash) and "
        "its options"))

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
        """A drafter section without `kind` is DFlash's (resolution first fills a warm drafter's own family)."""
        drafter = data.get("drafter") if isinstance(data, dict) else None
        if isinstance(drafter, dict) and "kind" not in drafter:
            data = {**data, "drafter": {**drafter, "kind": "dflash"}}
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


# ------------------------------------------------------------------------------------------ data and decoding


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


# Target sampling; the same rule applies in rollout and evaluation so τ means the same thing in both.
Temperature = Annotated[float, Field(ge=0)]  # 0 = greedy
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = Annotated[int, Field(ge=0)]  # 0 = off


class RolloutSampling(Section):
    """A further target sampling setting for `rollout.mix`."""

    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0


class RolloutSpec(Section):
    """Target-assisted speculative decoding that produces the training data."""

    mode: Literal["draft_opd", "naive"] = Field("draft_opd", description=(
        "naive = train on committed tokens only (ablation)"))
    batch_size: int = Field(8, ge=1, description="prompts per rollout batch")
    max_new_tokens: int = Field(2048, ge=1)
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0
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


class ReplaySpec(Section):
    """Which blocks are replayed and how the teacher is scored."""

    anchors: Literal["error", "random"] = "error"
    random_anchors_per_seq: int | None = Field(None, ge=1, description="None = as many as the rollout's error anchors")
    teacher_temperature: float = Field(1.0, gt=0)
    teacher: Literal["target", "served"] = Field("target", description=(
        "Whose view of the drafted slots the losses read. target: the target at teacher_temperature (the paper's). "
        "served: the target processed exactly as the server verifies (serving.temperature, top_k and top_p), the p̃ "
        "whose Σ min(p̃, q) is the acceptance a q-sampled draft gets; teacher_temperature is then unused."))
    teacher_topk: int | None = Field(None, gt=0, description=(
        "None = full vocabulary; k = top-k log-probs + tail bucket"))
    micro_batch_tokens: int | None = Field(None, ge=1, description=(
        "The scorer's micro-batch as a token budget: each micro-batch's padded teacher rows (sequences x the "
        "longest packed row: text plus K-2 slots per drafted block) stay within it, and a sequence over it alone is "
        "scored in parts cut at block boundaries (exact: a block sees only the text up to its anchor and itself). "
        "None = cut rollout batches into optim.micro_batch_size sequences. With a rebuilt rollout source the groups "
        "are formed on the text, before the blocks exist; the blocks then run over each group's cached text."))


class LossSpec(Section):
    """The acceptance-aware loss (eq. 10-13) and its ablation switches."""

    kl_mode: Literal["mixed", "all_forward", "all_reverse"] = "mixed"
    gamma: float = Field(0.8, gt=0, le=1, description="rejected weight gamma^(k-1)")
    lambda_acc: float = Field(1.0, ge=0)
    lambda_rej: float = Field(1.0, ge=0)
    rejected_decay: bool = True
    first_rejected_only: bool = False
    accepted_decay: bool = False
    acceptance_weight: float = Field(0.0, ge=0, description=(
        "Weight of an expected-acceptance term added on the same slots: coef x -log sum_x q(x) p(x), the log of the "
        "probability that the target (at replay.teacher_temperature) accepts a token drafted from q. 0 = off."))
    selector_weight: float = Field(1.0, ge=0, description=(
        "DFlash 2 only: weight of its selector term on the same slots, KL from the teacher restricted to the slot's "
        "candidates to the selector's q (opd/distill/selector_loss.py). 0 = off, and the selector is then frozen."))
    objective: Literal["kl", "neg_log_alpha", "one_minus_alpha", "lk", "expected_length"] = Field("kl", description=(
        "What the drafted slots train towards (opd/distill/acceptance_loss.py). kl: the paper's Eqs. 10-13 (with "
        "the switches above). For drafts sampled from a realized q (serving.draft: sample), the acceptance the "
        "server realizes, α_k = Σ_v min(p̃_k(v), q_k(v)) at each slot given the drafts sampled before it: "
        "neg_log_alpha (-log α) and one_minus_alpha (1 - α) on the paper's slot weights; lk, the LK hybrid λ KL(p̃ "
        "|| q) + (1 - λ)(1 - α) with λ = exp(-lk_eta sg[α]); expected_length, the block's 1 + Σ_k Π_{j<=k} α_j, per "
        "block."))
    lk_eta: float = Field(3.0, ge=0)
    confidence_weight: float = Field(0.0, ge=0, description=(
        "DSpark only: weight of its confidence head's binary cross-entropy against the rollout's realized acceptance "
        "(1 at the accepted slots, 0 at the first rejected one; later slots were never verified), a mean over the "
        "step's verified slots (opd/distill/confidence_loss.py). 0 = off, the head left as it is."))
    prefix_gradient: Literal["pathwise", "score"] = Field("pathwise", description=(
        "How the gradient treats the drafts sampled before a slot, which depend on the drafter too. pathwise: as "
        "data (the gradient flows through each slot's q only). score: plus the score-function term of the sampled "
        "prefix, sg[f_k - b_k] ∇ Σ_{j<k} log q_j(d_j), b_k the mean of f_k over the chunk's other blocks "
        "(unbiased)."))

    @property
    def on_acceptance(self) -> bool:
        """Whether the objective is the acceptance of drafts sampled from q (not the paper's KL)."""
        return self.objective != "kl"

    @model_validator(mode="after")
    def _check(self) -> LossSpec:
        if self.lambda_acc + self.lambda_rej <= 0:
            spec_issues(["lambda_rej: lambda_acc + lambda_rej is 0 (expected a positive sum; the loss divides by it)"])
        return self


class SftSpec(Section):
    """DFlash-style SFT: the warm start and the matched-compute baseline."""

    gamma: float = Field(7.0, gt=0, description="position weight exp(-(k-1)/gamma)")
    anchors_per_seq: int = Field(512, ge=1)
    max_length: int = Field(3072, ge=2)
    lr: float = Field(6e-4, gt=0)
    epochs: int = Field(6, ge=1)
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    schedule: Literal["cosine", "constant"] = "cosine"
    batch_size: int = Field(16, ge=1)
    micro_batch_size: int = Field(1, ge=1, description=(
        "Sequences per forward; their gradients accumulate into one step (the same gradient at any size), so memory "
        "is set by this, not batch_size: at Qwen3 shapes one 2048-token sequence with 512 anchors is ~8K block "
        "tokens."))
    micro_batch_tokens: int | None = Field(None, ge=1, description=(
        "Or a token budget: each micro-batch's padded rows (sequences x (the longest sequence + anchors x K block "
        "rows)) stay within it, so long and short responses share one memory bound; at least one sequence at "
        "max_length with every anchor, so no sequence is ever over it (checked here, before any compute). None: "
        "micro_batch_size."))
    response_max_new_tokens: int = Field(2048, ge=1)
    samples_path: str | None = Field(None, description=(
        "The SFT data: a sample file (`opd gen-samples --sft` writes it) read, and filled where it lacks a prompt's "
        "response. None: RUN_DIR/sft_data.jsonl."))
    response_temperature: Temperature | None = Field(None, description=(
        "Regenerated responses are sampled from the target at this temperature (None: the rollout's sampling). "
        "Sampled regeneration covers T>0 decoding but teaches the drafter the target's marginals, not its mode."))
    max_flops: float | None = Field(None, gt=0, description="matched-compute continued-SFT budget")
    objective: Literal["ce", "dspark"] = Field("ce", description=(
        "What SFT's slots train towards. ce: cross-entropy at the data token weighted exp(-(k-1)/gamma) (DFlash's "
        "recipe; EAGLE-3's soft cross-entropy). dspark: DSpark's published objective (arXiv 2607.05147, "
        "opd/distill/dspark_loss.py), on the same weights: 0.1 x cross-entropy + 0.9 x ||p - q||_1 to the target's "
        "distribution + the confidence head's binary cross-entropy against the slot's acceptance 1 - ||p - q||_1 / 2; "
        "for a drafter with a confidence head (kind dspark)."))
    init_from: str | None = Field(None, description=(
        "A drafter checkpoint (of any family) whose tensors a fresh drafter (models.drafter_path empty) starts from, "
        "each copied into the tensor of the same name and shape, the rest left at its random initialisation: how a "
        "DSpark drafter starts from a trained DFlash one, whose backbone (fc, norms, layers) it shares. Every tensor of "
        "the checkpoint must land, so nothing trained is dropped silently. None: all random."))
    acceptance_weight: float = Field(0.0, ge=0, description=(
        "Weight of loss.objective's acceptance term (drafts sampled from q at the serving setting) added on SFT's "
        "slots, each slot's prefix the data (teacher forcing) and p̃ the target's view of it, so a warm start is "
        "trained for the serving mode too. 0 = off (cross-entropy only)."))

    @model_validator(mode="after")
    def _check(self) -> SftSpec:
        if self.batch_size % self.micro_batch_size:
            spec_issues([f"micro_batch_size: {self.micro_batch_size} does not divide batch_size {self.batch_size} "
                     "(expected a divisor)"])
        return self

    def longest_sequence_tokens(self, block_size: int) -> int:
        """One SFT sequence's rows at most: max_length tokens for the target, anchors_per_seq blocks of K rows."""
        return self.max_length + self.anchors_per_seq * block_size


Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimSpec(Section):
    """AdamW for the drafter (plain torch, or DeepSpeed ZeRO)."""

    backend: Literal["torch", "deepspeed"] = "torch"
    zero_stage: int = Field(0, ge=0, le=3)
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="0 = off")
    batch_size: int = Field(24, ge=1, description=(
        "Sequences per optimizer update (a step): whole rollout batches, batch_size / rollout.batch_size of them, "
        "whose loss is normalised over the whole update (the authors' trainer.update_accumulation_steps x "
        "train_batch_size)."))
    micro_batch_size: int = Field(1, ge=1)
    micro_batch_tokens: int | None = Field(None, ge=1, description=(
        "The learner's micro-batch as a token budget instead of micro_batch_size sequences: the update's sequences "
        "are packed, longest first, into micro-batches whose padded rows (sequences x (longest context + K x most "
        "blocks)) stay within it; a sequence over it alone is cut at block boundaries (exact: DFlash blocks never "
        "see each other), so memory is bounded by the budget, not by the longest response times a count. The step's "
        "loss is still normalised over the whole update, so the budget never changes the gradient. None: "
        "micro_batch_size."))
    loss_chunk_size: int = Field(400, ge=1, description=(
        "Drafted slots whose [slots, vocabulary] logits the loss holds at once: the loss's transient memory is "
        "about 8 x this x V x 4 bytes (2 GB at 400 slots and Qwen3's 151,936 tokens; bench/scale.py), whatever the "
        "length."))
    max_nonfinite_steps: int = Field(10, ge=0, description="abort after this many skipped non-finite steps")

    @model_validator(mode="after")
    def _check(self) -> OptimSpec:
        if self.zero_stage > 0 and self.backend != "deepspeed":
            spec_issues([f"zero_stage: {self.zero_stage} needs backend deepspeed (expected 0 with backend torch)"])
        return self


# ------------------------------------------------------------------------------------------------- resources


class ClusterSpec(Section):
    """What the declared cluster offers; roles are checked against it so none waits forever for placement."""

    num_gpus: int = Field(0, ge=0)
    num_cpus: int | None = Field(None, ge=1, description="None = do not check CPUs")
    gpus_per_node: int | None = Field(None, ge=1, description=(
        "None = do not check that a sharded replica fits one node"))


class RoleSpec(Section):
    """Replicas of one actor role and the Ray resources each replica requests."""

    replicas: int = Field(1, ge=1)
    num_gpus: float = Field(0, ge=0)
    num_cpus: float = Field(1, ge=0)
    gpus_per_replica: int = Field(1, ge=1, description=(
        "Ranks one replica spans (rollout, scorer, evaluator): the target is sharded over them by tensor (and, for "
        "MoE, expert) parallelism, one placement group packed on one node; each rank takes num_gpus and num_cpus "
        "(num_gpus 1 on GPUs; 0 on CPU, where the ranks are gloo processes). opd/models/sharding.py."))

    @property
    def ranks(self) -> int:
        """Processes the role runs: replicas x gpus_per_replica."""
        return self.replicas * self.gpus_per_replica

    @property
    def bundle(self) -> dict[str, float]:
        """One rank's Ray placement bundle."""
        return {"CPU": self.num_cpus} | ({"GPU": self.num_gpus} if self.num_gpus else {})


_ROLES = ("rollout", "scorer", "learner", "evaluator")


class ResourcesSpec(Section):
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
    vllm_python: str = Field("/opt/vllm/bin/python", description=(
        "The vLLM environment's interpreter. vLLM pins a torch and transformers of its own, so everything that "
        "uses it (rollout.sampler vllm, opd gen-samples --engine vllm, opd serve-bench) runs in a Ray actor started "
        "with this interpreter, and only token ids, settings and counts cross. The default is where "
        "cluster/Dockerfile builds it from cluster/vllm.lock; elsewhere, `make vllm-env VLLM_ENV=DIR` and DIR/bin/python."))
    queue_size: int = Field(4, ge=1, description="bounded queues: producers block, nothing is dropped")
    max_policy_lag: int = Field(1, ge=0, description=(
        "In optimizer updates: update s trains only on rollout batches drafted with weights of version >= s - lag, "
        "every one of its batches_per_step batches alike (older ones are counted and discarded). 0 is the authors' "
        "synchronous trainer: all batches of an update come from the weights of the update before."))
    broadcast_every: int = Field(1, ge=1, description="learner steps between weight publications")
    evaluate_on: Literal["evaluator", "rollout"] = Field("evaluator", description=(
        "evaluator: the evaluator role's own actor and target decode the held-out prompts. rollout: rollout replica "
        "0 decodes them between its rollout batches, on its own target with a drafter copy of its own, and "
        "`opd run`'s before/after evaluation takes the rollout's resources: for a target whose copy takes a whole "
        "node, a third copy only to evaluate would take a third node. resources.evaluator then reserves nothing."))
    colocate_learner: bool = Field(False, description=(
        "Learner rank i shares scorer rank i's GPU: each scorer rank's placement bundle is one whole GPU, of which "
        "the scorer rank takes scorer.num_gpus and learner rank i (if there are that many) learner.num_gpus, which "
        "must sum to 1. So a scorer that needs all of the learner's node still has the learner beside it. Whether "
        "both fit one GPU's memory is for bench/sharded_layout.py to project: with optim.backend deepspeed and ZeRO "
        "the learner's optimizer state splits over its ranks."))

    @property
    def evaluator_role(self) -> RoleSpec:
        """What an evaluator actor takes: `evaluator`, or with `evaluate_on: rollout` (where training has no evaluator
        actor; rollout-0 evaluates) one rollout replica's resources, idle before and after the run."""
        return self.rollout.model_copy(update={"replicas": 1}) if self.evaluate_on == "rollout" else self.evaluator

    def learner_bundles(self) -> list[dict[str, float]]:
        """The learner placement group's bundles: the learner ranks' (0..N-1), then the scorer ranks'
        (`first_scorer_bundle`). With `colocate_learner`, bundle i holds scorer rank i and learner rank i (i < N)
        together: a whole GPU (the fractions sum to 1, checked below), so a pair shares it and no two scorer ranks
        share one."""
        if not self.colocate_learner:
            return [self.learner.bundle] * self.learner.replicas + [self.scorer.bundle] * self.scorer.ranks
        gpu = {"GPU": 1.0} if self.learner.num_gpus or self.scorer.num_gpus else {}
        return [{"CPU": round(self.scorer.num_cpus + self.learner.num_cpus * (i < self.learner.replicas), 4)} | gpu
                for i in range(self.scorer.ranks)]

    @property
    def first_scorer_bundle(self) -> int:
        """The learner placement group's bundle of scorer rank 0."""
        return 0 if self.colocate_learner else self.learner.replicas

    def _as_placed(self, roles: dict[str, RoleSpec]) -> dict[str, RoleSpec]:
        """The roles' GPUs as their bundles hold them: with colocate_learner each scorer rank's bundle is a whole GPU
        (learner ranks share the first ones), so the learner adds none."""
        if not (self.colocate_learner and (self.scorer.num_gpus or self.learner.num_gpus)):
            return roles
        return roles | {"scorer": self.scorer.model_copy(update={"num_gpus": 1.0}),
                        "learner": self.learner.model_copy(update={"num_gpus": 0.0})}

    @model_validator(mode="after")
    def _check(self) -> ResourcesSpec:
        roles = {name: getattr(self, name) for name in _ROLES}
        issues = [f"{name}.num_gpus: {_num(role.num_gpus)} (expected at most 1 or a whole number; Ray cannot "
                  "place a fraction above 1)"
                  for name, role in roles.items() if role.num_gpus > 1 and role.num_gpus % 1]
        if self.colocate_learner:
            issues += _colocation_issues(self)
        issues += _shard_layout_issues(self._as_placed(roles), self.cluster.gpus_per_node)
        issues += _fit(self._as_placed(roles), "num_gpus", self.cluster.num_gpus)
        if self.evaluator.replicas != 1:
            issues.append(f"evaluator.replicas: {self.evaluator.replicas} (expected 1; one actor evaluates)")
        if self.evaluate_on == "rollout":
            issues += _shared_evaluator_issues(self.evaluator)
        elif self.rollout.num_gpus and not self.evaluator.num_gpus:
            issues.append("evaluator.num_gpus: 0 while rollout decodes on GPUs, so held-out eval would decode on a "
                          f"CPU (expected a GPU, e.g. {_num(self.rollout.num_gpus)} like a rollout replica)")
        if self.max_policy_lag < self.broadcast_every - 1:
            issues.append(f"max_policy_lag: {self.max_policy_lag} with broadcast_every {self.broadcast_every} would "
                          f"discard every batch between broadcasts (expected at least {self.broadcast_every - 1})")
        if self.cluster.num_cpus is not None:
            issues += _fit(roles, "num_cpus", self.cluster.num_cpus)
        spec_issues(issues)
        return self


def _shared_evaluator_issues(evaluator: RoleSpec) -> list[str]:
    """With evaluate_on: rollout the evaluator role runs nothing, so resources it reserves would never be used."""
    if evaluator.num_gpus or evaluator.num_cpus or evaluator.gpus_per_replica != 1:
        return [f"evaluator: {_num(evaluator.num_gpus)} GPUs, {_num(evaluator.num_cpus)} CPUs, gpus_per_replica "
                f"{evaluator.gpus_per_replica} with evaluate_on rollout (expected num_gpus 0, num_cpus 0, "
                "gpus_per_replica 1: rollout replica 0 evaluates)"]
    return []


def _colocation_issues(r: ResourcesSpec) -> list[str]:
    """colocate_learner puts learner rank i in scorer rank i's bundle: no more learner ranks than scorer ranks, and
    each bundle one whole GPU (a fraction could put two scorer ranks of one replica on one device, which nccl
    refuses)."""
    learner, scorer = r.learner, r.scorer
    if learner.replicas > scorer.ranks:
        return [f"learner.replicas: {learner.replicas} with colocate_learner but the scorer has {scorer.ranks} ranks "
                "(expected at most one learner rank per scorer rank: learner rank i shares scorer rank i's GPU)"]
    pair = round(learner.num_gpus + scorer.num_gpus, 4)
    if pair not in (0, 1) or (pair == 1 and not (learner.num_gpus and scorer.num_gpus)):
        return [f"learner.num_gpus: {_num(learner.num_gpus)} + scorer.num_gpus {_num(scorer.num_gpus)} = "
                f"{_num(pair)} with colocate_learner (expected fractions summing to 1, e.g. 0.1 and 0.9: a learner "
                "rank and a scorer rank share each GPU; or 0 and 0 on CPU)"]
    return []


def _shard_layout_issues(roles: dict[str, RoleSpec], gpus_per_node: int | None) -> list[str]:
    """A sharded replica is one rank per device, all on one node (its placement group is STRICT_PACK), and so are
    the learner's ranks (its replicas) with every scorer rank."""
    issues = [f"learner.gpus_per_replica: {roles['learner'].gpus_per_replica} (expected 1: the learner's ranks are "
              "its replicas, each a whole drafter)"] * (roles["learner"].gpus_per_replica != 1)
    for name, role in roles.items():
        if role.gpus_per_replica > 1 and not (role.num_gpus or role.num_cpus):
            issues.append(f"{name}.num_cpus: 0 and num_gpus 0 with gpus_per_replica {role.gpus_per_replica} (expected "
                          "CPUs or GPUs per rank: a placement group packs the ranks on one node, and Ray places no "
                          "empty bundle)")
        elif role.gpus_per_replica > 1 and role.num_gpus not in (0, 1):
            issues.append(f"{name}.num_gpus: {_num(role.num_gpus)} with gpus_per_replica {role.gpus_per_replica} "
                          "(expected 1, a GPU per rank, or 0 for CPU ranks)")
        elif gpus_per_node is not None and role.gpus_per_replica * role.num_gpus > gpus_per_node:
            issues.append(f"{name}.gpus_per_replica: {role.gpus_per_replica} GPUs, but a node has "
                          f"cluster.gpus_per_node {gpus_per_node} (a replica's ranks are packed on one node)")
    beside = roles["learner"].replicas * roles["learner"].num_gpus + roles["scorer"].ranks * roles["scorer"].num_gpus
    if gpus_per_node is not None and not issues and beside > gpus_per_node:
        issues.append(f"scorer: {roles['scorer'].ranks} ranks of {_num(roles['scorer'].num_gpus)} GPU beside the "
                      f"learner's {_num(roles['learner'].replicas * roles['learner'].num_gpus)} need {_num(beside)} "
                      f"GPUs on one node, but cluster.gpus_per_node is {gpus_per_node} (the learner's placement "
                      "group packs its scorers with it, so their batches never cross the network)")
    return issues


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


class TrackingSpec(Section):
    """MLflow run and run-directory layout."""

    uri: str | None = Field(None, description="None = $OPD_TRACKING_URI, else sqlite:///<run_dir>/mlflow.db")
    experiment: str = "draft-opd"
    run_dir: str = Field("runs/{name}", description=(
        "{name} = the spec's name. A relative path is resolved in the driver's working directory and handed to "
        "every actor as that absolute path; on a multi-node cluster it must be absolute, on storage every node "
        "mounts."))
    checkpoint_every: int = Field(100, ge=1)
    keep_last: int | None = Field(None, ge=1, description=(
        "keep the newest N checkpoints (None: all); GBs each at Qwen3 sizes"))
    log_every: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> TrackingSpec:
        try:
            self.run_dir.format(name="x")
        except (KeyError, IndexError, ValueError):
            spec_issues([f"run_dir: {self.run_dir!r} has a bad placeholder (expected only {{name}})"])
        return self


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


class EvalSpec(Section):
    """Periodic held-out τ measurement (speculative decoding against the target)."""

    every: int = Field(100, ge=0, description="optimizer steps between evals; 0 = only before and after training")
    num_prompts: int = Field(32, ge=1)
    max_new_tokens: int = Field(128, ge=1)
    batch_size: int = Field(8, ge=1)
    collapse_ratio: float | None = Field(None, gt=0, le=1, description=(
        "τ-collapse alarm: held-out τ (first sampling setting) below collapse_ratio x the best so far is logged as "
        "`tau_collapse` and, with stop_on_collapse, stops the run (a bad weight sync must not go unnoticed)."))
    stop_on_collapse: bool = False
    samples_path: str | None = Field(None, description=(
        "Stored target samples of the held-out prompts (`opd gen-samples --eval`): periodic and before/after evals "
        "then rebuild each point-mass setting's blocks on them instead of decoding (opd/eval/offline.py), the same "
        "τ in distribution at a fraction of the cost; `draft: sample` settings and the speedup still decode."))
    offline: bool = Field(True, description=(
        "opd train / opd run without samples_path: first store the warm drafter's decodes of the held-out prompts "
        "in RUN_DIR/eval_samples.jsonl (once; its τ is then exact) and evaluate offline on them. false: always "
        "decode."))
    speedup_prompts: int = Field(32, ge=1, description=(
        "offline: prompts still decoded for the before/after speedup column"))
    diagnostic: bool = Field(True, description=(
        "The periodic eval's expected-acceptance diagnostic (every rule on every setting's states, "
        "`eval_expected_*` in MLflow): a packed target replay per batch, several times the cost of the offline τ "
        "itself. `opd eval` always gives it."))
    suite: str | None = Field(None, description=(
        "A built benchmark suite (the directory `opd suite build --out DIR` wrote): `opd run` ends with its table "
        "in the paper's layout, the warm and the trained drafter beside the ceiling at every point-mass setting, "
        "with max new tokens per benchmark and thinking mode from the suite's card (opd/eval/suite.py). None: no "
        "suite."))
    sampling: list[SamplingSpec] = Field(
        default_factory=lambda: [SamplingSpec(name="greedy", temperature=0.0),
                                 SamplingSpec(name="sampled", temperature=0.6, top_p=0.95, top_k=20)],
        min_length=1)

    @model_validator(mode="after")
    def _check(self) -> EvalSpec:
        names = [s.name for s in self.sampling]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            spec_issues([f"sampling: name {dupes[0]!r} is used twice (expected unique names; they key the metrics)"])
        return self


# ---------------------------------------------------------------------------------------------- the whole spec


class ExperimentSpec(Section):
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
    steps: int | None = Field(None, gt=0, description="optimizer updates")
    rollout_batches: int | None = Field(None, gt=0, description="or rollout batches, rounded up to whole updates")
    epochs: float | None = Field(None, gt=0, description=(
        "or passes over data.train_pool_size prompts, rounded up likewise"))
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
    serving: ServingSpec | None = Field(None, description=(
        "The setting the drafter will be served in (None: no serving mode named, the paper's recipe)."))

    @model_validator(mode="after")
    def _check(self) -> ExperimentSpec:
        issues = self._accumulationspec_issues() + self._budgetspec_issues() + self._servingspec_issues()
        if not issues:
            issues += self._take_run_length()
        drafter = self.models.drafter
        if not drafter.random_anchors and self.replay.anchors != "error":
            issues.append(f"replay.anchors: {self.replay.anchors} with {_a(drafter.kind)} drafter (it trains at the "
                          "anchors decoding chose; expected error)")
        if drafter.has_selector and self.loss.selector_weight > 0 and self.replay.teacher_topk is not None:
            issues.append(f"loss.selector_weight: {self.loss.selector_weight:g} with {_a(drafter.kind)} drafter and "
                          f"replay.teacher_topk {self.replay.teacher_topk} (the selector's term reads the full teacher "
                          "at its candidates; expected replay.teacher_topk: null, or loss.selector_weight: 0)")
        if not drafter.has_confidence_head:
            issues += [f"sft.objective: dspark with {_a(drafter.kind)} drafter (its confidence head's term has no "
                       "head to train; expected ce, or models.drafter.kind: dspark)"] * (self.sft.objective == "dspark")
            issues += [f"loss.confidence_weight: {self.loss.confidence_weight:g} with {_a(drafter.kind)} drafter (it "
                       "has no confidence head; expected 0)"] * bool(self.loss.confidence_weight)
        if self.sft.init_from is not None and self.models.warm:
            issues.append(f"sft.init_from: {self.sft.init_from} with models.drafter_path {self.models.drafter_path} "
                          "(it starts a fresh drafter; expected models.drafter_path empty, or sft.init_from: null)")
        if not drafter.topk_teacher and self.replay.teacher_topk is not None:
            issues.append(f"replay.teacher_topk: {self.replay.teacher_topk} with {_a(drafter.kind)} drafter (it reads "
                          "every slot's full teacher; expected null)")
        if self.resources.evaluate_on == "rollout" and not self.rollout.holds_target:
            issues.append(f"resources.evaluate_on: rollout with rollout.source {self.rollout.source} and sampler "
                          f"{self.rollout.sampler} (that rollout replica holds no target of ours to evaluate with; "
                          "expected evaluate_on: evaluator)")
        if self.rollout.rebuilt and self.replay.anchors == "random":
            issues.append(f"replay.anchors: random with rollout.source {self.rollout.source} (expected error anchors: "
                          "random anchors are redrafted by a speculative rollout's drafter)")
        spec_issues(issues)
        return self

    def _servingspec_issues(self) -> list[str]:
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
        if serving.draft == "sample" and not self.models.drafter.samples_from_q:
            issues.append(f"serving.draft: sample with {_a(self.models.drafter.kind)} drafter (its chain is fed its "
                          "argmax, so its sampled drafts have no realized q to train; expected argmax)")
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

    def _accumulationspec_issues(self) -> list[str]:
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

    def _budgetspec_issues(self) -> list[str]:
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
    def total_steps(self) -> int:
        """`steps` as the validator leaves it, always filled (from `rollout_batches` or `epochs` when not given),
        typed so: the field itself stays optional for the spec a user writes."""
        assert self.steps is not None  # the validator fills it or refuses the spec
        return self.steps

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


