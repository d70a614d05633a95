"""A linear layer over a sliced batch, one matrix product per row, where the CPU's batched product is slow.

A decoding step hands the drafter slices: a block's drafted slots ([B, K-1, H] of [B, K, H]) to the LM head, and
the newly committed columns of the target's features to `fc`. matmul cannot fold a slice into one matrix, so it
runs a batched product against the weight broadcast over the batch, at batch 1 too. In bfloat16 and float16,
PyTorch's CPU batched product is several times slower than a loop of matrix products, and at Qwen3's vocabulary
the LM head's takes seconds per draft (`python bench/dflash2_cost.py --shapes qwen3-4b`). Each row of the batched
product is its own matrix product, so the loop gives the same bits (tests/test_row_product.py): drafts stay
independent of the batch and equal to z-lab's, whose decoder hands the head the same slice. In float32 the CPU's
batched product is as fast, and it runs unchanged there and on GPUs, whose batched products were not measured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SLOW_BATCHED = (torch.bfloat16, torch.float16)  # dtypes whose CPU batched product trails a loop of products


def per_row(linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`linear` (a linear layer, or one followed by row-wise work) over x [B, S, H], a row at a time where the CPU's
    batched product would be slow."""
    if x.dim() != 3 or x.device.type != "cpu" or x.dtype not in SLOW_BATCHED:
        return linear(x)
    return torch.stack([linear(row) for row in x.unbind(0)])
