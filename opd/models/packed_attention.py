"""Attention over packed blocks without dense masks: the teacher's packed replay rows and the student's blocks.

Packed replay lays one sequence out as a committed prefix of P tokens followed by M drafted blocks of `span`
tokens; block m sees the prefix up to its anchor and itself causally. As a dense [L, L] mask that is 529M
elements at a 2048-token response and τ 1.4 (L ≈ 23K), and SDPA turns it into a bias per layer. Here the prefix
runs as plain causal attention, and the blocks run a chunk of blocks at a time against [the prefix up to the
chunk's last anchor; the chunk's own blocks], with a small bool mask built on the device from anchor and offset
vectors. A chunk holds about `CHUNK_ROWS` query rows, so the transient memory of a call is linear in L, and no
compute is spent on keys that no query of the chunk sees. When the prefix already ran (a scorer that rebuilds
blocks takes the text's keys and values from its forward over the text, `PackedRows.cached`), only the block rows
are queries and the prefix's keys come from the KV cache. The student (`BlockChunks`) is the same idea on the
drafter's own attention: block m sees valid context positions before its anchor and its whole own block.

GQA: masked calls fold each key/value head's G query heads into the query axis ([B, kv, G·S, d]), so keys and
values are never copied, on every SDPA kernel and torch version (SDPA's `enable_gqa` with a mask drops CUDA to
the math kernel); unmasked calls (the causal prefix, a draft that sees every key) use `enable_gqa`, which the
flash kernels take, and which spares the fold's copies of the queries and of the output.

The teacher is a Hugging Face model, and models differ in the masks their forwards take: Qwen3's takes a dict
{layer type: mask}, Llama's and Qwen3-MoE's one mask. What every decoder takes is a prepared 4-D mask: HF's mask
builders (`create_causal_mask` and its sliding-window sibling) return one unchanged, and the decoder hands it to every
layer's attention function, looked up by name from `config._attn_implementation` in HF's `AttentionInterface`. So
the layout travels as `PackedMask`, a 4-D bool tensor of no memory that carries its `PackedRows`. Importing this
module registers, under the existing names ("sdpa", "eager", "flash_attention_2"), wrappers that run the packed
path for a `PackedMask` and otherwise call the original function unchanged. So a flash-attention target replays
packed rows without its shared config ever being switched (actors run two threads on one model).

Layer kinds (`LayerRule`): the `PackedMask` carries the target's kind of every layer (opd/models/layer_kind.py),
and HF hands every attention function the layer's sinks (`s_aux`, gpt-oss). A kind that narrows its keys (a
sliding window, an attention chunk) narrows the prefix and every block by position (`LayerKind.sees`; the prefix
then runs a chunk of queries at a time over the keys the kind reaches, so such a layer also costs less); sinks
enter each softmax as one more key (`with_sink_key`), so they need no kernel of their own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from opd.errors import OpdError
from opd.formats.layer_attention import LayerAttention
from opd.models.cpu_gqa import cpu_masked_gqa
from opd.models.layer_kind import LayerKind

CHUNK_ROWS = 1024  # block query rows per attention call: bounds its mask at CHUNK_ROWS x (prefix + CHUNK_ROWS)
_GQA_KWARG = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # SDPA's enable_gqa


# ------------------------------------------------------------------------------------------------ kernels


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scale: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA with a bool mask [B|1, 1, S, T] (None: every key) for q [B, H, S, d] and k, v [B, kv, T, d],
    H = G·kv: query head h uses key head h // G (HF's repeat_kv order), computed without copying keys or values.
    `sinks` [H]: a logit per head that enters every softmax (gpt-oss), as `with_sink_key` lays it out."""
    if sinks is not None:
        q, k, v, mask, scale = with_sink_key(q, k, v, mask, scale, sinks)
    batch, heads, rows, dim = q.shape
    groups = heads // k.shape[1]
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if mask is None and _GQA_KWARG:  # a draft at batch 1: no copy of the queries in, nor of the output out
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    folded = q.reshape(batch, k.shape[1], groups * rows, dim)
    mask = None if mask is None else mask.repeat(1, 1, groups, 1)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
    return out.view(batch, heads, rows, v.shape[-1])


