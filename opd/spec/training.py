"""What training does with the rollouts: replaying and scoring them (`replay`), the loss (`loss`), the SFT warm
start and baseline (`sft`), and the optimizer (`optim`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from opd.formats.section import Section, spec_issues
from opd.spec.sampling import Temperature


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
