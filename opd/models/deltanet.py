"""transformers' delta-rule layers (Qwen3.5's Gated DeltaNet, Kimi Linear's Kimi Delta Attention) as the decoder's
rollback and packed replay reach them: the layer modules, their delta rule kernels, and the conv window a cache
keeps. A kind names its modules and kernels (`DeltaRule`); the code around them is shared.

Such a layer's forward calls two module-level kernels of its modeling file, a chunked one for a sequence and a
recurrent one for a single token, each taking (query, key, value, g, beta, initial_state, output_final_state, ...)
with g the log decay per position (and head, and key channel where the decay is per channel). The rollback (opd/models/recurrent_rollback.py) needs each call's inputs, and
packed replay (opd/models/linear_replay.py) the states along the text, so both run their own code around those
kernels. That code is installed once, as a dispatcher in place of each kernel name, and is chosen per thread
(`DeltaNetKernels.wrapped`): an actor that decodes on one thread and evaluates on another shares one model, and a
swap of the module's names for the length of one forward would hand the other thread's kernel calls to it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from opd.errors import OpdError

_LOCAL = threading.local()  # .wrap: this thread's `Wrap`, or absent
Wrap = Callable[[Callable, Callable], Callable]  # (kernel, recurrent kernel) -> what runs in the kernel's place


@dataclass(frozen=True)
class DeltaRule:
    """How transformers names one delta-rule kind's modules (their class names end with `module`) and the
    module-level kernels their forward calls (`chunked`, `recurrent`)."""

    label: str
    module: str
    chunked: str
    recurrent: str


class DeltaNetKernels:
    """A target's delta-rule modules of one kind, in layer order, and their kernels (the originals, and a
    per-thread way to run code in their place)."""

    def __init__(self, model: nn.Module, layers: tuple[int, ...], rule: DeltaRule) -> None:
        self.layers = list(layers)
        self.modules = [m for m in model.modules() if type(m).__name__.endswith(rule.module)]
        files = {sys.modules[type(m).__module__] for m in self.modules}
        kernels = [f for f in files if hasattr(f, rule.chunked) and hasattr(f, rule.recurrent)]
        if len(self.modules) != len(self.layers) or len(kernels) != len(files) or len(files) != 1:
            raise OpdError(f"target {type(model).__name__}: its 'linear_attention' layers {self.layers} are not all "
                           f"{rule.label} layers with transformers' {rule.chunked} and {rule.recurrent} kernels, "
                           "which the decoder and packed replay run from each row's own state "
                           "(docs/guides/target-layer-kind.md)")
        self.chunked, self.recurrent = _install(kernels[0], rule)

    @contextmanager
    def wrapped(self, wrap: Wrap) -> Iterator[None]:
        """On this thread, every call of either kernel runs `wrap(kernel, recurrent)` instead; other threads run
        the kernels as they are."""
        with thread_setting(_LOCAL, "wrap", wrap):
            yield


@contextmanager
def thread_setting(local: threading.local, name: str, value: Any) -> Iterator[None]:
    """`local.name` is `value` on this thread within the block, and what it was after."""
    previous = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, previous)


def _install(module: Any, rule: DeltaRule) -> tuple[Callable, Callable]:
    """Put the dispatchers in place of the modeling file's kernels once; the original (chunked, recurrent)."""
    originals = getattr(module, "_opd_kernels", None)
    if originals is None:
        originals = (getattr(module, rule.chunked), getattr(module, rule.recurrent))
        setattr(module, rule.chunked, _dispatcher(originals[0], originals[1]))
        setattr(module, rule.recurrent, _dispatcher(originals[1], originals[1]))
        module._opd_kernels = originals
    return originals


def _dispatcher(kernel: Callable, recurrent: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        wrap = getattr(_LOCAL, "wrap", None)
        return kernel(*args, **kwargs) if wrap is None else wrap(kernel, recurrent)(*args, **kwargs)

    return run


def per_position(flags: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Bool flags [B, T] as `like`'s dtype, shaped to multiply a kernel input [B, T, ...] (a gate per head, or per
    head and key channel) position by position."""
    return flags.view(*flags.shape, *[1] * (like.dim() - 2)).to(like.dtype)


def conv_window(inputs: torch.Tensor, rows: torch.Tensor, ends: torch.Tensor, kernel: int) -> torch.Tensor:
    """The conv state a Gated DeltaNet cache holds after the first ends[i] of a recorded sequence of conv inputs
    `inputs` [B, C, T], for row rows[i]: its last `kernel` inputs up to there, zeros before the first (as a fresh
    state starts), [len(rows), C, kernel]. Gathers only those columns, never a row's whole history."""
    padded = torch.nn.functional.pad(inputs, (kernel, 0))
    columns = ends[:, None] + torch.arange(kernel, device=ends.device)  # padded coordinates: end - kernel + kernel
    return padded.transpose(1, 2)[rows[:, None], columns].transpose(1, 2).contiguous()