def with_sink_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None,
                  sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float]:
    """Sinks as one more key per key head, seen by every query: each query gains a coordinate holding its own
    head's sink logit, the sink key holds 1/scale there (the real keys 0) and a zero value, so its score is exactly
    the sink and it only adds exp(sink) to the softmax's denominator, as gpt-oss's eager attention does. Padded
    to a multiple of 8 dimensions, which the fused kernels take; the explicit scale keeps the original one."""
    batch, heads, rows, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
    pad = 8 - dim % 8
    q = F.pad(q, (0, pad))
    q[..., dim] = sinks.to(q.dtype).view(1, heads, 1)
    sink_key = k.new_zeros(k.shape[0], k.shape[1], 1, dim + pad)
    sink_key[..., dim] = 1 / scale
    k = torch.cat([sink_key, F.pad(k, (0, pad))], dim=2)
    v = torch.cat([v.new_zeros(v.shape[0], v.shape[1], 1, v.shape[3]), v], dim=2)
    mask = None if mask is None else torch.cat([mask.new_ones(*mask.shape[:-1], 1), mask], dim=-1)
    return q, k, v, mask, scale


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Plain causal attention (no mask tensor at all, so flash kernels apply) with GQA."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not _GQA_KWARG:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    extra: dict[str, Any] = {"enable_gqa": True} if groups > 1 and _GQA_KWARG else {}
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **extra)


# ------------------------------------------------------------------------------------------------ teacher


