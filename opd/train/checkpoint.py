"""Checkpoints: the drafter in the public DFlash format plus everything needed to resume exactly.

A checkpoint directory is written under a temporary name of its own (two writers never share one) and renamed
into place (opd/outputs.py), so a crash mid-write never leaves a half checkpoint that a restart would pick up.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from opd.errors import OpdError
from opd.models.protocol import Drafter
from opd.outputs import atomic_dir
from opd.spec import ExperimentSpec, field_default, flatten

STATE_FILE = "trainer_state.pt"
# Sections a resumed run may change: how long it runs (in any unit, and the pool size it is counted over), how it
# is placed, evaluated and logged. The memory layout of a step (micro-batches by count or token budget, the
# scorer's, the loss chunk) is one too: the step's loss is normalised over the whole step, so changing it to fit
# memory does not change the gradient.
RESUMABLE_CHANGES = ("name", "steps", "rollout_batches", "epochs", "data.train_pool_size", "engine", "resources.",
                     "tracking.", "eval.", "optim.micro_batch_size", "optim.micro_batch_tokens",
                     "replay.micro_batch_tokens", "optim.loss_chunk_size")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: Path, step: int, drafter: Drafter, state: dict, *, keep_last: int | None = None,
                    resumed_from: Path | None = None) -> Path:
    """Write step `step`'s checkpoint; then, with `keep_last`, delete all but the newest `keep_last` (see
    `prune_checkpoints`)."""
    final = checkpoint_dir(run_dir) / f"step-{step:07d}"
    with atomic_dir(final) as tmp:
        drafter.save_pretrained(tmp)
        torch.save(state, tmp / STATE_FILE)
    if keep_last is not None:
        prune_checkpoints(run_dir, keep_last, resumed_from)
    return final


def checkpoint_step(path: str | Path) -> int:
    """The learner step a checkpoint directory holds (`step-0000060` → 60)."""
    return int(Path(path).name.removeprefix("step-"))


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Every complete checkpoint, oldest first."""
    root = checkpoint_dir(run_dir)
    return sorted(p for p in root.glob("step-*") if ".tmp" not in p.name and (p / STATE_FILE).exists())


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None for a fresh run."""
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def prune_checkpoints(run_dir: Path, keep_last: int, resumed_from: Path | None = None) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep_last` (at Qwen3-4B each is about 4 GB); returns
    them. Called only after a save succeeded, so the newest is never at risk. The one this run resumed from is
    kept until the next resume (keep_last + 1 then): it is the last state known to load and to have trained on,
    and learner ranks may still be reading it."""
    keep = {Path(resumed_from).resolve()} if resumed_from is not None else set()
    old = [p for p in complete_checkpoints(run_dir)[:-keep_last] if p.resolve() not in keep]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def remove_partial_checkpoints(run_dir: Path) -> None:
    """Delete what killed runs left half-written; only safe under the run directory's lock (opd/run_dir.py)."""
    for tmp in checkpoint_dir(run_dir).glob("step-*.tmp*"):
        shutil.rmtree(tmp, ignore_errors=True)


def load_state(path: Path) -> dict:
    return torch.load(Path(path) / STATE_FILE, weights_only=False)


def recorded_fields(path: str | Path) -> dict[str, str] | None:
    """The spec fields a run's checkpoint recorded (`training_fields`), read with the rest of its state left on
    disk (memory-mapped: the learner's state is the optimizer's size); None for a directory that is not a run's
    checkpoint, or one that recorded none."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        return None
    return torch.load(file, mmap=True, weights_only=False).get("spec")


def training_fields(spec: ExperimentSpec) -> dict[str, str]:
    """The spec fields that shape the trained drafter (saved with every checkpoint)."""
    return {k: v for k, v in flatten(spec).items() if not k.startswith(RESUMABLE_CHANGES)}


def check_same_training(path: Path, saved: dict[str, str] | None, spec: ExperimentSpec) -> None:
    """Refuse to resume a run whose spec changed what it trains: it would silently continue another experiment
    (a new warm drafter, learning rate or loss) from this one's weights."""
    if saved is None:
        return
    now = training_fields(spec)

    def trained(key: str) -> str | None:
        """A field newer than the run was at its default then: the code the run trained with had no other value."""
        return saved[key] if key in saved else field_default(key)

    changed = sorted(k for k in saved.keys() | now.keys() if trained(k) != now.get(k))
    if changed:
        k = changed[0]
        newer = "" if k in saved else " (its default: the field is newer than the run)"
        raise OpdError(f"{path}: this run was trained with {k}={trained(k)}{newer} but the spec now says "
                       f"{now.get(k)} ({len(changed)} field(s) differ); resume with the same spec, or start fresh "
                       f"with another tracking.run_dir")
