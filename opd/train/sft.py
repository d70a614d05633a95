"""`opd sft`: the DFlash SFT stage — the warm start Draft-OPD begins from, and the matched-compute baseline.

1. The target answers the prompt pool: the SFT data, drawn once into the sample store (opd/train/sft_data.py)
   and reused, so a restart does not draw it again.
2. The drafter learns to predict those responses from random anchors: block [y_a, MASK...] must produce
   y_a+1 .. y_a+K−1, cross-entropy weighted exp(−(k−1)/γ_sft) (DFlash's recipe).

Run again from a warm drafter with `sft.max_flops`, it is "continued SFT" at matched training compute.

Sized for Qwen3 as Draft-OPD's learner is: the target runs without its LM head (only its features are read), the
drafter's logits are formed `optim.loss_chunk_size` slots at a time (opd/models/lm_head.py), and a step runs
`sft.micro_batch_size` sequences (or `sft.micro_batch_tokens` padded rows) per forward, accumulating gradients;
anchors and the loss's denominator are the whole step's, so neither the chunk nor the micro-batch size changes the gradient. At the defaults one
2048-token sequence with 512 anchors is 7,680 slots: 4.7 GB of fp32 logits if formed at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from opd.data.prompts import train_prompts
from opd.decoding.sampling import Sampling
from opd.distill.acceptance_loss import acceptance_objective, sft_block_slots
from opd.distill.family_terms import SftSlots, terms_of
from opd.distill.losses import sft_log_weight_sum, sft_loss, teacher_processing
from opd.distill.micro_batches import group_by_budget
from opd.errors import OpdError
from opd.formats.checkpoint import CONFIG_FILE, WEIGHTS_FILE
from opd.formats.section import DrafterSection
from opd.models.build import Models, build_drafter, build_models
from opd.models.flops import DrafterParams, FlopCounter, TargetParams
from opd.models.protocol import Drafter
from opd.models.registry import family
from opd.models.target import Target
from opd.outputs import atomic_dir, check_output_dir
from opd.progress import progress_bar
from opd.run_dir import RunDirLock
from opd.sources.samplers import build_sampler
from opd.spec import ExperimentSpec, LossSpec, OptimSpec, SftSpec
from opd.tracking import Tracker
from opd.train.learner import build_optimizer
from opd.train.sft_data import SftExample, sft_examples, sft_store


@dataclass
class SftBatch:
    """One micro-batch laid out for the target and the drafter: sequences [B, T], anchors [B, M], labels."""

    ids: torch.Tensor  # [B, T] long, right-padded
    valid: torch.Tensor  # [B, T] bool: a real token
    anchor_pos: torch.Tensor  # [B, M] long
    block_valid: torch.Tensor  # [B, M] bool: a real anchor
    labels: torch.Tensor  # [B, M, K-1] long: the data token slot k predicts
    input_pos: torch.Tensor  # [B, M, K-1] long: where the block's inputs sit, a .. a+K-2 (clamped to the row)
    inputs: torch.Tensor  # [B, M, K-1] long: the data tokens there, which a chain drafter is fed
    label_ok: torch.Tensor  # [B, M, K-1] bool: slot k lands on a real token of a real block

    def to(self, device: torch.device) -> SftBatch:
        return SftBatch(*(t.to(device) for t in vars(self).values()))

    @property
    def position_mask(self) -> torch.Tensor:
        """[N, K-1] of the N real blocks: the slots the loss trains on."""
        return self.label_ok[self.block_valid]


@dataclass
class SftStep:
    """What one SFT step trained on and what it cost in tokens (opd/models/flops.py turns these into FLOPs)."""

    loss: float
    tokens: int  # real sequence tokens: the target's forward and the drafter's context positions
    blocks: int  # drafted blocks: block_size drafter tokens each
    slots: int  # trained slots: the LM head's rows
    teacher_slots: int = 0  # slots whose target distribution a term reads: the target's LM head's rows


def sft_micro_batches(examples: list[SftExample], *, anchors_per_seq: int, max_length: int, block_size: int,
                      micro_batch_size: int, generator: torch.Generator,
                      micro_batch_tokens: int | None = None) -> list[SftBatch]:
    """The batch's anchors (drawn example by example, so the micro-batch layout never changes them), laid out
    `micro_batch_size` examples at a time, or longest first under `micro_batch_tokens` padded rows (the sequence
    for the target, K rows per anchor for the drafter; the spec keeps one whole sequence within it)."""
    seqs = [(e.prompt_ids + e.response_ids)[:max_length] for e in examples]
    anchors = [_random_anchors(len(e.prompt_ids), len(s), anchors_per_seq, generator) for e, s in zip(examples, seqs)]
    if micro_batch_tokens is None:
        groups = [list(range(i, min(i + micro_batch_size, len(seqs)))) for i in range(0, len(seqs), micro_batch_size)]
    else:
        sizes = [(len(s), len(a) * block_size) for s, a in zip(seqs, anchors)]
        order = sorted(range(len(seqs)), key=lambda i: sum(sizes[i]), reverse=True)
        groups = [[order[j] for j in g] for g in group_by_budget([sizes[i] for i in order], micro_batch_tokens)]
    return [_layout([seqs[i] for i in g], [anchors[i] for i in g], block_size) for g in groups]


def _layout(seqs: list[list[int]], anchors: list[list[int]], k: int) -> SftBatch:
    width, m = max(len(s) for s in seqs), max(1, max(len(a) for a in anchors))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    anchor_pos = torch.zeros(len(seqs), m, dtype=torch.long)
    block_valid = torch.zeros(len(seqs), m, dtype=torch.bool)
    for b, (s, a) in enumerate(zip(seqs, anchors)):
        ids[b, : len(s)], valid[b, : len(s)] = torch.tensor(s), True
        anchor_pos[b, : len(a)], block_valid[b, : len(a)] = torch.tensor(a, dtype=torch.long), True
    label_pos = anchor_pos[..., None] + torch.arange(1, k)  # [B, M, K-1]
    inside = label_pos.clamp_max(width - 1).flatten(1)
    labels = ids.gather(1, inside).view_as(label_pos)
    label_ok = valid.gather(1, inside).view_as(label_pos) & (label_pos < width) & block_valid[..., None]
    input_pos = (label_pos - 1).clamp_max(width - 1)
    inputs = ids.gather(1, input_pos.flatten(1)).view_as(label_pos)
    return SftBatch(ids, valid, anchor_pos, block_valid, labels, input_pos, inputs, label_ok)


@dataclass(frozen=True)
class SftAcceptance:
    """SFT's acceptance term (`sft.acceptance_weight` x `loss.objective` at the serving setting, on SFT's slots), so
    a warm start can be trained for the serving mode too (opd/distill/acceptance_loss.py)."""

    weight: float
    loss: LossSpec
    serving: Sampling
    teacher: Sampling  # p̃'s processing (replay.teacher)
    step_blocks: int = 0  # the step's blocks (`expected_length` is a mean over them), filled per step

    @classmethod
    def of(cls, spec: ExperimentSpec) -> SftAcceptance | None:
        if not spec.sft.acceptance_weight:
            return None
        assert spec.serving is not None  # the spec refuses sft.acceptance_weight without a serving section
        return cls(spec.sft.acceptance_weight, spec.loss, Sampling.of(spec.serving),
                   teacher_processing(spec.replay, spec.serving))


def sft_batch_loss(target: Target, drafter: Drafter, batch: SftBatch, *, gamma: float, chunk_size: int,
                   log_weight_sum: float | None = None, selector_weight: float = 0.0,
                   acceptance: SftAcceptance | None = None, section: DrafterSection | None = None) -> torch.Tensor:
    """This micro-batch's share of the SFT loss (the step's mean when `log_weight_sum` is the step's).

    Features come from the target's decoder alone (no [B, T, V] logits) and the drafter's logits are formed
    `chunk_size` slots at a time, so memory is set by the micro-batch and the chunk, not the vocabulary. A chain
    drafter is fed the data tokens (training-time test). DFlash learns the data tokens; EAGLE-3 the target's
    distribution over its draft vocabulary at the same slots (soft cross-entropy), as SpecForge trains it; its family's
    own objective when its `section` (models.drafter) names one (opd/distill/family_terms.py: DSpark's). The family's
    own terms add to it (DFlash 2's selector: `selector_weight` x its term), and `acceptance` its weight x the serving
    mode's acceptance at the teacher-forced slots (the target's view of the data prefix)."""
    batch = batch.to(target.device)
    hidden_t, features = target.hidden_states(batch.ids, attention_mask=batch.valid.long())
    hidden = drafter.block_hidden(features, batch.ids, batch.valid, batch.anchor_pos, batch.inputs)
    slots, mask, teacher = hidden[batch.block_valid], batch.position_mask, None
    if drafter.sft_target == "target":  # slot k's target distribution is the target's state at a + k - 1
        rows = torch.arange(len(batch.ids), device=batch.ids.device)[:, None, None]
        teacher = hidden_t[rows, batch.input_pos][batch.block_valid]
        trainable = drafter.trainable_slots(teacher)  # None: all of them
        if trainable is not None:
            mask = mask & trainable  # the denominator still counts them, as SpecForge's mean
    if log_weight_sum is None:
        log_weight_sum = sft_log_weight_sum(mask, gamma)
    rows = torch.arange(len(batch.ids), device=batch.ids.device)[:, None, None]
    terms = terms_of(drafter)
    family_slots = SftSlots(slots, lambda: hidden_t[rows, batch.input_pos][batch.block_valid],
                            batch.labels[batch.block_valid], batch.inputs[batch.block_valid], mask, gamma,
                            log_weight_sum, chunk_size)
    loss = terms.sft_objective(drafter, family_slots, section)
    if loss is None:
        loss = sft_loss(slots, batch.labels[batch.block_valid], gamma=gamma, position_mask=mask,
                        head=drafter.student_head, chunk_size=chunk_size, log_weight_sum=log_weight_sum,
                        teacher=teacher, teacher_head=drafter.teacher_head)
    if acceptance is not None:
        cut = sft_block_slots(batch.inputs[batch.block_valid], mask, acceptance.loss, gamma=gamma,
                              log_weight_sum=log_weight_sum, step_blocks=acceptance.step_blocks)
        loss = loss + acceptance.weight * acceptance_objective(
            drafter, slots, family_slots.view(), cut, acceptance.loss, serving=acceptance.serving,
            teacher_processing=acceptance.teacher, chunk_size=chunk_size).loss
    return loss + terms.sft(drafter, family_slots, selector_weight)


def sft_backward(target: Target, drafter: Drafter, examples: list[SftExample], sft: SftSpec, *,
                 chunk_size: int, generator: torch.Generator, selector_weight: float = 0.0,
                 acceptance: SftAcceptance | None = None, section: DrafterSection | None = None) -> SftStep:
    """Accumulate one SFT step's gradient micro-batch by micro-batch: each backward is that micro-batch's exact
    share of the step's weighted mean, so `sft.micro_batch_size` never changes the gradient."""
    micro = sft_micro_batches(examples, anchors_per_seq=sft.anchors_per_seq, max_length=sft.max_length,
                              block_size=drafter.block_size, micro_batch_size=sft.micro_batch_size,
                              generator=generator, micro_batch_tokens=sft.micro_batch_tokens)
    log_norm = float(torch.logsumexp(torch.tensor([sft_log_weight_sum(b.position_mask, sft.gamma) for b in micro],
                                                  dtype=torch.float64), dim=0))
    if acceptance is not None:
        acceptance = replace(acceptance, step_blocks=sum(int(b.block_valid.sum()) for b in micro))
    loss = 0.0
    for batch in micro:
        part = sft_batch_loss(target, drafter, batch, gamma=sft.gamma, chunk_size=chunk_size, log_weight_sum=log_norm,
                              selector_weight=selector_weight, acceptance=acceptance, section=section)
        part.backward()
        loss += part.item()
    slots = sum(int(b.label_ok.sum()) for b in micro)
    reads_target = (drafter.sft_target == "target" or terms_of(drafter).sft_reads_target(section)
                    or acceptance is not None)
    return SftStep(loss, tokens=sum(int(b.valid.sum()) for b in micro),
                   blocks=sum(int(b.block_valid.sum()) for b in micro), slots=slots,
                   teacher_slots=slots if reads_target else 0)


def response_token_counts(examples: list[SftExample], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the SFT data's responses (what a fresh drafter's family may fit itself
    to: EAGLE-3's draft vocabulary)."""
    tokens = torch.tensor([t for e in examples for t in e.response_ids], dtype=torch.long)
    return torch.bincount(tokens, minlength=vocab_size)


def _random_anchors(prompt_len: int, length: int, count: int, generator: torch.Generator) -> list[int]:
    """Absolute positions a with a and a+1 both response tokens, sampled without replacement, sorted."""
    candidates = length - 1 - prompt_len
    if candidates <= 0:
        return []
    pick = torch.randperm(candidates, generator=generator)[:count].sort().values
    return (pick + prompt_len).tolist()


def run_sft(spec: ExperimentSpec, out_dir: str | None = None) -> int:
    """Generate (or reuse) target responses, train the drafter, save it in DFlash format; the output directory is
    checked and the run directory locked first, as `opd train` locks it, so neither a bad `--out` nor a second
    `opd sft` there is found after the training."""
    check_drafter_out(Path(out_dir or spec.run_dir / "drafter"), "--out" if out_dir else "tracking.run_dir")
    with RunDirLock(spec.run_dir):
        return _run_sft(spec, out_dir)


DRAFTER_FILES = {CONFIG_FILE, WEIGHTS_FILE}  # what save_pretrained writes, in either family


def check_drafter_out(out: Path, field: str) -> None:
    """`out` may be new, empty or a saved drafter, which the new one replaces whole; any other content is the
    user's and is refused rather than deleted."""
    check_output_dir(out, field, "the drafter")
    foreign = sorted({p.name for p in out.iterdir()} - DRAFTER_FILES) if out.is_dir() else []
    if foreign:
        raise OpdError(f"{field}: {out} holds {foreign[0]}, which is not a drafter file (expected a new or empty "
                       f"directory, or a drafter directory to replace: {', '.join(sorted(DRAFTER_FILES))})")


def _run_sft(spec: ExperimentSpec, out_dir: str | None) -> int:
    models = build_models(spec)
    run_dir = spec.run_dir
    prompts = train_prompts(spec.data, models.tokenizer)
    sampler = build_sampler(spec, "autoregressive", models.target, None, models.eos_id)
    examples = sft_examples(spec, sft_store(spec, prompts), prompts, sampler)
    if not spec.models.warm:  # a warm drafter keeps what it was trained with
        family(spec.models.drafter.kind).fit_to_data(models.drafter,
                                                    response_token_counts(examples, models.target.vocab_size))
        if spec.sft.init_from is not None:
            init_from(spec, models)
    tracker = Tracker(spec)
    try:
        flops = train_sft(spec, models, examples, tracker)
    finally:
        tracker.close()
    out = Path(out_dir or run_dir / "drafter")
    with atomic_dir(out) as tmp:
        models.drafter.save_pretrained(tmp)
    print(f"SFT drafter saved to {out} ({flops.total:.3g} training FLOPs); MLflow run {tracker.run_id} in "
          f"{spec.tracking_uri}")
    return 0


def init_from(spec: ExperimentSpec, models: Models) -> None:
    """`sft.init_from`: the fresh drafter takes the checkpoint's tensors by name, keeping its random initialisation
    elsewhere (a DSpark drafter from a DFlash one: the backbone carried, its Markov and confidence heads random).
    The configs must agree on every field both have but the block size (so the tensors have the same sizes and mean
    what they meant: the target layers read, the mask token, RoPE), and every checkpoint tensor must land: a
    mismatch is an error, not a skip."""
    path, kind = spec.sft.init_from, spec.models.drafter.kind
    source = build_drafter(spec, models.target, models.tokenizer, path)
    ours, theirs = models.drafter.config, source.config
    for field in sorted(set(vars(ours)) & set(vars(theirs)) - {"block_size"}):
        if getattr(ours, field) != getattr(theirs, field):
            raise OpdError(f"sft.init_from: {path} has {field} {getattr(theirs, field)} but the fresh {kind} drafter "
                           f"{getattr(ours, field)} (expected them to agree, so its tensors mean what they meant)")
    own, tensors = models.drafter.state_dict(), source.state_dict()
    lacking = [name for name in tensors if name not in own]
    if lacking:
        raise OpdError(f"sft.init_from: {path} holds {lacking[0]}, which the {kind} drafter lacks (expected a "
                       f"checkpoint whose every tensor the {kind} drafter holds, as a DFlash one's backbone)")
    models.drafter.load_state_dict({**own, **tensors})
    random = sorted(set(own) - set(tensors))
    print(f"sft.init_from: {len(tensors)} tensors from {path}; random: {', '.join(random) or 'none'}")


def train_sft(spec: ExperimentSpec, models: Models, examples: list[SftExample], tracker: Tracker | None = None,
              on_step: Callable[[FlopCounter], None] | None = None) -> FlopCounter:
    """`sft.epochs` over the examples, or until `sft.max_flops` training FLOPs when that is set.

    `on_step` sees the FLOPs spent after every step (`opd reproduce` evaluates at matched-FLOPs marks)."""
    s = spec.sft
    steps_per_epoch = math.ceil(len(examples) / s.batch_size)
    steps = steps_per_epoch * s.epochs
    optim = OptimSpec(lr=s.lr, warmup_ratio=s.warmup_ratio, schedule=s.schedule, batch_size=s.batch_size)
    acceptance = SftAcceptance.of(spec)
    selects = terms_of(models.drafter).prepare(models.drafter, spec.loss.selector_weight > 0 or acceptance is not None)
    optimizer, scheduler = build_optimizer(models.drafter, optim, steps)
    generator = torch.Generator().manual_seed(spec.seed)
    flops = FlopCounter()
    target_params, drafter_params = TargetParams.of(models.target.model), DrafterParams.of(models.drafter)
    models.drafter.train()
    with progress_bar() as bar:
        task = bar.add_task("sft", total=steps)
        for step in range(steps):
            if step % steps_per_epoch == 0:
                order = torch.randperm(len(examples), generator=generator).tolist()
            j = (step % steps_per_epoch) * s.batch_size
            batch = [examples[i] for i in order[j : j + s.batch_size]]
            optimizer.zero_grad(set_to_none=True)
            done = sft_backward(models.target, models.drafter, batch, s, chunk_size=spec.optim.loss_chunk_size,
                                generator=generator, selector_weight=spec.loss.selector_weight if selects else 0.0,
                                acceptance=acceptance, section=spec.models.drafter)
            torch.nn.utils.clip_grad_norm_(models.drafter.parameters(), spec.optim.grad_clip or float("inf"))
            optimizer.step()
            scheduler.step()
            # features, and the LM head only where a term reads the target's distribution
            flops.target_forward += target_params.forward(done.tokens, logits=done.teacher_slots)
            flops.drafter_train += drafter_params.train(context=done.tokens, blocks=done.blocks, slots=done.slots)
            if selects:
                flops.drafter_train += drafter_params.selector_train(done.slots)
            bar.update(task, completed=step + 1, description=f"sft loss {done.loss:.3f}")
            if tracker:
                tracker.log({"sft_loss": done.loss, "lr": scheduler.get_last_lr()[0], "flops_total": flops.total},
                            step + 1)
            if on_step:
                on_step(flops)
            if s.max_flops is not None and flops.total >= s.max_flops:
                break
    models.drafter.eval()
    return flops