@dataclass(frozen=True)
class LayerRule:
    """What one target layer adds to the packed layout: its `kind`'s narrowing of the keys, by position (None: a
    layer of no target, which narrows nothing), and `sinks` [H] (a logit per head in every softmax). A row's prefix
    runs as plain causal attention only for a layer with neither."""

    kind: LayerKind | None = None
    sinks: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        return (self.kind is None or not self.kind.narrows) and self.sinks is None

    def lowest_key(self, position: int) -> int:
        """The lowest key position a query at `position` sees."""
        return 0 if self.kind is None else self.kind.lowest_key(position)

    def narrow(self, sees: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """`sees` narrowed by the kind, for query positions [rows, 1] and key positions [1, keys]."""
        narrowed = None if self.kind is None else self.kind.sees(queries, keys)
        return sees if narrowed is None else sees & narrowed


@dataclass(frozen=True)
class PackedRow:
    """One packed row: causal over rows [0, prefix_len); then one block of `span` rows per anchor, block m seeing
    prefix rows <= anchors[m] and itself causally; rows after the last block are padding (output zero). Prefix row
    i is at position i, block m's row j at anchors[m] + 1 + j (`replay.pack`), which a layer's window reads.
    `chunks` are (first block, end block, lowest anchor, prefix keys seen) per attention call, planned on the CPU."""

    prefix_len: int
    span: int
    anchors: torch.Tensor  # [M] long, on the model's device
    chunks: tuple[tuple[int, int, int, int], ...]
    chunk_rows: int = CHUNK_ROWS

    @classmethod
    def of(cls, prefix_len: int, anchors: list[int], span: int, chunk_rows: int = CHUNK_ROWS) -> PackedRow:
        if span <= 0 or not anchors:
            return cls(prefix_len, max(span, 1), torch.zeros(0, dtype=torch.long), (), chunk_rows)
        if min(anchors) < 0 or max(anchors) >= prefix_len:
            raise OpdError(f"packed row: anchors must lie in the prefix [0, {prefix_len}), got {min(anchors)}.."
                           f"{max(anchors)}")
        per = max(1, chunk_rows // span)
        chunks = tuple((m, min(m + per, len(anchors)), min(anchors[m : m + per]), max(anchors[m : m + per]) + 1)
                       for m in range(0, len(anchors), per))
        return cls(prefix_len, span, torch.tensor(anchors, dtype=torch.long), chunks, chunk_rows)

    @property
    def length(self) -> int:
        """Rows used: prefix plus blocks."""
        return self.prefix_len + self.block_rows

    @property
    def block_rows(self) -> int:
        return len(self.anchors) * self.span

    def to(self, device: torch.device | str) -> PackedRow:
        return replace(self, anchors=self.anchors.to(device))

    def chunk_mask(self, first: int, end: int, lo: int, keys: int, rule: LayerRule = LayerRule()) -> torch.Tensor:
        """Bool [rows, keys − lo + rows] for blocks first..end-1 over [prefix keys lo..keys-1; their own rows]."""
        device = self.anchors.device
        rows = torch.arange((end - first) * self.span, device=device)
        block, offset = rows // self.span, rows % self.span
        anchors = self.anchors[first:end][block]
        prefix = torch.arange(lo, keys, device=device)
        sees_prefix = prefix[None, :] <= anchors[:, None]
        sees_own = (block[:, None] == block[None, :]) & (offset[None, :] <= offset[:, None])
        if not rule.plain:
            positions = anchors + 1 + offset
            sees_prefix = rule.narrow(sees_prefix, positions[:, None], prefix[None, :])
            sees_own = rule.narrow(sees_own, positions[:, None], positions[None, :])
        return torch.cat([sees_prefix, sees_own], dim=1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               scale: float | None, cached: int = 0, rule: LayerRule = LayerRule()) -> None:
        """Fill out [1, H, L, d] from q [1, H, L, d] and k, v [1, kv, L, d] of this row. `cached` > 0: the prefix
        ran before (its keys and values are the first `cached` of k, v, from a KV cache) and q holds the block
        rows alone, so k, v are [1, kv, cached + L, d]."""
        p = self.prefix_len
        if not cached:
            self._attend_prefix(q, k, v, out, scale, rule)
        q0, k0 = (0, cached) if cached else (p, p)  # where the block rows start among the queries and the keys
        for first, end, low, keys in self.chunks:
            r0, r1 = first * self.span, end * self.span
            lo = min(rule.lowest_key(low + 1), keys)  # the chunk's earliest query is its lowest anchor + 1
            keys_k = torch.cat([k[:, :, lo:keys], k[:, :, k0 + r0 : k0 + r1]], dim=2)
            keys_v = torch.cat([v[:, :, lo:keys], v[:, :, k0 + r0 : k0 + r1]], dim=2)
            mask = self.chunk_mask(first, end, lo, keys, rule)[None, None]
            out[:, :, q0 + r0 : q0 + r1] = grouped_sdpa(q[:, :, q0 + r0 : q0 + r1], keys_k, keys_v, mask, scale,
                                                        rule.sinks)

    def _attend_prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       scale: float | None, rule: LayerRule) -> None:
        """The prefix: one plain causal call, or, under a narrowing kind or sinks, `chunk_rows` queries at a time
        over the keys they can see, with a small mask (never [P, P])."""
        p = self.prefix_len
        if rule.plain:
            out[:, :, :p] = causal_sdpa(q[:, :, :p], k[:, :, :p], v[:, :, :p], scale)
            return
        for start in range(0, p, self.chunk_rows):
            end = min(start + self.chunk_rows, p)
            lo = rule.lowest_key(start)
            queries, keys = torch.arange(start, end, device=q.device), torch.arange(lo, end, device=q.device)
            mask = rule.narrow(keys[None, :] <= queries[:, None], queries[:, None], keys[None, :])
            out[:, :, start:end] = grouped_sdpa(q[:, :, start:end], k[:, :, lo:end], v[:, :, lo:end],
                                                mask[None, None], scale, rule.sinks)


@dataclass(frozen=True)
class PackedRows:
    """The attention layout of a padded batch of packed rows, each `length` long: what the target takes in place
    of a [B, 1, L, L] mask. `cached` > 0: the rows' prefixes are already in the target's KV cache (each row's text,
    right-padded to `cached` positions) and the forward runs the block rows alone, `length` per batch row."""

    rows: tuple[PackedRow, ...]
    length: int
    cached: int = 0

    def __post_init__(self) -> None:
        too_long = [n for n in (r.block_rows if self.cached else r.length for r in self.rows) if n > self.length]
        if too_long:
            raise OpdError(f"packed rows: a row needs {max(too_long)} positions, the batch is {self.length} long")
        if self.cached and any(r.prefix_len > self.cached for r in self.rows):
            raise OpdError(f"packed rows: a prefix is longer than the {self.cached} cached positions")

    def to(self, device: torch.device | str) -> PackedRows:
        return PackedRows(tuple(r.to(device) for r in self.rows), self.length, self.cached)

    def as_mask(self, device: torch.device | str, kinds: tuple[LayerKind, ...] = ()) -> PackedMask:
        """This layout as the 4-D mask [B, 1, L, cached + L] every HF decoder passes through to its layers: a
        stride-0 view of one False (no memory), so only the wrappers below, which read the layout, can use it.
        `kinds`: the target's kind of each decoder layer, which narrows that layer's keys."""
        shape = (len(self.rows), 1, self.length, self.cached + self.length)
        mask = torch.zeros((), dtype=torch.bool, device=device).expand(shape).as_subclass(PackedMask)
        mask.packed_rows, mask.layer_kinds = self, kinds
        return mask

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float | None, rule: LayerRule = LayerRule()) -> torch.Tensor:
        """HF's attention contract: q [B, H, L, d], k [B, kv, cached + L, d], v [B, kv, cached + L, dv] ->
        [B, L, H, dv]."""
        if query.shape[0] != len(self.rows) or query.shape[2] != self.length:
            raise OpdError(f"packed rows: layout is {len(self.rows)} x {self.length}, queries are "
                           f"{query.shape[0]} x {query.shape[2]}")
        if key.shape[2] != self.cached + self.length:
            raise OpdError(f"packed rows: expected {self.cached} cached + {self.length} keys, got {key.shape[2]}")
        batch, heads, length, _ = query.shape
        # as wide as the values (latent attention's differ from its queries'); written through a [B, H, L, dv]
        # view, so no final copy
        out = query.new_zeros(batch, length, heads, value.shape[-1])
        for b, row in enumerate(self.rows):
            row.attend(query[b : b + 1], key[b : b + 1], value[b : b + 1], out[b : b + 1].transpose(1, 2), scale,
                       self.cached, rule)
        return out


