"""The frozen, shared LM head applied over many slots a chunk at a time: no [slots, V] tensor is formed whole.

At Qwen3's 151,936-token vocabulary one slot's logits are 0.6 MB in fp32, so a 2048-token response's drafted
slots (or a sequence's positions) would need gigabytes at once. Every place that turns hidden states into
something vocabulary-sized (the losses, SFT, random-anchor drafts, top-k teachers, the acceptance diagnostic)
goes through here: it forms the logits of `chunk` rows, reduces them with the caller's function (an argmax, top-k
log-probs, a per-row loss) and drops them before the next chunk.

A target that soft-caps its logits (Gemma's `final_logit_softcapping`) applies the cap in its forward, after the
head: `teacher_head` is its head with that cap, so a teacher formed from final-norm hidden states is the target's
own distribution.

`map_slots` is for reductions without gradient. `chunked_loss` is sum_r coef_r loss_r with the gradient w.r.t. the
hidden rows: each chunk's gradient is taken right away, so only one chunk's vocabulary-sized tensors (and their
autograd graph) are alive at a time; backward hands back the stored row gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn

# Slots whose [slots, vocabulary] logits a reduction without gradient forms at once (argmax, top-k, the
# acceptance diagnostic): ~0.16 GB in fp32 at Qwen3's 151,936 tokens. Losses take optim.loss_chunk_size instead.
SLOTS_PER_CHUNK = 256

# (logits [C, V] of rows `part`, part) -> one result per row, [C, ...] (or a tuple of them)
Reduce = Callable[[torch.Tensor, slice], torch.Tensor | tuple[torch.Tensor, ...]]
RowLoss = Callable[[torch.Tensor, slice], torch.Tensor]  # (logits [C, V] of rows `part`, part) -> loss per row [C]


class SoftcappedHead(nn.Module):
    """An LM head followed by cap · tanh(logits / cap), in the logits' dtype and transformers' order."""

    def __init__(self, lm_head: nn.Module, cap: float) -> None:
        super().__init__()
        self.lm_head, self.cap = lm_head, cap

    @property
    def weight(self) -> torch.Tensor:
        """The head's weight (callers cast hidden rows to its dtype)."""
        return cast(torch.Tensor, self.lm_head.weight)  # nn.Module attributes are typed Tensor | Module

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(self.lm_head(hidden), self.cap)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap · tanh(logits / cap): logits bounded by ±cap, nearly unchanged well inside."""
    return torch.tanh(logits / cap) * cap


def teacher_head(target: Any) -> nn.Module:
    """Final-norm hidden -> the target's logits: a `Target`'s or `SharedHead`'s LM head, soft-capped where the
    target's config caps its logits (`final_logit_softcapping`, Gemma's 30)."""
    config = target.config.get_text_config(decoder=True)
    cap = getattr(config, "final_logit_softcapping", None)
    return SoftcappedHead(target.lm_head, float(cap)) if cap else target.lm_head


def apply_head(head: nn.Module | None, hidden: torch.Tensor) -> torch.Tensor:
    """The head's logits of hidden rows (cast to the head's dtype); `head` None means the rows already are
    logits (tests, and losses handed logits)."""
    return hidden if head is None else head(hidden.to(cast(torch.Tensor, head.weight).dtype))


def chunks(rows: int, chunk: int) -> Iterator[slice]:
    """Consecutive slices of at most `chunk` rows covering 0..rows."""
    for start in range(0, rows, max(1, chunk)):
        yield slice(start, start + chunk)


@torch.no_grad()
def map_slots(head: nn.Module | None, hidden: torch.Tensor, reduce: Reduce,
              chunk: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """`reduce` of the logits of every slot of hidden [..., H], `chunk` slots at a time, reshaped back to the
    leading dims: [..., *per_row] (a tuple when `reduce` returns one). `part` indexes the flattened slots."""
    lead, flat = hidden.shape[:-1], hidden.reshape(-1, hidden.shape[-1])
    outs = [reduce(apply_head(head, flat[part]), part) for part in chunks(flat.shape[0], chunk)]
    if not outs:  # no slot: reduce an empty chunk so the result still has its trailing shape and dtype
        outs = [reduce(apply_head(head, flat[:0]), slice(0, 0))]
    if isinstance(outs[0], tuple):
        return tuple(_cat([o[i] for o in outs], lead) for i in range(len(outs[0])))
    return _cat(cast(list[torch.Tensor], outs), lead)  # `reduce` returns one kind: tensors here


def _cat(parts: list[torch.Tensor], lead: torch.Size) -> torch.Tensor:
    out = torch.cat(parts)
    return out.reshape(*lead, *out.shape[1:])


def argmax(head: nn.Module | None, hidden: torch.Tensor, chunk: int) -> torch.Tensor:
    """argmax token [...] of each slot of hidden [..., H] (the point-mass draft)."""
    out = map_slots(head, hidden, lambda lg, _: lg.argmax(-1), chunk)
    assert isinstance(out, torch.Tensor)  # a reduce returning one tensor maps to one tensor
    return out


def chunked_loss(head: nn.Module | None, rows: torch.Tensor, row_loss: RowLoss, coef: torch.Tensor,
                 chunk: int, params: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_r coef_r loss_r, differentiable w.r.t. hidden rows [R, ...] and the head's trainable parameters, if
    any (an EAGLE-3 drafter's own head), and `params`, parameters `row_loss` reads itself (DFlash 2's selector);
    every loss_r detached, [R] float64).

    `row_loss` sees the logits of one chunk of rows (the rows themselves when `head` is None); `coef` [R] are fixed
    weights (float64). The loss has the row losses' compute dtype (fp32 for bf16 rows)."""
    own = [] if head is None else [p for p in head.parameters() if p.requires_grad]
    return _ChunkedLoss.apply(rows, head, row_loss, coef, chunk, *own, *params)


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, head: nn.Module | None, row_loss: RowLoss, coef: torch.Tensor,
                chunk: int, *params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grad = torch.zeros_like(rows) if ctx.needs_input_grad[0] else None
        param_grads = [torch.zeros_like(p) for p in params]
        per_row = torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
        total = torch.zeros((), dtype=torch.float64, device=rows.device)
        dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32  # used when there is no row
        for part in chunks(rows.shape[0], chunk):
            x = rows[part].detach().requires_grad_(grad is not None)
            with torch.enable_grad():
                values = row_loss(apply_head(head, x), part)
                loss, dtype = (coef[part].to(values.device, values.dtype) * values).sum(), values.dtype
            wrt = ([x] if grad is not None else []) + list(params)
            if wrt and loss.requires_grad:
                grads = list(torch.autograd.grad(loss, wrt, allow_unused=True))
                if grad is not None:
                    grad[part] = grads.pop(0)
                for acc, g in zip(param_grads, grads):
                    if g is not None:
                        acc += g
            total += loss.detach().to(torch.float64)
            per_row[part] = values.detach().to(torch.float64)
        ctx.has_rows_grad = grad is not None
        ctx.save_for_backward(*([grad] if grad is not None else []), *param_grads)
        ctx.mark_non_differentiable(per_row)
        return total.to(dtype), per_row

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_rows: torch.Tensor):
        saved = list(ctx.saved_tensors)
        grad = saved.pop(0) if ctx.has_rows_grad else None
        scaled = [g * grad_loss.to(g.dtype) for g in saved]
        return (None if grad is None else grad * grad_loss.to(grad.dtype)), None, None, None, None, *scaled
