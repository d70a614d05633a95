"""AdamW on fp32 master weights for a half-precision drafter: bf16 compute and bf16 published weights, fp32 updates.

A bf16 weight of 1.0 moves only when an update exceeds half its ulp (0.002 below 1.0, 0.004 above), so AdamW run on
the bf16 parameters themselves rounds every step of lr 3e-4 away: RMSNorm weights never move and small updates
vanish as the schedule decays. `MasterWeights` keeps an fp32 copy of each parameter, steps AdamW (fp32 states) on
the copies with the model's gradients, and rounds the copies back into the model after every step.

Memory per trained parameter: bf16 weight and gradient (2 + 2 bytes), fp32 master and AdamW's two moments
(4 + 4 + 4); during `step` the fp32 copy of the gradient adds 4 more: 16 bytes held, 20 at the step's peak
(plain AdamW on an fp32 drafter: 16).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from opd.errors import OpdError

HALF = (torch.bfloat16, torch.float16)


def adamw(params: Iterable[torch.nn.Parameter], *, masters: bool = True, **options: Any) -> torch.optim.Optimizer:
    """AdamW for `params`: on fp32 masters when they are half precision (and `masters`: False when a wrapper such as
    DeepSpeed ZeRO keeps its own), else plain torch AdamW, exactly as before."""
    params = list(params)
    if masters and any(p.dtype in HALF for p in params):
        return MasterWeights(params, **options)
    return torch.optim.AdamW(params, **options)


class MasterWeights(torch.optim.Optimizer):
    """AdamW on fp32 copies of half-precision parameters, behaving as a torch optimizer towards its callers.

    Backward writes gradients into the model's parameters as usual (callers may reduce and clip them there);
    `step` copies them into the masters in fp32, steps AdamW there and writes the rounded masters back.
    `param_groups` and `state` are the inner AdamW's, so an LR scheduler drives it. The model's weights must
    change only through `step` and `load_state_dict`: the masters are the weights, the model holds their
    rounding. `state_dict` holds the masters, which a checkpoint's bf16 drafter tensors cannot restore.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], **options: Any) -> None:
        self.model_params = list(params)
        self.masters = [p.detach().to(torch.float32, copy=True) for p in self.model_params]
        self.adamw = torch.optim.AdamW(self.masters, **options)
        super().__init__(self.masters, self.adamw.defaults)
        self._share()

    def _share(self) -> None:
        """Expose the inner AdamW's groups and state (again after it loads a state dict, which replaces them)."""
        self.param_groups, self.state = self.adamw.param_groups, self.adamw.state

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]  # a closure is refused, so only this form
        """AdamW on the masters with the model's gradients (in fp32), then the model takes the rounded masters."""
        if closure is not None:
            raise OpdError("MasterWeights.step: a closure is not supported (expected None)")
        for param, master in zip(self.model_params, self.masters):
            master.grad = None if param.grad is None else param.grad.to(torch.float32)
        self.adamw.step()
        for param, master in zip(self.model_params, self.masters):
            master.grad = None  # the fp32 gradient copy lives only during the step
            param.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.model_params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state on the masters and the masters themselves (references, as torch optimizers return)."""
        return {"adamw": self.adamw.state_dict(), "masters": list(self.masters)}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore AdamW and the masters, and write the masters into the model."""
        masters = state_dict.get("masters")
        if masters is None or [m.shape for m in masters] != [m.shape for m in self.masters]:
            raise OpdError("optimizer state: no fp32 master weights that fit this drafter (expected "
                           f"{len(self.masters)} tensors shaped like its parameters; a bf16 checkpoint written "
                           "before master weights cannot resume)")
        self.adamw.load_state_dict(state_dict["adamw"])
        self._share()
        for param, master, saved in zip(self.model_params, self.masters, masters):
            master.copy_(saved)
            param.copy_(master)
