"""Packed replay through a hybrid target's linear-attention layers (Qwen3.5's Gated DeltaNet): each drafted block
runs from the layer's state at its anchor.

A packed row is the committed text followed by every drafted block (opd/distill/replay.py). Attention layers read
that layout from the mask; a linear-attention layer reads no mask and would run the row as one sequence, carrying
block m's state into block m+1. So, while a packed forward runs, each Gated DeltaNet module runs in two parts, both
through its own forward (transformers' projections, conv, kernels, gated norm):

1. **The text**, over every row's prefix, with a cache that keeps its conv inputs (`activate_past_recording`) and
   with the chunked kernel run `SEGMENT` positions at a time from the previous segment's state: the same work as
   one call, and it leaves the recurrent state at every multiple of `SEGMENT`. The kernel's inputs (q, k, v, gate,
   write strength) are kept too, about heads·(2·dk + dv + 2) values a token.
2. **The blocks**, a group at a time: each block's recurrent state at its anchor is its segment's state advanced
   over the rest of the segment up to the anchor (< `SEGMENT` positions: one chunked-kernel call of `SEGMENT`
   positions for the whole group, left-padded positions with gate and write strength zeroed, so the state passes
   them unchanged), and its conv state is the last conv inputs up to the anchor. A cache seeded with those
   (transformers' own `DynamicCache`) is what the module's forward over the group's blocks continues from, as
   decoding continues a verified block.

The alternatives cost more: keeping the state at every anchor holds heads·dk·dv values per block (2 MB a block a
layer at Qwen3.5-9B) for the whole text, and a forward per block re-runs the text. What this adds over one causal
forward of the same rows is `SEGMENT` positions of kernel work a block, no projection, and a state per block in
flight (`GROUP_BYTES` bounds a group). transformers' torch kernel pads every call to its chunk (64 positions), so
the segments, advances and block calls pass it a chunk of `SEGMENT` (`chunked_by_segment`): 64-position segments
and chunks do four times the kernel work per block (what packed replay costs against one causal forward:
bench/linear_replay.py).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from opd.models.deltanet import DeltaNetKernels, conv_window, per_position, thread_setting
from opd.models.packed_attention import PackedRows

SEGMENT = 16  # text positions per kernel call (states at its multiples), a block's longest advance, and the chunk
GROUP_BYTES = 1 << 30  # a group of blocks' transient kernel memory (states, advanced inputs) per layer
_LOCAL = threading.local()  # .rows: the PackedRows of the packed forward running on this thread


@dataclass
class TextRecord:
    """What one linear layer keeps of the text while its blocks run: the kernel's inputs [B, P, heads, ...] and
    keyword arguments, and the recurrent state after every `SEGMENT` positions [B, P // SEGMENT + 1, heads, dk, dv]
    (`_segmented` fills it)."""

    query: torch.Tensor | None = None
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    g: torch.Tensor | None = None
    beta: torch.Tensor | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    states: torch.Tensor | None = None


class LinearReplay:
    """Installs, once per target, a forward on its Gated DeltaNet modules that runs a packed layout (`packed`) as
    above and anything else as before."""

    def __init__(self, model: nn.Module, kernels: DeltaNetKernels) -> None:
        self.config = model.config
        self.kernels = kernels
        for module in self.kernels.modules:
            if not getattr(module, "_opd_packed", False):
                module.forward = _dispatching(module, self)
                module._opd_packed = True  # type: ignore[assignment]  # Module.__setattr__ is typed for tensors/modules

    @contextmanager
    def packed(self, rows: PackedRows) -> Iterator[None]:
        """Within it, this thread's linear layers run `rows` (prefix, then blocks from their anchors)."""
        with thread_setting(_LOCAL, "rows", rows):
            yield

    def layer(self, module: nn.Module, forward: Callable, rows: PackedRows, hidden: torch.Tensor,
              **kwargs: Any) -> torch.Tensor:
        """One Gated DeltaNet layer over packed rows: hidden [B, L, H] in, its output [B, L, H] out (zeros at
        padding)."""
        prefix = max(row.prefix_len for row in rows.rows)
        cache = DynamicCache(config=self.config)
        cache.activate_past_recording()
        text = TextRecord()
        with self.kernels.wrapped(_segmented(text)):
            out_text = forward(hidden[:, :prefix], cache=cache, **kwargs)
        out = hidden.new_zeros(*hidden.shape[:2], out_text.shape[-1])
        for i, row in enumerate(rows.rows):
            out[i, : row.prefix_len] = out_text[i, : row.prefix_len]
        inputs = cache.layers[module.layer_idx].conv_states[0]  # [B, C, prefix]: every conv input of the text
        batch_rows, anchors, starts = _blocks(rows, hidden.device)
        if not len(anchors):
            return out
        span = next(row.span for row in rows.rows if len(row.anchors))
        offsets = torch.arange(span, device=hidden.device)
        for group in torch.arange(len(anchors), device=hidden.device).split(self._group_size(text)):
            b, a = batch_rows[group], anchors[group]
            seeded = self._seeded(module, conv_window(inputs, b, a + 1, cast(int, module.conv_kernel_size)),
                                  self._anchor_states(text, b, a))
            where = (b[:, None], starts[group][:, None] + offsets)
            with self.kernels.wrapped(lambda kernel, _recurrent: chunked_by_segment(kernel)):
                out[where] = forward(hidden[where], cache=seeded, **kwargs)
        return out

    def _anchor_states(self, text: TextRecord, rows: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Recurrent states after each anchor (inclusive) of the text: its segment's state, advanced over the
        segment's positions up to the anchor in one chunked call (earlier window positions pass no change)."""
        assert (text.states is not None and text.query is not None and text.key is not None and text.value is not None
                and text.g is not None and text.beta is not None)  # `_segmented` recorded the text
        segment = (anchors + 1) // SEGMENT
        start = text.states[rows, segment]
        positions = anchors[:, None] - SEGMENT + 1 + torch.arange(SEGMENT, device=anchors.device)
        live = positions >= (segment * SEGMENT)[:, None]
        at = (rows[:, None], positions.clamp(min=0))
        q, k, v, g, beta = (x[at] for x in (text.query, text.key, text.value, text.g, text.beta))
        kernel = chunked_by_segment(self.kernels.chunked)
        _, state = kernel(q, k, v, g=g * per_position(live, g), beta=beta * per_position(live, beta),
                          initial_state=start, output_final_state=True, **text.kwargs)
        return state

    def _seeded(self, module: nn.Module, conv: torch.Tensor, state: torch.Tensor) -> DynamicCache:
        """A cache whose layer `module.layer_idx` continues from these conv and recurrent states, one row a block."""
        cache = DynamicCache(config=self.config)
        layer = cache.layers[module.layer_idx]
        layer.lazy_initialization(conv_states=conv[:, :, :0], recurrent_states=state[:0],
                                  conv_kernel_size=conv.shape[-1])
        layer.conv_states[0], layer.recurrent_states[0] = conv, state  # the module updates both in place
        layer.has_previous_state[0] = True
        return cache

    def _group_size(self, text: TextRecord) -> int:
        """Blocks per call: a block's advance holds its state and `SEGMENT` positions of kernel inputs, with the
        chunked kernel's fp32 copies and products of them (~4x)."""
        assert text.states is not None and text.key is not None and text.value is not None  # the text ran
        state = text.states[0, 0].numel()
        heads = text.value.shape[2]
        inputs = heads * (2 * text.key.shape[-1] + text.value.shape[-1] + 2)  # per position
        return max(1, GROUP_BYTES // (4 * (state + 4 * SEGMENT * inputs)))


def _dispatching(module: nn.Module, replay: LinearReplay) -> Callable:
    """The module's forward: `LinearReplay.layer` while this thread runs a packed layout, its own otherwise."""
    forward = module.forward

    def run(hidden_states: torch.Tensor, cache: Any = None, attention_mask: Any = None, **kwargs: Any) -> Any:
        rows = getattr(_LOCAL, "rows", None)
        if rows is None:
            return forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        return replay.layer(module, forward, rows, hidden_states, **kwargs)

    return run


def chunked_by_segment(kernel: Callable) -> Callable:
    """The chunked kernel in chunks of `SEGMENT` positions where it takes a chunk size (transformers' torch kernel
    pads every call to 64 positions, four times a 16-token block's work); a kernel with a fixed tile (fla) as is."""
    if "chunk_size" in inspect.signature(kernel).parameters:
        return partial(kernel, chunk_size=SEGMENT)
    return kernel


def _segmented(text: TextRecord) -> Callable:
    """The chunked kernel run `SEGMENT` positions at a time, keeping its inputs and the state at every segment
    boundary (after 0, SEGMENT, 2·SEGMENT, ... positions) in `text`."""

    def wrap(kernel: Callable, _recurrent: Callable) -> Callable:
        def run(query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
            kwargs.pop("chunk_size", None)
            text.query, text.key, text.value, text.g, text.beta, text.kwargs = query, key, value, g, beta, kwargs
            kernel_ = chunked_by_segment(kernel)
            outputs, states, state = [], [], initial_state
            for s in range(0, query.shape[1], SEGMENT):
                part = slice(s, s + SEGMENT)
                out, state = kernel_(query[:, part], key[:, part], value[:, part], g=g[:, part], beta=beta[:, part],
                                    initial_state=state, output_final_state=True, **kwargs)
                outputs.append(out)
                states.append(state)
            first = torch.zeros_like(states[0]) if initial_state is None else initial_state.to(states[0])
            text.states = torch.stack([first, *states], dim=1)
            return torch.cat(outputs, dim=1), state if output_final_state else None

        return run

    return wrap


def _blocks(rows: PackedRows, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every block of the layout, flattened: its batch row, its anchor and its first packed position."""
    batch, anchors, starts = [], [], []
    for b, row in enumerate(rows.rows):
        m = len(row.anchors)
        batch.append(torch.full((m,), b, dtype=torch.long, device=device))
        anchors.append(row.anchors.to(device))
        starts.append(row.prefix_len + torch.arange(m, device=device) * row.span)
    return torch.cat(batch), torch.cat(anchors), torch.cat(starts)
