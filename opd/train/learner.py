"""The learner: the trainable drafter, its optimizer and schedule, one acceptance-aware step at a time.

Shared by the single-process loop and the Ray `LearnerActor`, so both paths take bit-identical steps.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from opd.decoding.sampling import Sampling
from opd.distill.acceptance_loss import acceptance_objective, block_slots
from opd.distill.family_terms import OpdSlots, terms_of
from opd.distill.losses import LossTerms, StepNorm, TopKTeacher, acceptance_aware_loss, teacher_processing
from opd.distill.micro_batches import learner_plan, merge
from opd.distill.replay import student_hidden
from opd.distill.scored_batch import ScoredBatch
from opd.errors import OpdError
from opd.models.flops import DrafterParams, FlopCounter
from opd.models.protocol import Drafter
from opd.spec import ExperimentSpec, LossSpec, OptimSpec
from opd.train.deepspeed import deepspeed_engine, zero_keeps_masters
from opd.train.distributed import Group, gather, reduce_gradients, reduce_sum
from opd.train.master_weights import adamw

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def lr_lambda(optim: OptimSpec, total_steps: int):
    """Linear warmup for `warmup_ratio` of the steps, then cosine to zero (or constant)."""
    warmup = int(optim.warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_optimizer(drafter: Drafter, optim: OptimSpec, total_steps: int, lr: float | None = None, *,
                    masters: bool = True):
    """AdamW and its schedule. A bf16/fp16 drafter's AdamW steps fp32 master weights (opd/train/master_weights.py)
    unless `masters` is False: DeepSpeed ZeRO, which keeps fp32 partitions of them itself."""
    trainable = [p for p in drafter.parameters() if p.requires_grad]  # a frozen part: `FamilyTerms.prepare`
    opt = adamw(trainable, masters=masters, lr=lr or optim.lr, betas=tuple(optim.betas),
                weight_decay=optim.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(optim, total_steps))


@dataclass
class StepMetrics:
    loss: float
    loss_acc: float
    loss_rej: float
    num_acc: int
    num_rej: int
    grad_norm: float
    lr: float
    skipped: bool  # a non-finite loss or gradient: the step was not applied


class Learner:
    """The drafter's optimizer steps, on one learner rank of `group` (the default: the only one).

    A step's loss is eq. 10-13 over the whole step (`StepNorm`): each micro-batch's loss is its exact share of
    it, so summing gradients over micro-batches and ranks gives the full-batch gradient whatever the micro-batch
    size, loss chunk size or rank count. With several ranks each sees only its shard of a step's micro-batches
    (opd/train/distributed.py), gradients are summed over the ranks, and every rank takes the same step.
    Micro-batches arrive on the CPU and are moved to the drafter's device one at a time, so at most one
    micro-batch of scored data is on the GPU. `optim.backend: deepspeed` hands the backward reduction,
    clipping and the step to a DeepSpeed engine around the same AdamW and schedule.
    """

    def __init__(self, spec: ExperimentSpec, drafter: Drafter, group: Group | None = None) -> None:
        self.spec, self.drafter = spec, drafter
        assert isinstance(drafter, nn.Module)  # every family is one
        drafter.train()
        # a part only the family's terms train (DFlash 2's selector) trains where a loss reads it
        self.terms = terms_of(drafter)
        self._selects = self.terms.prepare(drafter, spec.loss.selector_weight > 0 or spec.loss.on_acceptance)
        self._teacher = teacher_processing(spec.replay, spec.serving)
        self._serving = Sampling.of(spec.serving) if spec.serving is not None else None
        self.optimizer, self.scheduler = build_optimizer(drafter, spec.optim, spec.total_steps,
                                                         masters=not zero_keeps_masters(spec.optim))
        self.group = group or Group()
        self.engine: DeepSpeedEngine | None = None
        if spec.optim.backend == "deepspeed":
            self.engine, self.group = deepspeed_engine(spec, drafter, self.optimizer, self.scheduler)
        self.step = 0  # optimizer steps taken (or skipped as non-finite)
        self.nonfinite_in_a_row = 0
        self.flops = FlopCounter()
        self._params = DrafterParams.of(drafter)

    @property
    def partitioned(self) -> bool:
        """True when DeepSpeed wraps the optimizer (ZeRO 1-2): its state is then per rank."""
        return self.engine is not None and self.engine.optimizer is not self.optimizer

    def train_step(self, micro_batches: list[ScoredBatch], norm: StepNorm | None = None) -> StepMetrics:
        """One optimizer step. `micro_batches` is this rank's shard of the step, `norm` the whole step's
        denominators (default: these micro-batches are the whole step). Non-finite steps are skipped, counted,
        and stop the run after `optim.max_nonfinite_steps` in a row."""
        if norm is None:
            micro_batches = self.trainable(micro_batches)
            norm = step_norm(micro_batches, self.spec.loss)
        self.optimizer.zero_grad(set_to_none=True)
        sums = reduce_sum(self._accumulate(micro_batches, norm), self.group)
        loss, acc, rej, train_flops = sums.tolist()
        num_acc, num_rej = norm.num_acc, norm.num_rej
        self.flops.drafter_train += train_flops
        lr = self.scheduler.get_last_lr()[0]
        grad_norm, skipped = (self._deepspeed_step if self.engine else self._torch_step)(math.isfinite(loss))
        if skipped:
            self.nonfinite_in_a_row += 1
            if self.nonfinite_in_a_row >= self.spec.optim.max_nonfinite_steps:
                raise OpdError(f"training stopped: {self.nonfinite_in_a_row} non-finite steps in a row at step "
                               f"{self.step} (lower optim.lr or check the data)")
        else:
            self.nonfinite_in_a_row = 0
        self.step += 1
        return StepMetrics(loss, acc, rej, num_acc, num_rej, grad_norm, lr, skipped)

    def trainable(self, micro_batches: list[ScoredBatch]) -> list[ScoredBatch]:
        """The micro-batches with the slots the drafter cannot learn dropped from `position_mask` (EAGLE-3: target
        argmax outside the draft vocabulary); a step's denominators must be taken after this."""
        out = []
        for mb in micro_batches:
            keep = (None if isinstance(mb.teacher, TopKTeacher)
                    else self.drafter.trainable_slots(mb.teacher.to(self._device)))
            out.append(mb if keep is None else replace(mb, position_mask=mb.position_mask & keep.cpu()))
        return out

    def _accumulate(self, micro_batches: list[ScoredBatch], norm: StepNorm) -> torch.Tensor:
        """Backward of each micro-batch's share of the step loss, one micro-batch on the device at a time; returns
        this rank's sums of (loss, L_acc, L_rej, the student's training FLOPs) in float64, for the all-reduce."""
        sums = torch.zeros(4, dtype=torch.float64)
        groups = self._plan(micro_batches)
        for i, group in enumerate(groups):
            batch = merge(group).to(self._device)
            if self.engine is None:
                hidden = student_hidden(self.drafter, batch)
            else:  # the last backward of the step is DeepSpeed's accumulation boundary (its reduction)
                self.engine.set_gradient_accumulation_boundary(i == len(groups) - 1)
                hidden = self.engine(batch)
            terms = self._main_loss(hidden, batch, norm)
            slots = terms.num_acc + terms.num_rej
            loss = terms.loss + self.terms.opd(self.drafter, self._slots(hidden, batch, norm), self._selects)
            if self.engine is None:
                loss.backward()
            else:  # DeepSpeed averages over ranks, so scale back up by the world size
                self.engine.backward(loss * self.group.world, scale_wrt_gas=False)
            flops = self._params.train(context=int(batch.context_valid.sum()), blocks=batch.num_blocks, slots=slots)
            if self._selects:
                flops += self._params.selector_train(slots)
            sums += torch.tensor([loss.item(), terms.acc.item(), terms.rej.item(), flops], dtype=torch.float64)
            del batch, hidden, terms  # free this micro-batch's device copy before the next arrives
        return sums.to(self._device)

    def _main_loss(self, hidden: torch.Tensor, batch: ScoredBatch, norm: StepNorm) -> LossTerms:
        """This micro-batch's share of the step's objective: the paper's KL loss, or the acceptance of drafts
        sampled from q at the serving setting (`loss.objective`)."""
        loss, chunk = self.spec.loss, self.spec.optim.loss_chunk_size
        if loss.on_acceptance:
            # the spec refuses an acceptance objective without a serving section or with a top-k teacher
            assert isinstance(batch.teacher, torch.Tensor) and self._serving is not None
            slots = block_slots(batch.block_ids[batch.block_valid], batch.accepted, batch.position_mask, loss, norm)
            return acceptance_objective(self.drafter, hidden, batch.teacher, slots, loss,
                                        serving=self._serving, teacher_processing=self._teacher,
                                        chunk_size=chunk)
        return acceptance_aware_loss(hidden, batch.teacher, batch.accepted, loss, batch.position_mask,
                                     head=self.drafter.student_head, teacher_head=self.drafter.teacher_head,
                                     norm=norm, chunk_size=chunk, teacher_processing=self._teacher)

    def _slots(self, hidden: torch.Tensor, batch: ScoredBatch, norm: StepNorm) -> OpdSlots:
        """This micro-batch as the family's own terms read it (opd/distill/family_terms.py)."""
        return OpdSlots(hidden, batch.teacher, batch.block_ids[batch.block_valid], batch.accepted, batch.position_mask,
                        self.spec.loss, norm, self._teacher, self.spec.optim.loss_chunk_size, self.spec.models.drafter)

    def _plan(self, micro_batches: list[ScoredBatch]) -> list[list[ScoredBatch]]:
        """What each forward runs: the scorer's micro-batches as they came, or with `optim.micro_batch_tokens` this
        rank's sequences repacked under the budget (opd/distill/micro_batches.py)."""
        budget = self.spec.optim.micro_batch_tokens
        if budget is None:
            return [[mb] for mb in micro_batches]
        return learner_plan(micro_batches, budget, self.drafter.block_size)

    @property
    def _device(self) -> torch.device:
        """Where collectives run: nccl needs the tensors on the GPU."""
        return next(self.drafter.parameters()).device  # the drafter's (`Drafter` has no `fc`)

    def _torch_step(self, loss_finite: bool) -> tuple[float, bool]:
        """Sum the gradients over the ranks, clip, step; (grad norm, skipped)."""
        reduce_gradients(self.drafter.parameters(), self.group)
        grad_norm = self._grad_norm(self.spec.optim.grad_clip)
        skipped = not (loss_finite and math.isfinite(grad_norm))
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        self._advance_schedule()
        return grad_norm, skipped

    def _deepspeed_step(self, loss_finite: bool) -> tuple[float, bool]:
        """The engine's step (reduction already done at the boundary backward; clipping, AdamW and the schedule
        inside). A wrapped optimizer (ZeRO 1-2) skips non-finite gradients itself; for the plain AdamW the
        reduced gradients are checked here, as on the torch path."""
        assert self.engine is not None  # the deepspeed backend's step
        if self.partitioned:
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            grad_norm, skipped = float("nan" if norm is None else norm), not self.engine.was_step_applied()
        else:
            grad_norm = self._grad_norm(0.0)  # the engine clips in its step
            skipped = not (loss_finite and math.isfinite(grad_norm))
            if skipped:
                self.engine.zero_grad()
            else:
                self.engine.step()
        if skipped:  # the engine advances the schedule only on steps it applies
            self._advance_schedule()
        return grad_norm, skipped

    def _advance_schedule(self) -> None:
        with warnings.catch_warnings():  # a skipped step still advances the schedule, on purpose
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()

    def _grad_norm(self, clip: float) -> float:
        """Total gradient norm before clipping to `clip` (0 = measure only)."""
        params = [p for p in self.drafter.parameters() if p.grad is not None]
        if not params:
            return 0.0
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        return float(norm)

    def state_dict(self) -> dict:
        """Everything to resume the optimizer. With a partitioned optimizer every rank must call it (a gather):
        rank 0 gets all ranks' parts, the others None."""
        if self.partitioned:
            assert self.engine is not None
            optimizer = gather(self.engine.optimizer.state_dict(), self.group)
        else:
            optimizer = self.optimizer.state_dict()
        return {"optimizer": optimizer, "scheduler": self.scheduler.state_dict(),
                "step": self.step, "nonfinite_in_a_row": self.nonfinite_in_a_row, "flops": self.flops.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.partitioned:  # all ranks' parts; DeepSpeed picks this rank's, fp32 master weights included
            assert self.engine is not None
            self.engine.optimizer.load_state_dict(state["optimizer"], load_from_fp32_weights=True)
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.nonfinite_in_a_row = state["step"], state["nonfinite_in_a_row"]
        flops = dict(state["flops"])
        flops.pop("total", None)
        self.flops = FlopCounter(**flops)


def step_norm(micro_batches: list[ScoredBatch], loss: LossSpec) -> StepNorm:
    """The step's loss denominators from its micro-batches' acceptance counts (small tensors; no forward)."""
    return StepNorm.of(((mb.accepted, mb.position_mask) for mb in micro_batches), loss)
