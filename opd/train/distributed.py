"""Data parallelism for the learner: `resources.learner.replicas` ranks, one torch.distributed process group.

Rank 0 collects a step's micro-batches and hands each rank a contiguous shard (`shard`). Every rank scales its
micro-batch losses by 1/(micro-batches in the whole step), so summing the gradients over ranks (`reduce_sum`,
`reduce_gradients`) gives exactly the single-learner full-batch gradient, whatever the shard sizes; each rank
then takes the identical optimizer step. Backend gloo on CPU, nccl with CUDA. No Ray here: the actors only pass
the address and the shards.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from opd.spec import ExperimentSpec

T = TypeVar("T")

# A learner rank waits in a collective while rank 0 evaluates or checkpoints; a dead peer still fails it sooner. A run
# passes its own (`resources.restarts.collective_timeout_s`): a peer that stopped fails the collective after it.
TIMEOUT = timedelta(hours=2)


@dataclass(frozen=True)
class Group:
    """This process's place among the learner ranks (the process group itself is torch.distributed's default)."""

    rank: int = 0
    world: int = 1


def backend(device: torch.device | str) -> str:
    """nccl between GPU learners, gloo when the drafter lives on the CPU (even on a machine with GPUs)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_address(host: str = "127.0.0.1") -> str:
    """host:port with a port free right now, for rank 0 to listen on (the usual small race with other binders)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def init_group(address: str, rank: int, world: int, device: torch.device | str,
               timeout: timedelta = TIMEOUT) -> Group:
    """Join the learner ranks' process group at `address` (rank 0's host:port); blocks until all `world` joined.
    Every collective of the group fails after `timeout` (gloo's error names the operation)."""
    dist.init_process_group(backend(device), init_method=f"tcp://{address}", rank=rank, world_size=world,
                            timeout=timeout)
    return Group(rank, world)


def collective_timeout(spec: ExperimentSpec) -> timedelta:
    """The run's limit on one collective (`resources.restarts.collective_timeout_s`)."""
    return timedelta(seconds=spec.resources.restarts.collective_timeout_s)


def ensure_group(device: torch.device | str) -> Group:
    """The current group, or a fresh one-rank group: DeepSpeed needs a process group even for one learner."""
    if not dist.is_initialized():
        return init_group(free_address(), 0, 1, device)
    return Group(dist.get_rank(), dist.get_world_size())


def shard(items: Sequence[T], rank: int, world: int) -> list[T]:
    """Rank `rank`'s contiguous share of `items`: sizes differ by at most one, the first ranks take the extras,
    and concatenating the shards in rank order gives `items` back."""
    base, extra = divmod(len(items), world)
    start = rank * base + min(rank, extra)
    return list(items[start : start + base + (rank < extra)])


def reduce_sum(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum `tensor` over the ranks, in place (a no-op for one rank)."""
    if group.world > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def reduce_gradients(params: Iterable[torch.nn.Parameter], group: Group) -> None:
    """Sum the trainable parameters' gradients over the ranks in one flat all-reduce. A rank that had no
    gradient for a parameter contributes zeros, so every rank ends with the same gradients."""
    if group.world == 1:
        return
    params = [p for p in params if p.requires_grad]
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = torch.cat([g.reshape(-1) for g in grads])
    try:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    except RuntimeError as exc:  # a learner rank died or stopped: the line names the collective, not only gloo's op
        first = (str(exc).strip().splitlines() or [""])[0]
        raise RuntimeError(f"{first} (in the learner's gradient all-reduce)") from exc
    for grad, g in zip(grads, flat.split([p.numel() for p in params])):
        grad.copy_(g.view_as(grad))


def gather(obj: object, group: Group) -> list[object] | None:
    """Every rank's `obj` in rank order, on rank 0 (None elsewhere): e.g. ZeRO's per-rank optimizer partitions,
    which only rank 0 writes to the checkpoint."""
    if group.world == 1:
        return [obj]
    out: list[object] | None = [None] * group.world if group.rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out
