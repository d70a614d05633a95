"""Tensors that pickle as numpy arrays, so Ray's object store moves them zero-copy.

Ray pickles with protocol 5 and hands numpy arrays' buffers to the object store out of band: a `get` on the same node
maps them instead of copying. A torch tensor instead goes through torch's storage pickling, which is slower
(bench/results/scale.md's object-store runs and scale.json's `once`: a scored batch and a drafter publish, zero-copy
against torch pickling). Dataclasses that cross the object store inherit `ZeroCopy`; tensors must be on the CPU (they
are made contiguous here).

Numpy has no bfloat16, so such tensors travel as a same-width integer view and are viewed back on arrival. The
arrays a `get` returns are read-only views of the object store: consumers copy (e.g. `.to(device)`,
`load_state_dict`) and never write in place.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_CARRIER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width views for numpy


@dataclass
class _Array:
    """A tensor on the wire: its bytes as a numpy array (a view, no copy) and the dtype to view them as."""

    array: np.ndarray
    dtype: torch.dtype


def encode(value: Any) -> Any:
    """Tensors (also inside dicts, lists and tuples) as `_Array`s; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        t = value.detach().contiguous()
        if t.device.type != "cpu":
            raise ValueError(f"zero-copy pickling needs CPU tensors, got one on {t.device}")
        carrier = t if _numpy_has(t.dtype) else t.view(_CARRIER[t.element_size()])
        return _Array(carrier.numpy(), t.dtype)
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(encode(v) for v in value)
    return value


def decode(value: Any) -> Any:
    if isinstance(value, _Array):
        with warnings.catch_warnings():  # a mapped object-store buffer is read-only; nothing writes to it
            warnings.filterwarnings("ignore", message=".*not writable.*")
            t = torch.from_numpy(value.array)
        return t if t.dtype == value.dtype else t.view(value.dtype)
    if isinstance(value, dict):
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(decode(v) for v in value)
    return value


def _numpy_has(dtype: torch.dtype) -> bool:
    return dtype not in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


class ZeroCopy:
    """Mixin for dataclasses whose tensors cross the object store: pickled as numpy buffers, not torch storages."""

    def __getstate__(self) -> dict[str, Any]:
        return {k: encode(v) for k, v in vars(self).items()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({k: decode(v) for k, v in state.items()})
