"""Checkpoints: the drafter in the public DFlash format plus everything needed to resume exactly.

A checkpoint directory is written under a temporary name and renamed into place, so a crash mid-write never
leaves a half checkpoint that a restart would pick up.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from opd.models.drafter import DFlashDrafter

STATE_FILE = "trainer_state.pt"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: Path, step: int, drafter: DFlashDrafter, state: dict) -> Path:
    final = checkpoint_dir(run_dir) / f"step-{step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save_pretrained(tmp)
    torch.save(state, tmp / STATE_FILE)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None for a fresh run."""
    root = checkpoint_dir(run_dir)
    done = sorted(p for p in root.glob("step-*") if not p.name.endswith(".tmp") and (p / STATE_FILE).exists())
    return done[-1] if done else None


def load_state(path: Path) -> dict:
    return torch.load(Path(path) / STATE_FILE, weights_only=False)
