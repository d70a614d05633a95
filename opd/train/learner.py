"""The learner: the trainable drafter, its optimizer and schedule, one acceptance-aware step at a time.

Shared by the single-process loop and the Ray `LearnerActor`, so both paths take bit-identical steps.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from opd.errors import OpdError
from opd.losses import acceptance_aware_loss
from opd.models.drafter import DFlashDrafter
from opd.replay import ScoredBatch, student_logits
from opd.spec import ExperimentSpec, OptimSpec
from opd.train.flops import FlopCounter, drafter_matmul_params


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


def build_optimizer(drafter: DFlashDrafter, optim: OptimSpec, total_steps: int, lr: float | None = None):
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr or optim.lr, betas=tuple(optim.betas),
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
    def __init__(self, spec: ExperimentSpec, drafter: DFlashDrafter) -> None:
        self.spec, self.drafter = spec, drafter
        self.drafter.train()
        self.optimizer, self.scheduler = build_optimizer(drafter, spec.optim, spec.steps)
        self.step = 0  # optimizer steps taken (or skipped as non-finite)
        self.nonfinite_in_a_row = 0
        self.flops = FlopCounter()
        self._params = drafter_matmul_params(drafter)

    def train_step(self, micro_batches: list[ScoredBatch]) -> StepMetrics:
        """One optimizer step over micro-batches (gradients averaged); non-finite steps are skipped, counted, and
        stop the run after `optim.max_nonfinite_steps` in a row."""
        self.optimizer.zero_grad(set_to_none=True)
        totals = torch.zeros(3, dtype=torch.float64)
        num_acc = num_rej = 0
        for batch in micro_batches:
            accepted, position_mask, teacher = batch.flat_blocks()
            logits = student_logits(self.drafter, batch)
            terms = acceptance_aware_loss(logits, teacher, accepted, self.spec.loss, position_mask)
            (terms.loss / len(micro_batches)).backward()
            totals += torch.tensor([terms.loss.item(), terms.acc.item(), terms.rej.item()], dtype=torch.float64)
            num_acc, num_rej = num_acc + terms.num_acc, num_rej + terms.num_rej
            self.flops.add_drafter(self._params, logits.shape[0] * self.drafter.block_size, train=True)
        loss, acc, rej = (totals / len(micro_batches)).tolist()
        grad_norm = self._grad_norm()
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        lr = self.scheduler.get_last_lr()[0]
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_in_a_row += 1
            if self.nonfinite_in_a_row >= self.spec.optim.max_nonfinite_steps:
                raise OpdError(f"training stopped: {self.nonfinite_in_a_row} non-finite steps in a row at step "
                               f"{self.step} (lower optim.lr or check the data)")
        else:
            self.nonfinite_in_a_row = 0
            self.optimizer.step()
        with warnings.catch_warnings():  # a skipped step still advances the schedule, on purpose
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        self.step += 1
        return StepMetrics(loss, acc, rej, num_acc, num_rej, grad_norm, lr, skipped)

    def _grad_norm(self) -> float:
        clip = self.spec.optim.grad_clip
        params = [p for p in self.drafter.parameters() if p.grad is not None]
        if not params:
            return 0.0
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        return float(norm)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "step": self.step, "nonfinite_in_a_row": self.nonfinite_in_a_row, "flops": self.flops.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.nonfinite_in_a_row = state["step"], state["nonfinite_in_a_row"]
        flops = dict(state["flops"])
        flops.pop("total", None)
        self.flops = FlopCounter(**flops)
