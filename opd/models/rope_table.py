"""The target's rotary embeddings for a verified block, sliced from a table kept across steps.

transformers' decoders call their rotary module once per forward (once per layer type where RoPE differs by type,
as in Gemma 4) on the position ids they are given, and hand the result to every layer. That is a dozen small
operations per verify step, as many as a batch-1 step spends on its own bookkeeping. Where every row of the block
sits at the same positions length, length + 1, ... (`Target.ready_block`'s condition), the module's output is a
slice of its output over positions 0..capacity: each element of cos and sin is formed from its own position alone
(a product with the inverse frequency, cos or sin, the attention scaling, a cast), so the table holds the values
the module would form (`tests/test_target.py` compares them, and the logits, with `torch.equal`). RoPE types that
change with the sequence length (transformers' `dynamic_rope_update`: dynamic NTK, LongRoPE) get no table.

The module's forward is replaced once by a dispatcher that slices only while this thread runs a block it was given
(`RopeTable.given`): an actor that decodes on one thread and evaluates on another shares one model (as
opd/models/deltanet.py's kernels). A compiled forward traces the module's own forward.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from opd.models.deltanet import thread_setting

_LOCAL = threading.local()  # .block: (the RopeTable, length, block) while this thread's forward runs a given block
TABLE_STEP = 256  # a table's capacity is a multiple of this, at least twice the positions asked for


class RopeTable:
    """The rotary module `module` of a target's decoder, with its outputs over positions 0..capacity kept per
    (extra arguments, dtype, device)."""

    def __init__(self, module: nn.Module) -> None:
        self.inner = module.forward
        self.tables: dict[tuple, tuple[int, Any]] = {}
        module.forward = self._forward

    @classmethod
    def of(cls, decoder: nn.Module) -> RopeTable | None:
        """The table of `decoder.rotary_emb`, or None without one or where its RoPE changes with the length."""
        module = getattr(decoder, "rotary_emb", None)
        types = getattr(module, "rope_type", None)
        if module is None or types is None:
            return None
        if any("dynamic" in t or t == "longrope" for t in (types.values() if isinstance(types, dict) else [types])):
            return None
        return cls(module)

    @contextmanager
    def given(self, length: int, block: int) -> Iterator[None]:
        """Within it, this thread's forwards over `block` positions take them as length .. length + block − 1."""
        with thread_setting(_LOCAL, "block", (self, length, block)):
            yield

    def _forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        given = getattr(_LOCAL, "block", None)
        if torch.compiler.is_compiling() or given is None or given[0] is not self:
            return self.inner(x, *args, **kwargs)
        _, length, block = given
        keyword = "position_ids" in kwargs
        if (kwargs["position_ids"] if keyword else args[0]).shape[-1] != block:
            return self.inner(x, *args, **kwargs)
        extra = {name: value for name, value in kwargs.items() if name != "position_ids"}
        table = self._table(x, length + block, args if keyword else args[1:], extra)
        if isinstance(table, torch.Tensor):
            return table[:, length : length + block]
        return tuple(t[:, length : length + block] for t in table)

    def _table(self, x: torch.Tensor, needed: int, rest: tuple, kwargs: dict[str, Any]) -> Any:
        """The module's output over positions 0..capacity (capacity ≥ needed) for these extra arguments."""
        key = (rest, tuple(sorted(kwargs.items())), x.dtype, x.device)
        capacity, table = self.tables.get(key, (0, None))
        if capacity < needed:
            capacity = -(-2 * needed // TABLE_STEP) * TABLE_STEP
            table = self.inner(x, torch.arange(capacity, device=x.device)[None], *rest, **kwargs)
            self.tables[key] = (capacity, table)
        return table
