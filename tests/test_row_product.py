"""The drafter's per-row products on CPU in bfloat16 and float16 (opd/models/row_product.py): the same bits as
the batched product matmul runs on a slice, so a decode writes the same drafts and tokens either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.models import row_product
from opd.models.row_product import per_row
from opd.tiny.micro import micro_drafter, micro_target


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("cut", ["drafted slots", "first columns"])
def test_same_bits_as_the_batched_product(dtype, batch, cut):
    g = torch.Generator().manual_seed(batch)
    weight = (torch.randn(300, 96, generator=g) * 0.1).to(dtype)
    whole = torch.randn(batch, 16, 96, generator=g).to(dtype)
    x = whole[:, 1:] if cut == "drafted slots" else whole[:, :5]
    assert torch.equal(per_row(lambda rows: F.linear(rows, weight), x), F.linear(x, weight))


def test_a_bf16_decode_is_the_same_with_the_batched_products(monkeypatch):
    """End to end on CPU in bfloat16: the per-row products decode the drafts and responses of the batched ones,
    at batch 1 and batched."""
    target = micro_target(seed=0, dtype=torch.bfloat16)
    drafter = micro_drafter(target, seed=1)
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]]

    def decode(batch: int) -> list[tuple[list[int], list[int]]]:
        decoder = SpeculativeDecoder(target, drafter, eos_id=63)
        return [(r.response_ids, r.accepted) for i in range(0, len(prompts), batch)
                for r in decoder.generate(prompts[i : i + batch], Sampling(), max_new_tokens=16)]

    calls = []
    original = row_product.per_row
    monkeypatch.setattr("opd.models.dflash.per_row", lambda f, x: calls.append(x.dtype) or original(f, x))
    ours = {batch: decode(batch) for batch in (1, 3)}
    assert torch.bfloat16 in calls
    monkeypatch.setattr(row_product, "SLOW_BATCHED", ())
    assert {batch: decode(batch) for batch in (1, 3)} == ours
