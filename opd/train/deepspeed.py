"""DeepSpeed ZeRO for the learner (`optim.backend: deepspeed`): the config the spec implies and the engine around
the drafter's replay forward. `Learner` (opd/train/learner.py) drives the engine; DeepSpeed itself is imported only
when an engine is built.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from opd.distill.replay import student_hidden
from opd.distill.scored_batch import ScoredBatch
from opd.errors import OpdError
from opd.models.protocol import Drafter
from opd.spec import ExperimentSpec, OptimSpec
from opd.train.distributed import Group, ensure_group

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


class _Student(torch.nn.Module):
    """The drafter's replay forward as a module, so DeepSpeed's engine runs it (its backward hooks need that)."""

    def __init__(self, drafter: Drafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: ScoredBatch) -> torch.Tensor:
        return student_hidden(self.drafter, batch)


def zero_keeps_masters(optim: OptimSpec) -> bool:
    """Whether DeepSpeed keeps the fp32 master weights: ZeRO 1-2 step the client AdamW on fp32 partitions whatever
    the drafter's dtype. At stage 0 the client optimizer keeps them (opd/train/master_weights.py)."""
    return optim.backend == "deepspeed" and optim.zero_stage > 0


def deepspeed_config(spec: ExperimentSpec, world: int) -> dict:
    """The DeepSpeed config the spec implies: ZeRO stage, clipping, the torch AdamW accepted under ZeRO.

    A bf16 drafter under ZeRO 1-2 turns on DeepSpeed's bf16 mode on any device (fp32 master partitions, bf16 gradient
    reduction, non-finite steps skipped). At stage 0 it stays off: its bf16 wrapper rescales the gradients (AdamW's
    first update comes out smaller than the torch learner's on the micro drafter; measured when this was written, commit
    9294bd8, and held in no file of bench/results), so the client optimizer steps fp32 masters itself and the engine
    only reduces and clips."""
    o = spec.optim
    return {"train_micro_batch_size_per_gpu": o.micro_batch_size,
            "gradient_accumulation_steps": o.batch_size // (o.micro_batch_size * world),
            "zero_optimization": {"stage": o.zero_stage}, "zero_allow_untested_optimizer": True,
            "gradient_clipping": o.grad_clip,
            "bf16": {"enabled": spec.models.dtype == "bfloat16" and zero_keeps_masters(o)}}


def deepspeed_engine(spec: ExperimentSpec, drafter: Drafter, optimizer, scheduler) -> tuple[DeepSpeedEngine, Group]:
    """`deepspeed.initialize` around the drafter with our AdamW and LR lambda as client optimizer/scheduler, in
    the current learner process group (a one-rank group when there is none: DeepSpeed always wants one)."""
    if spec.optim.zero_stage == 3:
        raise OpdError("optim.zero_stage: 3 is not supported (ZeRO-3 partitions the drafter's weights, which "
                       "evaluation, weight publishing and checkpoints read whole; expected 0, 1 or 2)")
    try:
        import deepspeed
    except ImportError:
        raise OpdError("optim.backend: deepspeed needs DeepSpeed, which is not installed "
                       "(pip install -e .[gpu])") from None
    group = ensure_group(next(drafter.parameters()).device)  # the drafter's device (`Drafter` has no `fc`)
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed insists; each learner rank drives its device 0
    engine, *_ = deepspeed.initialize(model=_Student(drafter), optimizer=optimizer, lr_scheduler=scheduler,
                                      config=deepspeed_config(spec, group.world))
    return engine, group
