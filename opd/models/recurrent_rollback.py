"""Exact per-row rollback of a target's Gated DeltaNet layers (`kinds/gated_deltanet.py`) in speculative decoding.

A linear-attention layer's cache is a conv state (the last `kernel` inputs of its causal conv) and a recurrent
state, with no per-token columns: packing columns (`compaction.py`) cannot roll it back, and transformers' `crop`
trims the conv state but keeps the recurrent state advanced past the rejected tokens. Rows of a batch keep
different counts of a verified block (and of a right-padded prompt), so each row needs the state after exactly its
own kept tokens.

Two exact ways: keep the recurrent state at every position of the verified block and pick each row's, or snapshot
the state before verification and re-run each row's accepted tokens. Per-position states cost B·K·heads·dk·dv
values per layer (2 MB a token a layer at Qwen3.5-9B's 32×128×128 in fp32: 24 GB for 32 rows of 16 tokens over 24
layers), and re-running the accepted tokens through the whole target costs a second forward. Neither is needed:
a layer's kernel inputs (q, k, v, gate, beta) at the accepted positions are what the verification forward computed,
since attention is causal. So while `recording` is active each linear layer's kernel runs as usual and its inputs
and starting state are kept (about heads·(2·dk + dv + 2) values a token); `keep` then re-runs only the layer's own
recurrent rule (transformers' `torch_recurrent_gated_delta_rule`, what its single-token decode runs) from that
state over each row's kept positions, and sets the conv state from the recorded conv inputs
(`activate_past_recording`). That costs up to K state updates per layer, no forward (measured against both
alternatives by bench/recurrent_rollback.py).
A right-padded prefill needs no recording (`prefill`): past each row's end the kernel's gate and write strength are
zeroed, so the state passes through the padding unchanged, and each layer's conv inputs are cut per row as soon as
it has run (recording a long prompt's kernel inputs would hold about 400 KB a token at Qwen3.5-9B).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache

from opd.models.deltanet import DeltaNetKernels, conv_window, per_position
from opd.models.linear_replay import chunked_by_segment


class RecurrentRollback:
    """Keeps a target's linear-attention states exact per row; one per decoder (the model's layers are fixed)."""

    def __init__(self, model: nn.Module, kernels: DeltaNetKernels) -> None:
        self.model = model
        self.kernels = kernels
        self.layers = self.kernels.layers
        self._calls: list[dict[str, Any]] = []  # per linear layer, in call order: its kernel's inputs

    def new_cache(self) -> DynamicCache:
        """A cache whose linear layers keep every conv input until they are trimmed per row."""
        cache = DynamicCache(config=self.model.config)
        cache.activate_past_recording()
        return cache

    @contextmanager
    def prefill(self, cache: Cache, lengths: torch.Tensor, width: int) -> Iterator[None]:
        """A forward over prompts right-padded to `width` (row b real for its first lengths[b] positions) that
        leaves each row's own states in `cache`: past a row's end its gate and write strength are zeroed, so the
        kernel carries the state through the padding unchanged (no decay, no write), and each layer's conv inputs
        are cut to the row's window as soon as the layer has run, so a long prompt's are never held for every
        layer at once. The chunked kernel runs in packed replay's chunks (`chunked_by_segment`): transformers' torch
        kernel would pad a short prompt to 64 positions."""
        real = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]

        def masked(kernel: Any, _recurrent: Any):
            chunked = chunked_by_segment(kernel)

            def run(query, key, value, g, beta, **kwargs):
                kwargs.pop("chunk_size", None)
                return chunked(query, key, value, g=g * per_position(real, g), beta=beta * per_position(real, beta),
                              **kwargs)

            return run

        def trim(module: nn.Module, _inputs: Any, _output: Any) -> None:
            layer = cache.layers[module.layer_idx]
            layer.conv_states[0] = _conv_window(layer.conv_states[0], width, lengths, layer.conv_kernel_size[0])

        hooks = [m.register_forward_hook(trim) for m in self.kernels.modules]
        try:
            with self.kernels.wrapped(masked):
                yield
        finally:
            for hook in hooks:
                hook.remove()

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Within it every call of the linear layers' kernels also records its inputs, in layer order, for `keep`."""
        self._calls = []
        with self.kernels.wrapped(self._recorder):
            yield

    def keep(self, cache: Cache, kept: torch.Tensor) -> None:
        """After a recorded forward of T new positions, set row b's states to those after its first kept[b]."""
        if len(self._calls) != len(self.layers):
            raise RuntimeError(f"recorded {len(self._calls)} linear layers of {len(self.layers)}")
        recurrent = self.kernels.recurrent
        for index, call in zip(self.layers, self._calls):
            layer = cache.layers[index]
            state = _replayed_state(recurrent, call, kept)
            layer.recurrent_states[0] = state.to(layer.recurrent_states[0].dtype)
            new = call["query"].shape[1]
            layer.conv_states[0] = _conv_window(layer.conv_states[0], new, kept, layer.conv_kernel_size[0])
        self._calls = []

    def _recorder(self, kernel: Any, recurrent: Any):
        """`kernel`, which also keeps the call's inputs for `keep`. A call continuing from a state (a verified
        block) runs the recurrent rule, as the model's own decode does: the chunked one pads every call to its
        chunk (64 positions), 16 times the work of a 4-token block."""

        def run(query, key, value, g, beta, initial_state=None, **kwargs):
            rule = kernel if initial_state is None else recurrent
            start = None if initial_state is None else initial_state.clone()  # the cache updates it in place
            self._calls.append(dict(query=query, key=key, value=value, g=g, beta=beta, initial_state=start,
                                    kwargs={k: v for k, v in kwargs.items() if k not in ("chunk_size",
                                                                                       "output_final_state")}))
            if rule is recurrent:
                kwargs.pop("chunk_size", None)
            return rule(query, key, value, g=g, beta=beta, initial_state=initial_state, **kwargs)

        return run


def _replayed_state(recurrent: Any, call: dict[str, Any], kept: torch.Tensor) -> torch.Tensor:
    """Each row's recurrent state after its first kept[b] positions of a recorded kernel call: the recurrent rule
    stepped from the call's starting state, each row's state taken at its own step."""
    state, result = call["initial_state"], torch.empty(0)
    for t in range(int(kept.max())):  # every row keeps at least its anchor: one step at least
        sl = slice(t, t + 1)
        _, state = recurrent(call["query"][:, sl], call["key"][:, sl], call["value"][:, sl], g=call["g"][:, sl],
                             beta=call["beta"][:, sl], initial_state=state, output_final_state=True,
                             **call["kwargs"])
        result = state if t == 0 else torch.where((kept == t + 1).view(-1, 1, 1, 1), state, result)
    return result.contiguous()


def _conv_window(recorded: torch.Tensor, new: int, kept: torch.Tensor, kernel: int) -> torch.Tensor:
    """Each row's last `kernel` conv inputs up to its kept[b]-th new position, from the recorded inputs
    [B, C, old + new]."""
    rows = torch.arange(recorded.shape[0], device=kept.device)
    return conv_window(recorded, rows, recorded.shape[-1] - new + kept, kernel)