class PackedMask(torch.Tensor):
    """A `PackedRows` layout in the form of a prepared 4-D attention mask (`PackedRows.as_mask`): a tensor is what
    HF's mask builders pass through unchanged, whichever form of mask the model's forward builds."""

    packed_rows: PackedRows  # (`layout` is taken: every tensor has one)
    layer_kinds: tuple[LayerKind, ...]  # decoder layer i's kind; empty: no layer narrows its keys

    def __getitem__(self, index: Any) -> torch.Tensor:
        """Some forwards slice their masks to the rows they keep (Gemma 4 before its KV-sharing layers, all of
        them when every row's output is wanted, as here): a slice that keeps the whole layout still carries it."""
        out = super().__getitem__(index)
        if isinstance(out, PackedMask) and out.shape == self.shape:
            out.packed_rows, out.layer_kinds = self.packed_rows, self.layer_kinds
        return out

    def rule(self, module: torch.nn.Module, sinks: torch.Tensor | None) -> LayerRule:
        """The packed rule of the layer whose attention `module` is (HF attention modules know their `layer_idx`)."""
        if not self.layer_kinds:
            return LayerRule(None, sinks)
        index = getattr(module, "layer_idx", None)
        if index is None:
            raise OpdError(f"packed replay: {type(module).__name__} has no `layer_idx` to find its layer kind by")
        return LayerRule(self.layer_kinds[index], sinks)


def _packed_or(original: Callable[..., Any]) -> Callable[..., Any]:
    """An HF attention function that runs a `PackedMask`'s rows itself and hands every other mask to
    `original`. The layer's kind comes with the mask, its sinks as HF hands them to every attention function
    (`s_aux`)."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if not isinstance(attention_mask, PackedMask):
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        rule = attention_mask.rule(module, kwargs.get("s_aux"))
        return attention_mask.packed_rows.attend(query, key, value, kwargs.get("scaling"), rule), None

    attention.packed_original = original  # type: ignore[attr-defined]  # the marker `_register` looks for
    return attention


def _model_eager(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """HF's "eager" is each model file's own `eager_attention_forward` (the default `get_interface` falls back
    to), so the wrapper calls the one beside the attention module's class."""
    return sys.modules[type(module).__module__].eager_attention_forward(module, *args, **kwargs)


@contextmanager
def as_shipped() -> Iterator[None]:
    """Transformers' attention functions without the wrappers `_register` installs, for a baseline that must run
    as its own users run it (z-lab's decoder and `generate` in bench/decode_vs_zlab.py). The registry is global:
    nothing else may run attention meanwhile."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    wrapped = dict(ALL_ATTENTION_FUNCTIONS._global_mapping)
    for name, function in wrapped.items():
        while hasattr(function, "packed_original") or hasattr(function, "original"):
            function = getattr(function, "packed_original", None) or function.original
        ALL_ATTENTION_FUNCTIONS._global_mapping[name] = function
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS._global_mapping.update(wrapped)


def _register() -> None:
    """Wrap the attention functions the targets use, once per process (sdpa also skips masked CPU calls' key and
    value copies: opd/models/cpu_gqa.py)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in ("sdpa", "eager", "flash_attention_2"):
        current = ALL_ATTENTION_FUNCTIONS.get(name, _model_eager if name == "eager" else None)
        if current is not None and not hasattr(current, "packed_original"):
            AttentionInterface.register(name, _packed_or(cpu_masked_gqa(current) if name == "sdpa" else current))


