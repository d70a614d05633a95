"""Padding helpers shared by the decoders."""

from __future__ import annotations

import torch


def left_pad(seqs: list[list[int]], *, pad_id: int, device: torch.device | str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, T] and a 0/1 mask, so every row's last prompt token sits in the same column."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq):] = 1
    return ids.to(device), mask.to(device)
