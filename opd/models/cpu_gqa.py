"""Grouped-query attention with a mask on CPU, without copying keys and values.

Transformers' sdpa attention copies every layer's keys and values G times (`repeat_kv`) whenever it gets a mask,
except on XPU and MPS: on CUDA, SDPA's `enable_gqa` with a mask falls back to the math kernel. A decoding step
always hands the target a mask (its verify block sits at the end of the cache, which sdpa's `is_causal` cannot
express), so on CPU every verification paid for copies that SDPA's CPU kernels do not need: with `enable_gqa`
they read key head h // G in place and give the same bits as on the copies (tests/test_cpu_gqa.py holds every
dtype and mask kind to that). Everything else (CUDA, no mask, a single query, position biases, soft-capping,
sinks) goes to the original function unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# Keyword arguments that transformers' own sdpa function handles and this shortcut does not.
_DELEGATED = ("position_bias", "softcap", "s_aux", "output_attentions")


def cpu_masked_gqa(original: Callable[..., Any]) -> Callable[..., Any]:
    """An HF "sdpa" attention function that runs a masked grouped-query call on CPU itself and hands every other
    call to `original`."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if not _runs_here(module, query, attention_mask, kwargs):
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            is_causal=is_causal, **kwargs)
        # A mask is given, so transformers' sdpa would pass is_causal=False too.
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    attention.original = original  # type: ignore[attr-defined]  # the function it stands in for
    return attention


def _runs_here(module: torch.nn.Module, query: torch.Tensor, mask: Any, kwargs: dict[str, Any]) -> bool:
    """A masked CPU call of a grouped-query layer with nothing but the mask to apply. A single query is left to
    transformers, which folds the heads into the query axis there and copies nothing either."""
    return (query.device.type == "cpu" and isinstance(mask, torch.Tensor) and query.shape[2] > 1
            and getattr(module, "num_key_value_groups", 1) > 1
            and all(kwargs.get(name) is None or kwargs.get(name) is False for name in _DELEGATED))