_register()


# ------------------------------------------------------------------------------------------------ student


@dataclass(frozen=True)
class BlockChunks:
    """The drafter's training attention: M blocks of K rows per batch row, block m seeing the valid context
    positions before anchors[b, m] and its own block, run a chunk of blocks at a time. Context index == position
    (`forward_blocks`' contract). `attention` is the layer's rule on top (z-lab's causality and sliding window,
    opd/formats/layer_attention.py); the plain DFlash layer sees its whole own block. A windowed layer's chunk skips
    the context keys that no query of the chunk can reach."""

    context_valid: torch.Tensor  # [B, C] bool
    anchors: torch.Tensor  # [B, M]
    block_size: int
    chunks: tuple[tuple[int, int, int, int], ...]  # (first block, end block, lowest anchor, context keys seen)
    attention: LayerAttention = LayerAttention()

    @classmethod
    def of(cls, context_valid: torch.Tensor, anchors: torch.Tensor, block_size: int,
           chunk_rows: int = CHUNK_ROWS) -> BlockChunks:
        """Plan the chunks; reads the anchors' per-block extremes once (one host sync per forward)."""
        per, num_blocks, context = max(1, chunk_rows // block_size), anchors.shape[1], context_valid.shape[1]
        highs, lows = torch.stack([anchors.amax(0), anchors.amin(0)]).tolist() if anchors.numel() else ([], [])
        chunks = tuple((m, min(m + per, num_blocks), min(lows[m : m + per]), min(context, max(highs[m : m + per])))
                       for m in range(0, num_blocks, per))
        return cls(context_valid.bool(), anchors, block_size, chunks)

    def for_layer(self, attention: LayerAttention) -> BlockChunks:
        """The same plan under one layer's rule."""
        return replace(self, attention=attention)

    def chunk_mask(self, first: int, end: int, lo: int, keys: int) -> torch.Tensor:
        """Bool [B, 1, rows, keys - lo + rows] for blocks first..end-1 over [context lo..keys-1; their own rows]."""
        device = self.anchors.device
        rows = torch.arange((end - first) * self.block_size, device=device)
        block, offset = rows // self.block_size, rows % self.block_size
        anchors = self.anchors[:, first:end][:, block]  # [B, rows]
        context_positions = torch.arange(lo, keys, device=device)
        sees_context = self.context_valid[:, None, lo:keys] & (context_positions[None, None, :] < anchors[:, :, None])
        sees_own = (block[:, None] == block[None, :]).expand(len(anchors), -1, -1)
        if not self.attention.plain:
            positions = anchors + offset  # [B, rows]
            sees_context = sees_context & self.attention.sees(positions[:, :, None], context_positions[None, None, :])
            sees_own = sees_own & self.attention.sees(offset[:, None], offset[None, :])
        return torch.cat([sees_context, sees_own], dim=2)[:, None]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               context_kv: tuple[torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
        """q [B, H, M*K, d], block k/v [B, kv, M*K, d], context k/v [B, kv, C, d] -> [B, H, M*K, d].

        With autograd on, each chunk is checkpointed: backward keeps only its output and recomputes the chunk's
        keys and mask, so what training holds stays linear in the blocks instead of chunks x context."""
        outs = []
        for first, end, low_anchor, keys in self.chunks:
            lo = min(self.attention.first_key(low_anchor), keys)
            if torch.is_grad_enabled():
                outs.append(checkpoint(self._chunk, q, k, v, *context_kv, first, end, lo, keys, scale,
                                       use_reentrant=False))
            else:
                outs.append(self._chunk(q, k, v, *context_kv, first, end, lo, keys, scale))
        return torch.cat(outs, dim=2) if outs else torch.zeros_like(q)

    def _chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_k: torch.Tensor,
               context_v: torch.Tensor, first: int, end: int, lo: int, keys: int, scale: float) -> torch.Tensor:
        """Blocks first..end-1 against [context lo..keys-1; their own rows]."""
        r0, r1 = first * self.block_size, end * self.block_size
        keys_k = torch.cat([context_k[:, :, lo:keys], k[:, :, r0:r1]], dim=2)
        keys_v = torch.cat([context_v[:, :, lo:keys], v[:, :, r0:r1]], dim=2)
        return grouped_sdpa(q[:, :, r0:r1], keys_k, keys_v, self.chunk_mask(first, end, lo, keys), scale)
