"""Versioned draft-weight snapshots: what the learner publishes and rollout adopts.

A snapshot carries its version and a checksum of every tensor, so a rollout actor can verify it received the
complete weights of the version it expects before it swaps them in — a half-loaded or corrupted drafter must
never produce rollouts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from opd.errors import OpdError


def checksum(state: dict[str, torch.Tensor]) -> str:
    """blake2b over names, shapes, dtypes and bytes, in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class WeightSnapshot:
    version: int
    state: dict[str, torch.Tensor]
    checksum: str

    @classmethod
    def of(cls, state: dict[str, torch.Tensor], version: int) -> WeightSnapshot:
        cpu = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        return cls(version, cpu, checksum(cpu))

    def verified(self, expected_version: int | None = None) -> WeightSnapshot:
        """Self, after checking the version and that every tensor still hashes to the checksum."""
        if expected_version is not None and self.version != expected_version:
            raise OpdError(f"weight broadcast: got version {self.version}, expected {expected_version}")
        if checksum(self.state) != self.checksum:
            raise OpdError(f"weight broadcast v{self.version}: checksum mismatch (corrupted or incomplete weights)")
        return self
