"""Padding helpers shared by the decoders."""

from __future__ import annotations

import torch


def left_pad(seqs: list[list[int]], *, pad_id: int, device: torch.device | str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, T] and a 0/1 mask, so every row's last prompt token sits in the same column."""
    return _pad(seqs, pad_id=pad_id, device=device, left=True)


def right_pad(seqs: list[list[int]], *, pad_id: int, device: torch.device | str = "cpu"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and a 0/1 mask, so every row starts in column 0 and its padding is free room
    where a cache that packs each row's entries to the left writes next."""
    return _pad(seqs, pad_id=pad_id, device=device, left=False)


def _pad(seqs: list[list[int]], *, pad_id: int, device: torch.device | str, left: bool
         ) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        cols = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[row, cols] = torch.tensor(seq, dtype=torch.long)
        mask[row, cols] = 1
    return ids.to(device), mask.to(device)
