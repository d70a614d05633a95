"""Masked grouped-query attention on CPU without key/value copies (opd/models/cpu_gqa.py): the same bits as
transformers' own sdpa function, which copies them (`repeat_kv`), for every dtype, mask kind and query length a
target meets; and every call it does not cover still goes to transformers' function."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.integrations import sdpa_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.models.cpu_gqa import cpu_masked_gqa
from opd.models.packed_attention import as_shipped
from opd.tiny.micro import micro_drafter, micro_target


class Layer(nn.Module):
    """What transformers' sdpa function reads of an attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def inputs(dtype: torch.dtype, batch: int, heads: int, kv: int, queries: int, keys: int, mask_kind: str):
    g = torch.Generator().manual_seed(queries * 131 + keys)
    q, k, v = (torch.randn(batch, n, length, 64, generator=g).to(dtype)
               for n, length in ((heads, queries), (kv, keys), (kv, keys)))
    seen = torch.rand(batch, 1, queries, keys, generator=g) > 0.3
    seen[..., 0] = True
    mask = seen if mask_kind == "bool" else torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, float("-inf"))
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 16, 100), (16, 4, 2, 8, 90), (3, 32, 8, 16, 300), (2, 8, 1, 2, 33)])
def test_same_bits_as_transformers_copies(dtype, mask_kind, shape):
    q, k, v, mask = inputs(dtype, *shape, mask_kind)
    layer = Layer(shape[1] // shape[2])
    ours, _ = cpu_masked_gqa(sdpa_attention_forward)(layer, q, k, v, mask, dropout=0.0, scaling=0.125)
    theirs, _ = sdpa_attention_forward(layer, q, k, v, mask, dropout=0.0, scaling=0.125)
    assert ours.shape == theirs.shape and ours.is_contiguous()
    assert torch.equal(ours, theirs)


def test_a_decoding_step_copies_no_keys(monkeypatch):
    """The registered sdpa runs a masked target's verification without `repeat_kv`, and decodes the tokens it
    decoded with transformers' own function (the padded rows of a batch make every step masked)."""
    target = micro_target(seed=0, num_heads=4, num_kv_heads=2)
    drafter = micro_drafter(target, seed=1)
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    calls, copy = [], sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: calls.append(a) or copy(*a))

    def decode() -> list[list[int]]:
        return [r.response_ids for r in SpeculativeDecoder(target, drafter, eos_id=63).generate(prompts, Sampling(),
                                                                                       max_new_tokens=12)]

    ours = decode()
    assert not calls
    with as_shipped():
        assert decode() == ours and calls  # transformers' own function does copy them


@pytest.mark.parametrize("case", ["one group", "position bias", "no mask", "one query"])
def test_other_calls_go_to_transformers(case):
    q, k, v, mask = inputs(torch.float32, 1, 4, 4 if case == "one group" else 2, 1 if case == "one query" else 4, 9,
                          "bool")
    seen = []

    def original(*args, **kwargs):
        seen.append(case)
        return sdpa_attention_forward(*args, **kwargs)

    kwargs = {"position_bias": torch.zeros(1, 4, 4, 9)} if case == "position bias" else {}
    cpu_masked_gqa(original)(Layer(q.shape[1] // k.shape[1]), q, k, v, None if case == "no mask" else mask, **kwargs)
    assert seen == [case]
